"""Adaptive verification's cut rule against a brute-force oracle, and in the proposer.

The oracle (``best_cut``) knows nothing of ranking: it tries every combination of
per-request prefix lengths, prices each by the step-time table (expected tokens = one per
ranked request plus the survivals of the verified drafts, over the table's time for that
many rows), keeps the best and applies the minimum gain against verifying everything (or,
under a row budget, against the best combination that fills the budget). The device rule
(``draft_budget_mask``: sort, cumsum, argmax, scatter) must reach the same throughput with
the same number of drafts.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch
from vllm.v1.spec_decode.dspark.adaptive import (
    CUT,
    NO_BUDGET,
    apply_cut,
    draft_budget_mask,
    trim_cut,
)
from vllm.v1.spec_decode.dspark.cost_table import StepCostTable
from vllm.v1.spec_decode.dspark.step_plan import DSparkStepInput


def _survivals(confidence):
    out = []
    for row in confidence:
        s, surv = 1.0, []
        for c in row:
            c = 0.0 if math.isnan(c) else min(max(c, 0.0), 1.0)
            s *= c
            surv.append(s)
        out.append(surv)
    return out


def best_cut(confidence, eligible, step_ms, min_gain, whole=None, budget=None):
    """Per request, how many leading drafts to verify, by trying every combination.

    ``step_ms(rows)`` is the table's time for a step of ``rows`` verify rows (one per
    request plus the drafts). ``whole`` rows keep all k drafts unless the budget cannot
    hold them. Returns (counts, throughput of the choice).
    """
    rows, k = len(confidence), len(confidence[0])
    whole = whole or [False] * rows
    surv = _survivals(confidence)
    ranked = [e or w for e, w in zip(eligible, whole, strict=True)]
    tokens0 = float(sum(ranked))
    cap = sum(ranked) * k if budget is None else min(sum(ranked) * k, max(budget - rows, 0))
    need_whole = min(k * sum(whole), cap)

    def value(counts):
        tokens = tokens0 + sum(surv[r][j] for r in range(rows) for j in range(counts[r]))
        return tokens / step_ms(rows + sum(counts))

    choices = [range(k + 1) if ranked[r] else range(1) for r in range(rows)]
    best, best_v, full_v = None, -1.0, -1.0
    for counts in itertools.product(*choices):
        total = sum(counts)
        if total > cap:
            continue
        kept_whole = sum(c for c, w in zip(counts, whole, strict=True) if w)
        if kept_whole < need_whole or (kept_whole < k * sum(whole) and total > kept_whole):
            continue  # whole rows first: only a budget that cannot hold them cuts them
        v = value(counts)
        if total == cap:
            full_v = max(full_v, v)
        if v > best_v + 1e-9 or (abs(v - best_v) <= 1e-9 and total < sum(best)):
            best, best_v = counts, v
    if best_v >= (1.0 + min_gain) * full_v - 1e-9:
        return list(best), best_v
    return None, full_v  # full width (within the budget)


def rule_counts(confidence, eligible, step_ms, min_gain, whole=None, budget=None, cutting=None):
    """The device rule with the proposer's host numbers; counts per request."""
    conf = torch.tensor(confidence, dtype=torch.float32)
    rows, k = conf.shape
    whole_t = None if whole is None else torch.tensor(whole, dtype=torch.bool)
    competing = [e and not (whole and whole[r]) for r, e in enumerate(eligible)]
    num_ranked = sum(competing) + sum(whole or [])
    max_drafts = num_ranked * k
    if budget is not None:
        max_drafts = max(0, min(max_drafts, budget - rows))
    table = torch.tensor([step_ms(rows + b) for b in range(max_drafts + 1)], dtype=torch.float32)
    keep = draft_budget_mask(
        conf,
        torch.tensor(competing, dtype=torch.bool),
        num_ranked=num_ranked,
        num_whole_drafts=k * sum(whole or []),
        max_drafts=max_drafts,
        step_ms=table,
        min_gain=min_gain,
        whole=whole_t,
        cutting=cutting,
    )
    counts = keep.sum(1)
    # The admitted drafts of each request are a prefix (survival never grows along it).
    assert torch.equal(keep, torch.arange(k)[None, :] < counts[:, None])
    return counts.tolist()


def linear(fixed, per_row):
    return lambda rows: fixed + per_row * rows


def check_against_oracle(conf, eligible, step_ms, min_gain, whole=None, budget=None):
    got = rule_counts(conf, eligible, step_ms, min_gain, whole, budget)
    want, want_v = best_cut(conf, eligible, step_ms, min_gain, whole, budget)
    surv = _survivals(conf)
    ranked = [bool(e or (whole and whole[r])) for r, e in enumerate(eligible)]
    tokens = sum(ranked) + sum(surv[r][j] for r in range(len(conf)) for j in range(got[r]))
    got_v = tokens / step_ms(len(conf) + sum(got))
    assert got_v == pytest.approx(want_v, rel=1e-5), (got, want)
    if want is not None:
        assert sum(got) == sum(want), (got, want)
    if budget is not None:
        assert len(conf) + sum(got) <= max(budget, len(conf))
    return got


def test_hand_computed_example():
    """Survivals 0.9, 0.45 | 0.2, 0.18; step 1 + 0.1 x rows over 2 base rows:
    budgets 0..4 give 2/1.2, 2.9/1.3, 3.35/1.4 (best), 3.55/1.5, 3.73/1.6; 3.35/1.4 beats
    full width (3.73/1.6) by 2.6%: a cut at no minimum gain, none at 4%."""
    conf = [[0.9, 0.5], [0.2, 0.9]]
    cost = linear(1.0, 0.1)
    assert rule_counts(conf, [True, True], cost, 0.0) == [2, 0]
    assert rule_counts(conf, [True, True], cost, 0.04) == [2, 2]
    assert best_cut(conf, [True, True], cost, 0.0)[0] == [2, 0]


def _random_table(rng, rows_max):
    """A measured-looking table: a fixed part, a per-row slope that changes at random
    rows (tiles, expert sets), never decreasing."""
    steps = np.maximum(rng.normal(0.04, 0.05, rows_max + 1), 0.0)
    steps[rng.random(rows_max + 1) < 0.15] += rng.uniform(0.1, 0.6)
    times = 1.0 + np.cumsum(steps)
    return lambda rows: float(times[rows])


@pytest.mark.parametrize("seed", range(16))
def test_random_batches_match_the_oracle(seed):
    rng = np.random.default_rng(seed)
    rows, k = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    conf = rng.beta(3, 2, size=(rows, k)).round(3).tolist()
    eligible = (rng.random(rows) < 0.8).tolist()
    for min_gain in (0.0, 0.04):
        check_against_oracle(conf, eligible, _random_table(rng, rows * (k + 1)), min_gain)


@pytest.mark.parametrize("seed", range(8))
def test_whole_rows_keep_every_draft_and_weigh_in(seed):
    """Seeded sampled requests: all k drafts verified, counted in tokens and rows."""
    rng = np.random.default_rng(100 + seed)
    rows, k = int(rng.integers(2, 5)), int(rng.integers(1, 4))
    conf = rng.beta(3, 2, size=(rows, k)).round(3).tolist()
    eligible = (rng.random(rows) < 0.8).tolist()
    whole = [bool(e and w) for e, w in zip(eligible, rng.random(rows) < 0.5, strict=True)]
    got = check_against_oracle(conf, eligible, _random_table(rng, rows * (k + 1)), 0.0, whole)
    assert all(n == k for n, w in zip(got, whole, strict=True) if w)


@pytest.mark.parametrize("seed", range(10))
def test_row_budget_holds_and_cuts_the_lowest_survivals(seed):
    """Under a budget smaller than full width: never more rows, whatever the gain, and the
    throughput the oracle finds among the combinations that fit."""
    rng = np.random.default_rng(200 + seed)
    rows, k = int(rng.integers(2, 5)), int(rng.integers(2, 5))
    conf = rng.beta(3, 2, size=(rows, k)).round(3).tolist()
    whole = [bool(w) for w in rng.random(rows) < 0.3]
    budget = int(rng.integers(rows, rows * (k + 1)))
    table = _random_table(rng, rows * (k + 1))
    for min_gain in (0.0, 0.04, 10.0):  # 10: no cut for gain, only for the budget
        got = check_against_oracle(conf, [True] * rows, table, min_gain, whole, budget)
        assert rows + sum(got) <= budget


def test_budget_smaller_than_the_whole_rows_cuts_them_too():
    conf = [[0.9, 0.8, 0.7], [0.95, 0.9, 0.1]]
    got = rule_counts(conf, [True, True], linear(1.0, 0.0), 0.04, whole=[True, True], budget=5)
    assert sum(got) == 3 and got == [1, 2]  # survivals .9 .72 | .95 .855: the best three


def test_min_gain_and_hysteresis():
    """A cut promising between half the minimum and the minimum is made only while the
    rule is already cutting; one promising more starts it, one promising less stops it."""
    conf = [[0.9, 0.05]]
    # Rows 1..3: 1 row (no draft) .. 3 rows (both). Expected tokens 1, 1.9, 1.945.
    def table(extra):  # time of the 3-row step chosen so the 1-draft cut gains `extra`
        t2 = 1.5
        t3 = 1.945 / (1.9 / t2) * (1 + extra)
        return lambda rows: {1: 10.0, 2: t2, 3: t3}[rows]

    cutting = torch.zeros((), dtype=torch.bool)
    assert rule_counts(conf, [True], table(0.03), 0.04, cutting=cutting) == [2]
    assert not cutting
    assert rule_counts(conf, [True], table(0.05), 0.04, cutting=cutting) == [1]
    assert cutting
    assert rule_counts(conf, [True], table(0.03), 0.04, cutting=cutting) == [1]  # holds
    assert cutting
    assert rule_counts(conf, [True], table(0.01), 0.04, cutting=cutting) == [2]  # stops
    assert not cutting
    assert rule_counts(conf, [True], table(0.05), 0.04, cutting=cutting) == [1]
    # Holding needs half the minimum, 2%: 1.5% stops it.
    assert rule_counts(conf, [True], table(0.015), 0.04, cutting=cutting) == [2]
    assert not cutting


def test_under_a_budget_a_whole_row_outranks_even_a_certain_draft():
    """Whole rows go first: a confidence-0 draft of a whole row beats a confidence-1 draft."""
    got = rule_counts([[1.0], [0.0]], [True, True], linear(1.0, 0.0), 10.0, whole=[False, True],
                      budget=3)
    assert got == [0, 1]


def test_an_unranked_row_never_takes_a_ranked_drafts_place():
    """A ranked draft of survival 0 still ranks ahead of an ineligible row's slots."""
    assert rule_counts([[1.0], [0.0]], [False, True], linear(1.0, 0.0), 10.0) == [0, 1]


def test_an_exact_tie_keeps_the_smaller_budget():
    """One draft of confidence 0.5: 1 token in 1 ms or 1.5 tokens in 1.5 ms, exactly equal."""
    assert rule_counts([[0.5]], [True], {1: 1.0, 2: 1.5}.__getitem__, 0.0) == [0]


def test_the_rule_reads_only_the_first_max_drafts_plus_one_step_times():
    conf = torch.tensor([[0.9, 0.5], [0.8, 0.2]])
    table = torch.tensor([2.0, 2.2, 2.4, 2.6, 2.8])  # requests + b rows, b = 0..4
    args = dict(num_ranked=2, num_whole_drafts=0, max_drafts=4, min_gain=0.0)
    keep = draft_budget_mask(conf, torch.tensor([True, True]), step_ms=table, **args)
    padded = torch.cat([table, torch.tensor([1e-6, 1e-6])])  # past the step: never read
    assert torch.equal(
        draft_budget_mask(conf, torch.tensor([True, True]), step_ms=padded, **args), keep
    )


@pytest.mark.parametrize("k", [1, 4])
def test_edge_confidences(k):
    rows = 3
    ones, zeros = [[1.0] * k] * rows, [[0.0] * k] * rows
    cost = linear(1.0, 0.05)
    assert rule_counts(ones, [True] * rows, cost, 0.04) == [k] * rows
    # Confidence 0: nothing is worth a row, every request is cut to 0 drafts.
    assert rule_counts(zeros, [True] * rows, cost, 0.04) == [0] * rows
    # NaN confidence counts as 0: never admitted, and nothing NaN comes out.
    nan = [[float("nan")] * k, [1.0] * k, [0.5] * k]
    got = check_against_oracle(nan, [True] * rows, cost, 0.0)
    assert got[0] == 0


def test_ineligible_rows_keep_nothing_and_an_all_prefill_batch_keeps_nothing():
    conf = [[1.0, 1.0], [0.9, 0.9], [1.0, 1.0]]
    flat = linear(1.0, 0.0)
    assert rule_counts(conf, [True, False, False], flat, 0.0) == [2, 0, 0]
    assert rule_counts(conf, [False, False, False], flat, 0.0) == [0, 0, 0]


def test_cut_marks_and_host_trim():
    drafts = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]], dtype=torch.int32)
    keep = torch.tensor([[True, True, False], [False, False, False], [True, True, True]])
    cut = apply_cut(drafts, keep)
    assert cut.tolist() == [[5, 6, CUT], [CUT, CUT, CUT], [11, 12, 13]]
    assert trim_cut(cut.tolist()) == [[5, 6], [], [11, 12, 13]]


def test_confidences_outside_zero_one_count_as_clamped():
    """The head's sigmoid stays in [0, 1]; anything else (a kernel's overshoot) is clamped,
    so a survival never exceeds 1 nor turns negative."""
    cases = [  # (confidences, the same clamped to [0, 1])
        ([[1.5, 1.5, 0.2], [-0.5, 1.0, 1.0], [0.7, 0.6, 0.5]],
         [[1.0, 1.0, 0.2], [0.0, 1.0, 1.0], [0.7, 0.6, 0.5]]),
        ([[0.5, 1.9], [0.6, 0.5]], [[0.5, 1.0], [0.6, 0.5]]),
        ([[-0.5, -0.5], [0.7, 0.6]], [[0.0, 0.0], [0.7, 0.6]]),
    ]
    for wild, clamped in cases:
        for per_row in (0.0, 0.02, 0.2, 0.4, 1.0):
            cost = linear(1.0, per_row)
            assert rule_counts(wild, [True] * len(wild), cost, 0.0) == rule_counts(
                clamped, [True] * len(wild), cost, 0.0)


def test_a_real_token_zero_is_never_taken_for_the_cut():
    drafts = torch.tensor([[0, 0, 4], [0, 7, 0]], dtype=torch.int32)
    keep = torch.tensor([[True, True, False], [True, True, True]])
    assert trim_cut(apply_cut(drafts, keep).tolist()) == [[0, 0], [0, 7, 0]]


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


def linear_table(per_row, fixed=1.0, requests=(1, 2, 4), k=4, budget=None):
    """A StepCostTable whose times are ``fixed + per_row x rows`` at every grid point (so
    its interpolation is exact at every request count)."""
    ms = tuple(tuple(fixed + per_row * r * (w + 1) for w in range(k + 1)) for r in requests)
    return StepCostTable(tuple(requests), ms, budget)


def _adaptive_proposer(env, monkeypatch, table, *, mode="on", min_gain=0.0, budget=None):
    from tests.support.tiny import make_proposer

    draft, vc = env
    monkeypatch.setenv("DSPARK_ADAPTIVE", mode)
    if budget is None:
        monkeypatch.delenv("DSPARK_VERIFY_ROW_BUDGET", raising=False)
    else:
        monkeypatch.setenv("DSPARK_VERIFY_ROW_BUDGET", str(budget))
    proposer = make_proposer(draft, vc, max_num_seqs=4, adaptive=True)
    if table is not None:
        proposer.use_cost_table(table, min_gain=min_gain)
    return proposer


def _counts(drafts):
    return [(row.tolist() + [CUT]).index(CUT) for row in drafts]


@pytest.mark.parametrize("per_row", [0.0, 0.05, 100.0])
def test_proposer_cuts_the_fixed_k_drafts_as_the_oracle_says(env, monkeypatch, per_row):
    """Same step, fixed k vs adaptive: adaptive returns a prefix of the same drafts per
    request, as many as the brute-force oracle finds best on the step's confidences."""
    from tests.support.tiny import make_proposer

    draft, vc = env
    fixed = make_proposer(draft, vc, max_num_seqs=4)
    table = linear_table(per_row)
    adaptive = _adaptive_proposer(env, monkeypatch, table)
    want_drafts = fixed.propose(_step_inputs(fixed, 3))
    got = adaptive.propose(_step_inputs(adaptive, 3))
    confidence = adaptive.last_confidence.float()
    # Same weights, same inputs, same batch shape in one process: the same kernels run, so the
    # confidences are equal bit for bit (adaptive adds work after the block, not inside it).
    torch.testing.assert_close(confidence, fixed.last_confidence.float(), rtol=0, atol=0)
    counts = _counts(got)
    want, _ = best_cut(confidence.tolist(), [True, False, True],
                       lambda rows: table.step_ms(3, rows), 0.0)
    assert sum(counts) == sum(want) and counts[1] == 0  # prefill drafts never admitted
    for r, n in enumerate(counts):
        assert got[r, :n].tolist() == want_drafts[r, :n].tolist()


def test_no_cut_without_a_table_and_auto_off_on_a_flat_one(env, monkeypatch):
    """Never trim without a table; ``auto`` leaves the rule off where no row costs
    anything (no cut can gain), ``on`` runs it, and a binding row budget turns it on."""
    from tests.support.tiny import make_proposer

    draft, vc = env
    fixed = make_proposer(draft, vc, max_num_seqs=4)
    want = fixed.propose(_step_inputs(fixed, 3))
    untabled = _adaptive_proposer(env, monkeypatch, None)
    assert not untabled.rule_on
    assert torch.equal(untabled.propose(_step_inputs(untabled, 3)), want)
    flat = linear_table(0.0)
    auto = _adaptive_proposer(env, monkeypatch, flat, mode="auto", min_gain=0.04)
    assert not auto.rule_on
    assert torch.equal(auto.propose(_step_inputs(auto, 3)), want)
    assert _adaptive_proposer(env, monkeypatch, flat, mode="on").rule_on
    assert _adaptive_proposer(env, monkeypatch, linear_table(0.05), mode="auto").rule_on
    budgeted = _adaptive_proposer(env, monkeypatch, linear_table(0.0, budget=8), mode="auto",
                                  min_gain=0.04, budget=8)
    assert budgeted.rule_on
    assert 3 + sum(_counts(budgeted.propose(_step_inputs(budgeted, 3)))) <= 8


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_seeded_sampled_requests_keep_every_draft(env, monkeypatch, async_scheduling):
    """A seeded sampled request is never cut (its output must not depend on its neighbours);
    the greedy one is cut as the oracle says, with the seeded one weighing in."""
    draft, vc = env
    monkeypatch.setattr(vc.scheduler_config, "async_scheduling", async_scheduling)
    table = linear_table(0.2)
    adaptive = _adaptive_proposer(env, monkeypatch, table)
    k = adaptive.num_speculative_tokens
    inputs = dataclasses.replace(
        _step_inputs(adaptive, 3),
        temperature=torch.tensor([0.8, 0.0, 0.0]),
        temperature_cpu=np.array([0.8, 0.0, 0.0], dtype=np.float32),
        request_seeds=[7, None, None],
    )
    got = adaptive.propose(inputs)
    confidence = adaptive.last_confidence.float().tolist()
    cost = lambda rows: table.step_ms(3, rows)  # noqa: E731
    want, _ = best_cut(confidence, [False, False, True], cost, 0.0, whole=[True, False, False])
    if async_scheduling:
        budgets = adaptive.take_draft_budgets().tolist()
        assert budgets == [k, NO_BUDGET, want[2]]
        assert CUT not in got.tolist()[0]
    else:
        assert _counts(got) == [k, 0, want[2]]
    # Unseeded, the same sampled request competes like any other.
    adaptive = _adaptive_proposer(env, monkeypatch, table)
    got = adaptive.propose(dataclasses.replace(inputs, request_seeds=[None, None, None]))
    want, _ = best_cut(adaptive.last_confidence.float().tolist(), [True, False, True], cost, 0.0)
    counts = adaptive.take_draft_budgets().tolist() if async_scheduling else _counts(got)
    assert counts[1] in (0, NO_BUDGET) and counts[0] + counts[2] == sum(want)


@pytest.mark.parametrize("per_row", [0.0, 0.05])
def test_async_scheduling_gets_budgets_instead_of_cut_drafts(env, monkeypatch, per_row):
    """Async scheduling: the drafts stay whole (the runner feeds them to the next step as
    scheduled) and the rule's per-request counts come back as budgets, -1 for prefill."""
    from tests.support.tiny import make_proposer

    draft, vc = env
    fixed = make_proposer(draft, vc, max_num_seqs=4)
    monkeypatch.setattr(vc.scheduler_config, "async_scheduling", True)
    table = linear_table(per_row)
    adaptive = _adaptive_proposer(env, monkeypatch, table)
    want_drafts = fixed.propose(_step_inputs(fixed, 3))
    got = adaptive.propose(_step_inputs(adaptive, 3))
    assert torch.equal(got, want_drafts)
    assert fixed.take_draft_budgets() is None
    budgets = adaptive.take_draft_budgets()
    assert budgets.dtype == torch.int32 and adaptive.take_draft_budgets() is None
    want, _ = best_cut(adaptive.last_confidence.float().tolist(), [True, False, True],
                       lambda rows: table.step_ms(3, rows), 0.0)
    budgets = budgets.tolist()
    assert budgets[1] == NO_BUDGET and budgets[0] + budgets[2] == sum(want)


class _Clock:
    now = 1000.0

    def __call__(self):
        return self.now


def _decode_inputs(proposer, widths, step):
    """Two requests in decode, verifying ``widths`` drafts each (the scheduler's trim)."""
    shape = proposer.model.shape
    gen = torch.Generator().manual_seed(step)
    lengths = [w + 1 for w in widths]
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    rows = int(qsl[-1])
    return DSparkStepInput(
        req_ids=["a", "b"],
        query_start_loc_cpu=qsl,
        num_draft_tokens=np.array(widths),
        prefilling=np.array([False, False]),
        positions=torch.cat([torch.arange(n) + 20 + 6 * step for n in lengths]),
        aux_hidden_states=torch.randn(rows, shape.hidden_size * len(shape.target_layer_ids),
                                      generator=gen).to(torch.bfloat16),
        num_rejected=torch.zeros(2, dtype=torch.int64),
        next_token_ids=torch.randint(0, shape.vocab_size, (2,), generator=gen),
    )


def test_served_steps_correct_the_table(env, monkeypatch):
    """The table prices rows at 100 ms but served steps pay 20 s plus half the table's time
    (a constant the dummy forwards miss): exploration steps verify every draft, the fit of
    served times recovers the line, the rule reads ``a + b x table`` and ``auto`` turns the
    cut off (no cut can gain 4% of a 20 s step)."""
    from vllm.v1.spec_decode.dspark.proposer import REFIT_EVERY, REFIT_UNFITTED
    from vllm.v1.spec_decode.dspark.served_steps import ServedStepFit

    table = linear_table(100.0)
    proposer = _adaptive_proposer(env, monkeypatch, None, mode="auto")
    with torch.inference_mode():  # as in a TP worker: the table is an inference tensor
        proposer.use_cost_table(table, min_gain=0.04)
    assert proposer.rule_on
    clock = _Clock()
    proposer.served = ServedStepFit(clock=clock)
    k = proposer.num_speculative_tokens
    cut_steps, whole_steps, first_fit = [], [], None
    for step in range(REFIT_EVERY):
        # One width at first (nothing to fit: the proposer explores), then every width.
        widths = [1, 1] if step < ServedStepFit.EXPLORE_DENSE else [step % (k + 1), (step + 2) % (k + 1)]
        clock.now += (20_000.0 + 0.5 * table.step_ms(2, 2 + sum(widths))) / 1e3
        counts = _counts(proposer.propose(_decode_inputs(proposer, widths, step)))
        (whole_steps if counts == [k, k] else cut_steps).append(step)
        if first_fit is None and proposer.served.fitted is not None:
            first_fit = step
        if step == ServedStepFit.EXPLORE_DENSE - 1:
            assert counts == [k, k]  # explores: one width so far, no spread
    assert cut_steps  # the measured table alone makes the rule cut
    # Step s observes s intervals; unfitted, a refit is tried every REFIT_UNFITTED steps, so
    # the first fit comes at the first such try with min_steps observations, not at 63.
    tries = range(REFIT_UNFITTED - 1, REFIT_EVERY, REFIT_UNFITTED)
    assert first_fit == next(s for s in tries if s >= proposer.served.min_steps) < REFIT_EVERY - 1
    a, b = proposer.served.fitted
    assert a == pytest.approx(20_000.0, rel=1e-3) and b == pytest.approx(0.5, rel=1e-2)
    want = a + b * table.matrix(proposer.max_num_seqs, proposer.max_num_seqs * (k + 1))
    torch.testing.assert_close(proposer._step_ms[1:, 1:], torch.from_numpy(want)[1:, 1:].float())
    assert not proposer.rule_on
    counts = _counts(proposer.propose(_decode_inputs(proposer, [k, k], REFIT_EVERY)))
    assert counts == [k, k]


def test_the_cut_reads_the_head_calibrated_by_what_the_target_accepted(env, monkeypatch):
    """Both requests accept every verified draft, step after step: the per-slot scale is an
    independent count's over those outcomes and the head's confidences of the drafts judged,
    and each step's cut is the oracle's on the head's confidences times that scale."""
    from vllm.v1.spec_decode.dspark.calibration import SlotCalibration

    table = linear_table(0.3)
    proposer = _adaptive_proposer(env, monkeypatch, table)
    k = proposer.num_speculative_tokens
    decay, prior = SlotCalibration.DECAY, SlotCalibration.PRIOR
    accepted, predicted = [0.0] * k, [0.0] * k
    widths, confidence = [0, 0], None
    for step in range(6):  # before the served-step fit's first exploring proposal
        inputs = _decode_inputs(proposer, widths, step)
        if confidence is not None:  # what the step verifies was drafted with ``confidence``
            accepted = [a * decay + sum(j < w for w in widths) for j, a in enumerate(accepted)]
            predicted = [p * decay + sum(confidence[r][j] for r, w in enumerate(widths) if j < w)
                         for j, p in enumerate(predicted)]
        counts = _counts(proposer.propose(inputs))
        scale = [(a + prior) / (p + prior) for a, p in zip(accepted, predicted, strict=True)]
        torch.testing.assert_close(proposer.calibration.scale, torch.tensor(scale))
        confidence = proposer.last_confidence.float().tolist()
        calibrated = [[min(c * s, 1.0) for c, s in zip(row, scale, strict=True)]
                      for row in confidence]
        want, _ = best_cut(calibrated, [True, True], lambda rows: table.step_ms(2, rows), 0.0)
        assert sum(counts) == sum(want), (step, counts, want, scale)
        widths = counts  # the scheduler verifies what the rule admitted, all accepted
    assert scale[0] > 1.1, scale  # every draft judged was accepted: the head was too cautious


def test_narrow_exploration_spreads_a_rule_that_keeps_full_width(env, monkeypatch):
    """Rows cost nothing in the table, so the rule verifies every draft, and served steps
    of that one shape would never spread the table's times: every second exploring step
    admits only as many drafts as requests, and the steps between keep full width."""
    from vllm.v1.spec_decode.dspark.served_steps import ServedStepFit

    proposer = _adaptive_proposer(env, monkeypatch, linear_table(0.0), mode="on")
    clock = _Clock()
    proposer.served = ServedStepFit(clock=clock)
    k = proposer.num_speculative_tokens
    dense = ServedStepFit.EXPLORE_DENSE
    totals = []
    for step in range(2 * dense):
        clock.now += 0.05
        totals.append(sum(_counts(proposer.propose(_decode_inputs(proposer, [k, k], step)))))
    assert totals[2 * dense - 1] <= 2  # the second exploring step: narrow
    assert all(t == 2 * k for i, t in enumerate(totals) if i != 2 * dense - 1), totals
    assert not proposer.served.slope_known()  # one shape served so far (k, k)


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_auto_rests_the_rule_after_steps_it_cut_nothing_from_then_looks_again(
    env, monkeypatch, mode
):
    """The scheduler hands back every draft (the last cut admitted all): after 3 such rule
    steps in a row ``auto`` rests the rule for 5 proposals (no cut, no head pass), then runs
    it again; a step with one draft cut restarts the count; ``on`` never rests."""
    from vllm.v1.spec_decode.dspark.rule_rest import RuleRest
    from vllm.v1.spec_decode.dspark.served_steps import ServedStepFit

    monkeypatch.setattr(ServedStepFit, "EXPLORE_DENSE", 10**9)  # no exploring steps here
    monkeypatch.setattr(ServedStepFit, "EXPLORE_SPARSE", 10**9)
    proposer = _adaptive_proposer(env, monkeypatch, linear_table(0.3), mode=mode, min_gain=0.04)
    assert proposer.rule_on  # rows cost 0.3 of 1 ms: a cut could pay
    proposer.rest = RuleRest(rest_after=3, rest_for=5)
    k = proposer.num_speculative_tokens
    # Step 2 verifies one draft fewer (the rule cut it): the count starts again after it.
    widths = [[k, k], [k, k], [k, k - 1]] + [[k, k]] * 14
    ran, head_passes = [], []
    for step, w in enumerate(widths):
        proposer.propose(_decode_inputs(proposer, w, step))
        ran.append(proposer.rule_on)
        head_passes.append(proposer._confidence is not None)  # the head ran for the cut
    if mode == "on":
        assert all(ran) and all(head_passes)
        return
    # Judged steps: 1 (uncut 1), 2 (cut: 0), 3, 4, 5 (3 in a row: rests after step 5's
    # check), resting through steps 5-9 (5 proposals), awake again at step 10, 3 more uncut
    # judged steps 11-13 (step 10 follows a resting step: not judged), rests at 13.
    want = [True] * 5 + [False] * 5 + [True] * 3 + [False] * 4
    assert ran == want, ran
    assert head_passes == want
    assert proposer.rest.rests == 2


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
        ("cpu-tiny", {"adaptive": "yes"}, {},
         "speculative.adaptive: 'yes' is not allowed; expected true, false or auto"),
        ("cpu-tiny", {"adaptive": 1}, {}, "speculative.adaptive: expected true, false or auto"),
        ("spark-2x-upstream", {"adaptive": True}, {"enforce_eager": True},
         "speculative.adaptive: true on the upstream runner needs full CUDA graphs"),
    ],
    ids=["not a choice", "not a bool", "upstream eager"],
)
def test_recipe_rejects_bad_adaptive_settings(name, speculative, serving, message):
    from scripts import recipe

    profile = _profile(name, **speculative)
    profile["serving"].update(serving)
    with pytest.raises(recipe.RecipeError) as err:
        recipe.validate(profile)
    assert message in str(err.value)


SERVING_PROFILES = ("cpu-tiny", "cpu-2x", "cpu-4x", "spark-2x", "spark-4x", "spark-2x-upstream")


def test_every_serving_profile_defaults_to_auto():
    """(cpu-membound, a benchmark twin, pins fixed k on purpose for its A/B.)"""
    from scripts import recipe

    for name in SERVING_PROFILES:
        profile = recipe.load_profile(name)
        assert profile["speculative"]["adaptive"] == "auto", name
        assert recipe.engine_args(profile)["speculative_config"][
            "enable_adaptive_verification"] is True
        env = recipe.vllm_env(profile)
        overlay = profile["speculative"]["runner"] == "overlay"
        assert env.get("DSPARK_ADAPTIVE") == ("auto" if overlay else None), name


def test_adaptive_with_async_scheduling_is_a_valid_spark_setting():
    from scripts import recipe

    profile = recipe.validate(_profile("spark-2x", adaptive=True))
    assert profile["serving"]["async_scheduling"] is True
    args = recipe.engine_args(profile)
    assert args["async_scheduling"] is True
    assert args["speculative_config"]["enable_adaptive_verification"] is True
    assert recipe.vllm_env(profile)["DSPARK_ADAPTIVE"] == "on"


def test_auto_on_the_upstream_runner_follows_cuda_graphs():
    """V2 measures its own table while capturing graphs: eager, auto means off."""
    from scripts import recipe

    graphs = recipe.validate(_profile("spark-2x-upstream", adaptive="auto"))
    assert recipe.speculative_config(graphs)["enable_adaptive_verification"] is True
    eager = _profile("spark-2x-upstream", adaptive="auto")
    eager["serving"]["enforce_eager"] = True
    recipe.validate(eager)
    assert recipe.speculative_config(eager)["enable_adaptive_verification"] is False


def test_recipe_knob_is_rendered_as_vllms_own_field():
    import json

    from scripts import recipe

    for adaptive, enabled, mode in ((False, False, None), (True, True, "on"),
                                    ("auto", True, "auto")):
        profile = recipe.validate(_profile("cpu-tiny", adaptive=adaptive))
        spec = recipe.engine_args(profile)["speculative_config"]
        assert spec["enable_adaptive_verification"] is enabled
        argv = recipe.serve_argv(profile)
        rendered = json.loads(argv[argv.index("--speculative-config") + 1])
        assert rendered["enable_adaptive_verification"] is enabled
        assert recipe.vllm_env(profile).get("DSPARK_ADAPTIVE") == mode
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
