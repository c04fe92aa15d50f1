"""Adaptive verification's cut rule against a hand-written reference, and in the proposer.

The reference (``reference_counts``) is the rule written out in plain Python with float64
arithmetic: rank every eligible draft slot by its survival (the running product of its
request's confidences), try every budget ``b`` and keep the one with the best expected
tokens per unit of cost. The device rule (``draft_budget_mask``: sort, cumsum, argmax,
scatter) must admit exactly the same drafts per request.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from vllm.v1.spec_decode.dspark.adaptive import (
    CUT,
    NO_BUDGET,
    ROW_COST_ENV,
    VerifyCost,
    apply_cut,
    draft_budget_mask,
    trim_cut,
)
from vllm.v1.spec_decode.dspark.step_plan import DSparkStepInput


def reference_counts(confidence, eligible, row_cost, whole=None):
    """Per request, how many leading drafts the throughput-best budget verifies.

    ``whole`` rows verify all k drafts: they add 1 + their survivals to the expected tokens
    and k rows to the cost, and do not compete.
    """
    rows, k = len(confidence), len(confidence[0])
    whole = whole or [False] * rows
    slots, fixed_tokens, fixed_rows = [], 0.0, 0
    for r in range(rows):
        survival = 1.0
        if whole[r]:
            fixed_tokens, fixed_rows = fixed_tokens + 1.0, fixed_rows + k
        for j in range(k):
            c = confidence[r][j]
            c = 0.0 if math.isnan(c) else min(max(c, 0.0), 1.0)
            survival *= c
            if whole[r]:
                fixed_tokens += survival
            elif eligible[r]:
                slots.append((survival, r * k + j, r))
    slots.sort(key=lambda s: (-s[0], s[1]))
    requests = sum(e and not w for e, w in zip(eligible, whole, strict=True))
    best, best_value = 0, -1.0
    for b in range(len(slots) + 1):
        tokens = requests + fixed_tokens + sum(s[0] for s in slots[:b])
        value = tokens / (1.0 + row_cost * (rows + fixed_rows + b))
        if value > best_value:
            best, best_value = b, value
    counts = [k if w else 0 for w in whole]
    for _, _, r in slots[:best]:
        counts[r] += 1
    return counts


def device_counts(confidence, eligible, row_cost, whole=None):
    conf = torch.tensor(confidence, dtype=torch.float32)
    rows, k = conf.shape
    whole_t = None if whole is None else torch.tensor(whole, dtype=torch.bool)
    competing = [e and not (whole and whole[r]) for r, e in enumerate(eligible)]
    keep = draft_budget_mask(
        conf,
        torch.tensor(competing, dtype=torch.bool),
        num_eligible=sum(competing),
        base_rows=rows + k * sum(whole or []),
        cost_table=VerifyCost(row_cost).table(rows * (k + 1), "cpu"),
        whole=whole_t,
    )
    counts = keep.sum(1)
    # The admitted drafts of each request are a prefix (survival never grows along it).
    assert torch.equal(keep, torch.arange(k)[None, :] < counts[:, None])
    return counts.tolist()


def test_hand_computed_example():
    """Survivals 0.9, 0.45 | 0.2, 0.18; cost 1 + 0.1 * rows over 2 base rows:
    budgets 0..4 give 2/1.2, 2.9/1.3, 3.35/1.4 (best), 3.55/1.5, 3.73/1.6."""
    conf = [[0.9, 0.5], [0.2, 0.9]]
    assert reference_counts(conf, [True, True], 0.1) == [2, 0]
    assert device_counts(conf, [True, True], 0.1) == [2, 0]


@pytest.mark.parametrize("seed", range(12))
def test_random_batches_match_the_reference(seed):
    rng = np.random.default_rng(seed)
    rows, k = int(rng.integers(1, 9)), int(rng.integers(1, 6))
    # Confidences as the trained head gives them (high first slot, falling after).
    conf = rng.beta(2, 3, size=(rows, k)).round(3).tolist()
    eligible = (rng.random(rows) < 0.8).tolist()
    row_cost = float(rng.choice([0.0, 0.01, 0.05, 0.2, 1.0]))
    want = reference_counts(conf, eligible, row_cost)
    assert device_counts(conf, eligible, row_cost) == want


@pytest.mark.parametrize("seed", range(8))
def test_whole_rows_keep_every_draft_and_weigh_in_the_budget(seed):
    """Seeded sampled requests: all k drafts verified, counted in tokens and rows."""
    rng = np.random.default_rng(100 + seed)
    rows, k = int(rng.integers(2, 9)), int(rng.integers(1, 6))
    conf = rng.beta(2, 3, size=(rows, k)).round(3).tolist()
    eligible = (rng.random(rows) < 0.8).tolist()
    whole = [bool(e and w) for e, w in zip(eligible, rng.random(rows) < 0.4, strict=True)]
    row_cost = float(rng.choice([0.0, 0.01, 0.05, 0.2]))
    got = device_counts(conf, eligible, row_cost, whole)
    assert got == reference_counts(conf, eligible, row_cost, whole)
    assert all(n == k for n, w in zip(got, whole, strict=True) if w)


def test_a_whole_row_changes_what_the_others_get():
    """Its expected tokens raise the step's throughput, so a marginal draft elsewhere that
    was worth its row no longer is (row cost 0.2, hand-checked by the reference)."""
    conf = [[0.9, 0.9], [0.5, 0.4]]
    alone = reference_counts(conf, [False, True], 0.2)
    with_whole = reference_counts(conf, [True, True], 0.2, whole=[True, False])
    assert alone != with_whole
    assert device_counts(conf, [False, True], 0.2) == alone
    assert device_counts(conf, [True, True], 0.2, whole=[True, False]) == with_whole


def test_rule_cuts_more_as_rows_get_dearer():
    """A ragged batch in the middle, everything at zero cost, nothing when rows cost a lot."""
    conf = [[0.95, 0.8, 0.3, 0.1], [0.6, 0.2, 0.9, 0.9], [0.1, 0.9, 0.9, 0.9]]
    everyone = [True] * 3
    assert device_counts(conf, everyone, 0.0) == [4, 4, 4]
    middle = device_counts(conf, everyone, 0.05)
    assert middle == reference_counts(conf, everyone, 0.05) and len(set(middle)) > 1
    assert device_counts(conf, everyone, 50.0) == [0, 0, 0]


@pytest.mark.parametrize("k", [1, 4])
def test_edge_confidences(k):
    rows = 3
    ones, zeros = [[1.0] * k] * rows, [[0.0] * k] * rows
    assert device_counts(ones, [True] * rows, 0.01) == [k] * rows
    # Confidence 0: nothing is worth a row, every request is cut to 0 drafts.
    assert device_counts(zeros, [True] * rows, 0.01) == [0] * rows
    # NaN confidence counts as 0: never admitted, and nothing NaN comes out.
    nan = [[float("nan")] * k, [1.0] * k, [0.5] * k]
    assert device_counts(nan, [True] * rows, 0.01) == reference_counts(nan, [True] * rows, 0.01)
    assert device_counts(nan, [True] * rows, 0.01)[0] == 0


def test_ineligible_rows_keep_nothing_and_an_all_prefill_batch_keeps_nothing():
    conf = [[1.0, 1.0], [0.9, 0.9], [1.0, 1.0]]
    assert device_counts(conf, [True, False, False], 0.0) == [2, 0, 0]
    assert device_counts(conf, [False, False, False], 0.0) == [0, 0, 0]


def test_cut_marks_and_host_trim():
    drafts = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]], dtype=torch.int32)
    keep = torch.tensor([[True, True, False], [False, False, False], [True, True, True]])
    cut = apply_cut(drafts, keep)
    assert cut.tolist() == [[5, 6, CUT], [CUT, CUT, CUT], [11, 12, 13]]
    assert trim_cut(cut.tolist()) == [[5, 6], [], [11, 12, 13]]


@pytest.mark.parametrize("raw", ["abc", "-0.5", "nan", "1000"])
def test_row_cost_from_the_environment_is_checked(monkeypatch, raw):
    monkeypatch.setenv(ROW_COST_ENV, raw)
    with pytest.raises(ValueError, match=ROW_COST_ENV):
        VerifyCost.from_env()


def test_row_cost_default_and_value(monkeypatch):
    monkeypatch.delenv(ROW_COST_ENV, raising=False)
    assert VerifyCost.from_env() == VerifyCost()
    monkeypatch.setenv(ROW_COST_ENV, "0.25")
    assert VerifyCost.from_env().row_cost == 0.25
    assert VerifyCost(0.25).table(3, "cpu").tolist() == [1.0, 1.25, 1.5, 1.75]


def test_confidences_outside_zero_one_count_as_clamped():
    """The head's sigmoid stays in [0, 1]; anything else (a kernel's overshoot) is clamped,
    so a survival never exceeds 1 nor turns negative."""
    cases = [  # (confidences, the same clamped to [0, 1])
        ([[1.5, 1.5, 0.2], [-0.5, 1.0, 1.0], [0.7, 0.6, 0.5]],
         [[1.0, 1.0, 0.2], [0.0, 1.0, 1.0], [0.7, 0.6, 0.5]]),
        ([[0.5, 1.9], [0.6, 0.5]], [[0.5, 1.0], [0.6, 0.5]]),  # 1.9 would admit differently
        ([[-0.5, -0.5], [0.7, 0.6]], [[0.0, 0.0], [0.7, 0.6]]),  # (-0.5)^2 would rank high
    ]
    for wild, clamped in cases:
        for cost in (0.0, 0.02, 0.2, 0.4, 1.0):
            want = reference_counts(clamped, [True] * len(wild), cost)
            assert device_counts(wild, [True] * len(wild), cost) == want


def test_a_real_token_zero_is_never_taken_for_the_cut():
    drafts = torch.tensor([[0, 0, 4], [0, 7, 0]], dtype=torch.int32)
    keep = torch.tensor([[True, True, False], [True, True, True]])
    assert trim_cut(apply_cut(drafts, keep).tolist()) == [[0, 0], [0, 7, 0]]


def test_default_row_cost_is_the_documented_one(monkeypatch):
    from scripts import recipe

    monkeypatch.delenv(ROW_COST_ENV, raising=False)
    line = next(ln for ln in (recipe.REPO / "README.md").read_text().splitlines()
                if f"`{ROW_COST_ENV}`" in ln)
    documented = float(line.split("default ")[1].split(";")[0].split(")")[0])
    assert VerifyCost.from_env().row_cost == documented


def test_row_cost_bounds_and_immutability():
    assert VerifyCost(0.0).row_cost == 0.0 and VerifyCost(100.0).row_cost == 100.0
    for bad in (-1e-9, 100.001, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=ROW_COST_ENV):
            VerifyCost(bad)
    cost = VerifyCost(0.5)
    with pytest.raises(AttributeError):
        cost.row_cost = 200.0  # every rank's cut depends on it: fixed once made


# --------------------------------------------------------------- in the proposer


@pytest.fixture(scope="module")
def env():
    from tests.support.tiny import build_draft, ensure_tiny_model

    return build_draft(ensure_tiny_model())


def _step_inputs(proposer, seed):
    """Three requests: two verify segments (k drafts each) and one prefill chunk."""
    shape = proposer.model.shape
    k = proposer.num_speculative_tokens
    gen = torch.Generator().manual_seed(seed)
    lengths = [k + 1, 9, k + 1]
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    rows = int(qsl[-1])
    return DSparkStepInput(
        req_ids=["a", "p", "b"],
        query_start_loc_cpu=qsl,
        num_draft_tokens=np.array([k, 0, k]),
        prefilling=np.array([False, True, False]),
        positions=torch.cat([torch.arange(n) + 20 for n in lengths]),
        aux_hidden_states=torch.randn(rows, shape.hidden_size * len(shape.target_layer_ids),
                                      generator=gen).to(torch.bfloat16),
        num_rejected=torch.tensor([1, 0, 0]),
        next_token_ids=torch.randint(0, shape.vocab_size, (3,), generator=gen),
    )


@pytest.mark.parametrize("row_cost", ["0.0", "0.05", "100"])
def test_proposer_cuts_the_fixed_k_drafts_as_the_rule_says(env, monkeypatch, row_cost):
    """Same step, fixed k vs adaptive: adaptive returns a prefix of the same drafts per
    request, as long as the reference rule admits on the step's confidences."""
    from tests.support.tiny import make_proposer

    draft, vc = env
    monkeypatch.setenv(ROW_COST_ENV, row_cost)
    fixed = make_proposer(draft, vc, max_num_seqs=4)
    adaptive = make_proposer(draft, vc, max_num_seqs=4, adaptive=True)
    want_drafts = fixed.propose(_step_inputs(fixed, 3))
    got = adaptive.propose(_step_inputs(adaptive, 3))
    confidence = adaptive.last_confidence.float()
    # Same weights, same inputs, same batch shape in one process: the same kernels run, so the
    # confidences are equal bit for bit (adaptive adds work after the block, not inside it).
    torch.testing.assert_close(confidence, fixed.last_confidence.float(), rtol=0, atol=0)
    counts = reference_counts(confidence.tolist(), [True, False, True], float(row_cost))
    for r, n in enumerate(counts):
        assert got[r, :n].tolist() == want_drafts[r, :n].tolist()
        assert got[r, n:].tolist() == [CUT] * (got.shape[1] - n)
    assert counts[1] == 0  # the prefill chunk's drafts are never admitted


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_seeded_sampled_requests_keep_every_draft(env, monkeypatch, async_scheduling):
    """A seeded sampled request is never cut (its output must not depend on its neighbours);
    the greedy one is cut as the reference says, with the seeded one weighing in."""
    from tests.support.tiny import make_proposer

    draft, vc = env
    monkeypatch.setenv(ROW_COST_ENV, "0.2")
    monkeypatch.setattr(vc.scheduler_config, "async_scheduling", async_scheduling)
    adaptive = make_proposer(draft, vc, max_num_seqs=4, adaptive=True)
    k = adaptive.num_speculative_tokens
    inputs = dataclasses.replace(
        _step_inputs(adaptive, 3),
        temperature=torch.tensor([0.8, 0.0, 0.0]),
        temperature_cpu=np.array([0.8, 0.0, 0.0], dtype=np.float32),
        request_seeds=[7, None, None],
    )
    got = adaptive.propose(inputs)
    confidence = adaptive.last_confidence.float().tolist()
    counts = reference_counts(confidence, [True, False, True], 0.2, whole=[True, False, False])
    assert counts[0] == k
    if async_scheduling:
        assert adaptive.take_draft_budgets().tolist() == [NO_BUDGET, NO_BUDGET, counts[2]]
        assert CUT not in got.tolist()[0]
    else:
        assert [(row.tolist() + [CUT]).index(CUT) for row in got] == [k, 0, counts[2]]
    # Unseeded, the same sampled request competes like any other.
    adaptive = make_proposer(draft, vc, max_num_seqs=4, adaptive=True)
    got = adaptive.propose(dataclasses.replace(inputs, request_seeds=[None, None, None]))
    counts = reference_counts(adaptive.last_confidence.float().tolist(), [True, False, True], 0.2)
    if async_scheduling:
        assert adaptive.take_draft_budgets().tolist() == [counts[0], NO_BUDGET, counts[2]]
    else:
        assert [(row.tolist() + [CUT]).index(CUT) for row in got] == counts


@pytest.mark.parametrize("row_cost", ["0.0", "0.05"])
def test_async_scheduling_gets_budgets_instead_of_cut_drafts(env, monkeypatch, row_cost):
    """Async scheduling: the drafts stay whole (the runner feeds them to the next step as
    scheduled) and the rule's per-request counts come back as budgets, -1 for prefill."""
    from tests.support.tiny import make_proposer

    draft, vc = env
    monkeypatch.setenv(ROW_COST_ENV, row_cost)
    fixed = make_proposer(draft, vc, max_num_seqs=4)
    monkeypatch.setattr(vc.scheduler_config, "async_scheduling", True)
    adaptive = make_proposer(draft, vc, max_num_seqs=4, adaptive=True)
    want_drafts = fixed.propose(_step_inputs(fixed, 3))
    got = adaptive.propose(_step_inputs(adaptive, 3))
    assert torch.equal(got, want_drafts)
    assert fixed.take_draft_budgets() is None
    budgets = adaptive.take_draft_budgets()
    assert budgets.dtype == torch.int32 and adaptive.take_draft_budgets() is None
    counts = reference_counts(adaptive.last_confidence.float().tolist(), [True, False, True],
                              float(row_cost))
    assert budgets.tolist() == [counts[0], NO_BUDGET, counts[2]]


def test_budgets_reach_the_scheduler_with_the_step_output():
    """The async output wrapper: the inner output untouched, budgets keyed by request,
    requests without a budget left out (the scheduler keeps their k)."""
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
    from vllm.v1.spec_decode.dspark.runner_glue import with_draft_budgets

    class Inner(AsyncModelRunnerOutput):
        sampled_token_ids_cpu = "inner's"

        def get_output(self):
            return ModelRunnerOutput(req_ids=["a", "b", "c"], req_id_to_index={},
                                     sampled_token_ids=[[1], [2, 3], [4]])

    class Drafter:
        def __init__(self, budgets):
            self.budgets = budgets

        def take_draft_budgets(self):
            budgets, self.budgets = self.budgets, None
            return budgets

    inner = Inner()
    assert with_draft_budgets(inner, Drafter(None)) is inner
    wrapped = with_draft_budgets(inner, Drafter(torch.tensor([2, NO_BUDGET, 0], dtype=torch.int32)))
    assert isinstance(wrapped, AsyncModelRunnerOutput)
    assert wrapped.sampled_token_ids_cpu == "inner's"  # the inner's attributes still read
    output = wrapped.get_output()
    assert output.sampled_token_ids == [[1], [2, 3], [4]]
    assert output.dspark_draft_budgets == {"a": 2, "c": 0}
    assert ModelRunnerOutput(req_ids=[], req_id_to_index={}).dspark_draft_budgets is None


# ------------------------------------------------------------------ the recipe knob


def _profile(name: str, **speculative) -> dict:
    import copy

    from scripts import recipe

    profile = copy.deepcopy(recipe.load_profile(name))
    profile["speculative"].update(speculative)
    return profile


@pytest.mark.parametrize(
    "name,speculative,serving,message",
    [
        ("cpu-tiny", {"adaptive": "yes"}, {}, "speculative.adaptive: expected bool, got str"),
        ("spark-2x-upstream", {"adaptive": True}, {"enforce_eager": True},
         "speculative.adaptive: true on the upstream runner needs full CUDA graphs"),
    ],
    ids=["not a bool", "upstream eager"],
)
def test_recipe_rejects_bad_adaptive_settings(name, speculative, serving, message):
    from scripts import recipe

    profile = _profile(name, **speculative)
    profile["serving"].update(serving)
    with pytest.raises(recipe.RecipeError) as err:
        recipe.validate(profile)
    assert message in str(err.value)


def test_adaptive_with_async_scheduling_is_a_valid_spark_setting():
    from scripts import recipe

    profile = recipe.validate(_profile("spark-2x", adaptive=True))
    assert profile["serving"]["async_scheduling"] is True
    args = recipe.engine_args(profile)
    assert args["async_scheduling"] is True
    assert args["speculative_config"]["enable_adaptive_verification"] is True


def test_recipe_knob_is_rendered_as_vllms_own_field():
    import json

    from scripts import recipe

    for adaptive in (False, True):
        profile = recipe.validate(_profile("cpu-tiny", adaptive=adaptive))
        spec = recipe.engine_args(profile)["speculative_config"]
        assert spec["enable_adaptive_verification"] is adaptive
        argv = recipe.serve_argv(profile)
        rendered = json.loads(argv[argv.index("--speculative-config") + 1])
        assert rendered["enable_adaptive_verification"] is adaptive
    missing = _profile("cpu-tiny")
    del missing["speculative"]["adaptive"]
    with pytest.raises(recipe.RecipeError, match="speculative.adaptive: missing"):
        recipe.validate(missing)


def test_vllm_v1_config_accepts_adaptive_dspark_without_cuda_graphs():
    """The overlay's config patch: V1 + DSpark + enable_adaptive_verification + eager."""
    from types import SimpleNamespace

    from vllm.config import VllmConfig

    fake = SimpleNamespace(
        speculative_config=SimpleNamespace(
            enable_adaptive_verification=True, method="dspark"
        ),
        lora_config=None,
        use_v2_model_runner=False,
        compilation_config=SimpleNamespace(
            cudagraph_mode=SimpleNamespace(has_full_cudagraphs=lambda: False)
        ),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1),
    )
    VllmConfig._validate_adaptive_verification(fake)
    fake.speculative_config.method = "eagle"
    with pytest.raises(ValueError, match="full CUDA graphs"):
        VllmConfig._validate_adaptive_verification(fake)
