"""The device half of a DSpark step never reads device data on the host.

Every step is planned on the host as the proposer does it (``plan_step``), but all device
data (rings, positions, KV rows, rejection counts) lives on the ``meta`` device, which
holds no values: any ``.item()``, ``.tolist()``, ``bool()``, ``nonzero`` or data-sized
``repeat_interleave`` on it raises. On a GPU each of those would be a blocking
device-to-host sync inside vLLM's async-scheduled step. The last test shows the guard
catches one ``.item()`` slipped into the store.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import vllm.v1.spec_decode.dspark.context_store as dr
import vllm.v1.spec_decode.dspark.rings as rings
from vllm.v1.spec_decode.dspark.packed_prefill import ingest_packed_prefill
from vllm.v1.spec_decode.dspark.step_plan import (
    DSparkStepInput,
    capture_sizes,
    draft_anchor_positions,
    plan_step,
)

from tests.support.host_reads import HostReadGuard

DEVICE = "meta"
WINDOW, DIM, NUM_SLOTS, K = 16, 8, 6, 4


def meta_rings():
    return rings.allocate_rings(NUM_SLOTS, WINDOW, DIM, torch.bfloat16, DEVICE)


def device_step(cache, cache_pos, table, req_ids, lengths, drafts, prefilling=None):
    """Plan on the host, then the device half on meta tensors: store, anchors, window."""
    plan = plan_step(
        np.concatenate([[0], np.cumsum(lengths)]),
        table.assign(req_ids),
        num_draft_tokens=np.asarray(drafts),
        prefilling=np.zeros(len(req_ids), bool) if prefilling is None else np.asarray(prefilling),
        temperature_cpu=None,
        never_cut=None,
        window=WINDOW,
        num_slots=NUM_SLOTS,
        num_spec_tokens=K,
        draft_sizes=capture_sizes(NUM_SLOTS),
        device=DEVICE,
    )
    rows = plan.num_rows
    positions = torch.empty(rows, dtype=torch.int64, device=DEVICE)
    rejected = torch.empty(len(req_ids), dtype=torch.int64, device=DEVICE)
    accepted = dr.last_accepted(plan.store, positions, rejected)
    if plan.packed is not None:

        def project(x, pos):
            return torch.empty(x.shape[0], DIM, dtype=torch.bfloat16, device=DEVICE)

        features = torch.empty(rows, 2 * DIM, device=DEVICE)
        ingest_packed_prefill(
            plan.packed, plan.store, features, positions, project, (cache, cache_pos),
            max_model_len=4096, accepted=accepted,
        )
    else:
        kv = torch.empty(rows, DIM, dtype=torch.bfloat16, device=DEVICE)
        dr.store_context_kv(cache, cache_pos, kv, positions, plan.store, accepted)
    anchor = draft_anchor_positions(plan, accepted)
    mask = dr.window_mask(cache_pos, plan.draft_slots, anchor, WINDOW)
    assert mask.shape == (plan.draft_rows, WINDOW) and mask.device.type == DEVICE
    return plan


def test_host_sync_free_flat_ragged_packed_and_release_steps():
    cache, cache_pos = meta_rings()
    table = rings.SlotTable(NUM_SLOTS)
    # Flat decode step: every request verifies K drafts.
    plan = device_step(cache, cache_pos, table, ["a", "b", "c"], [K + 1] * 3, [K] * 3)
    assert plan.store.uniform and plan.packed is None and plan.draft_rows == 4
    # Ragged mixed step: verify rows next to a short prefill chunk.
    plan = device_step(
        cache, cache_pos, table, ["a", "b", "d"], [K + 1, 2, 3], [K, 1, 0], [False, False, True]
    )
    assert not plan.store.uniform and plan.packed is None
    # Packed-prefill step: a long chunk beside verify rows.
    plan = device_step(cache, cache_pos, table, ["a", "e"], [K + 1, 200], [K, 0])
    assert plan.packed is not None
    # Release and reuse: the freed row is cleared, then taken by a new request.
    freed = table.release(["b"])
    rings.clear_slots(cache_pos, freed)
    plan = device_step(cache, cache_pos, table, ["f", "a"], [3, K + 1], [0, K])
    assert table.assign(["f"]) == freed


def test_host_sync_guard_catches_one_item(monkeypatch):
    """The guard is real: one ``.item()`` on device data in the store fails the step."""
    original = dr._flat_candidates

    def with_a_sync(plan, positions, acc_end, last_pos):
        if int(acc_end.sum().item()) < 0:  # the kind of check that used to live here
            raise AssertionError("unreachable")
        return original(plan, positions, acc_end, last_pos)

    monkeypatch.setattr(dr, "_flat_candidates", with_a_sync)
    cache, cache_pos = meta_rings()
    with pytest.raises(RuntimeError, match="meta"):
        device_step(cache, cache_pos, rings.SlotTable(NUM_SLOTS), ["a", "b"], [K + 1] * 2, [K] * 2)


class _StepOutput:
    """Stands in for the runner's async step output (never read here)."""


def _whole_step(proposer, step: int, req_ids, lengths, drafts, rejected):
    """What the runner runs per engine step: release departed requests, publish, propose,
    wrap the step's output."""
    from vllm.v1.spec_decode.dspark.runner_glue import before_step, with_draft_budgets

    shape = proposer.model.shape
    width = shape.hidden_size * len(shape.target_layer_ids)
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    gen = torch.Generator().manual_seed(step)
    rows = int(qsl[-1])
    inputs = DSparkStepInput(
        req_ids=req_ids,
        query_start_loc_cpu=qsl,
        num_draft_tokens=np.asarray(drafts),
        prefilling=np.zeros(len(req_ids), bool),
        positions=torch.arange(rows) + 10 * step,
        aux_hidden_states=torch.randn(rows, width, generator=gen).to(torch.bfloat16),
        num_rejected=torch.tensor(rejected),
        next_token_ids=torch.randint(0, shape.vocab_size, (len(req_ids),), generator=gen),
    )
    # The runner's view at _update_states: the requests it holds, what the scheduler reports.
    runner = SimpleNamespace(drafter=proposer, vllm_config=proposer.vllm_config,
                             requests=dict.fromkeys(req_ids))
    scheduled = SimpleNamespace(finished_req_ids={f"gone{step}"}, preempted_req_ids=set())
    with HostReadGuard() as guard:
        before_step(runner, scheduled)
        drafts = proposer.propose(inputs)
        # Async scheduling: the step's output takes the budgets (read later, off the step).
        output = with_draft_budgets(_StepOutput(), proposer)
    budgets = getattr(output, "_budgets_cpu", None)
    return guard.reads, drafts, budgets


@pytest.mark.parametrize(
    "adaptive,async_scheduling",
    [(False, False), (True, False), (True, True)],
    ids=["fixed-k", "adaptive", "adaptive-async"],
)
def test_whole_engine_step_with_metrics_on_reads_nothing_from_the_device(
    tmp_path, monkeypatch, adaptive, async_scheduling
):
    """Release, metrics (PROMETHEUS_MULTIPROC_DIR set) and propose: no host read at all.

    With adaptive verification the step also runs the confidence head and the cut rule
    (sort, cumsum, argmax over the batch's draft slots) on the device; under async
    scheduling its budgets are handed to the step's output instead of cutting drafts.
    """
    import vllm.v1.spec_decode.dspark.metrics as dm
    from vllm.v1.spec_decode.dspark.cost_table import StepCostTable

    from tests.support.tiny import build_draft, ensure_tiny_model, make_proposer

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(dm, "_exporter", None)
    monkeypatch.setattr(dm, "_checked", False)
    draft, vc = build_draft(ensure_tiny_model())
    monkeypatch.setattr(vc.scheduler_config, "async_scheduling", async_scheduling)
    proposer = make_proposer(draft, vc, max_num_seqs=4, adaptive=adaptive)
    proposer.vllm_config = vc
    if adaptive:  # a verify row at 5% of the fixed step time: a cut in between, ragged drafts
        k = proposer.num_speculative_tokens
        ms = tuple(tuple(1.0 + 0.05 * r * (w + 1) for w in range(k + 1)) for r in (1, 2, 4))
        proposer.use_cost_table(StepCostTable((1, 2, 4), ms), min_gain=0.0)
    k = proposer.num_speculative_tokens
    # (requests, rows, drafts verified, rows rejected): prefill, flat verify, ragged mix.
    steps = [(["a", "b"], [7, 3], [0, 0], [0, 0])]
    steps += [(["a", "b"], [k + 1, k + 1], [k, k], [2, k])]
    steps += [(["a", "b", "c"], [k + 1, 1, 5], [k, 0, 0], [1, 0, 0])] * 3
    cut_slots = cut_budgets = 0
    for step, batch in enumerate(steps):
        reads, drafts, budgets = _whole_step(proposer, step, *batch)
        assert reads == [], f"step {step}: host reads\n" + "\n".join(w for _, w in reads)
        cut_slots += int((drafts == -1).sum())
        assert (budgets is not None) == async_scheduling
        if budgets is not None:
            cut_budgets += int(((budgets >= 0) & (budgets < k)).sum())
    cuts = cut_budgets if async_scheduling else cut_slots
    assert (cuts > 0) == adaptive, "the adaptive steps cut no draft (or fixed k did)"
    assert cut_slots == 0 or not async_scheduling, "async scheduling must keep drafts whole"
    assert dm._exporter is not None, "metrics were not exported"
    # The exported counters lag the device by a step at most, and are exact once caught up.
    lagged, exact = proposer.metrics_counters(), proposer.counters
    assert lagged.rejected_rows <= exact.rejected_rows and exact.rejected_rows == 3 * 1 + 2 + k


def test_host_read_guard_catches_one_item():
    """The whole-step guard is real: one ``int()`` of a tensor is a read."""
    with HostReadGuard() as guard:
        int(torch.ones(3).sum())
    assert [op for op, _ in guard.reads] == ["aten._local_scalar_dense.default"]
