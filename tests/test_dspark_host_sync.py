"""The device half of a DSpark step never reads device data on the host.

Every step is planned on the host as the proposer does it (``plan_step``), but all device
data (rings, positions, KV rows, rejection counts) lives on the ``meta`` device, which
holds no values: any ``.item()``, ``.tolist()``, ``bool()``, ``nonzero`` or data-sized
``repeat_interleave`` on it raises. On a GPU each of those would be a blocking
device-to-host sync inside vLLM's async-scheduled step. The last test shows the guard
catches one ``.item()`` slipped into the store.
"""

from __future__ import annotations

import pytest
import torch
import vllm.v1.spec_decode.dspark_ragged as dr
from vllm.models.deepseek_v4.common.packed_prefill import ingest_packed_prefill
from vllm.v1.spec_decode.dspark_step import capture_sizes, draft_anchor_positions, plan_step

DEVICE = "meta"
WINDOW, DIM, NUM_SLOTS, K = 16, 8, 6, 4


def rings():
    return dr.allocate_rings(NUM_SLOTS, WINDOW, DIM, torch.bfloat16, DEVICE)


def device_step(cache, cache_pos, table, req_ids, lengths, drafts, prefilling=None):
    """Plan on the host, then the device half on meta tensors: store, anchors, window."""
    qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    plan = plan_step(
        qsl,
        table.assign(req_ids),
        num_draft_tokens=drafts,
        prefilling=prefilling,
        temperature_cpu=None,
        window=WINDOW,
        num_slots=NUM_SLOTS,
        num_spec_tokens=K,
        draft_sizes=capture_sizes(NUM_SLOTS),
        device=DEVICE,
    )
    rows = plan.num_rows
    positions = torch.empty(rows, dtype=torch.int64, device=DEVICE)
    rejected = torch.empty(len(req_ids), dtype=torch.int64, device=DEVICE)
    kv = torch.empty(rows, DIM, dtype=torch.bfloat16, device=DEVICE)
    if plan.packed is not None:

        def project(x, pos):
            return torch.empty(x.shape[0], 1, DIM, dtype=torch.bfloat16, device=DEVICE)

        features = torch.empty(rows, 2 * DIM, device=DEVICE)
        ingest_packed_prefill(
            plan.packed,
            plan.store,
            features,
            positions,
            project,
            [(cache, cache_pos)],
            max_model_len=4096,
            num_rejected=rejected,
        )
    else:
        dr.store_context_kv(cache, cache_pos, kv, positions, plan.store, rejected)
    anchor = draft_anchor_positions(plan, positions, rejected)
    mask = dr.window_mask(cache_pos, plan.draft_slots, anchor, WINDOW)
    assert mask.shape == (plan.draft_rows, WINDOW) and mask.device.type == DEVICE
    return plan


def test_host_sync_free_flat_ragged_packed_and_release_steps():
    cache, cache_pos = rings()
    table = dr.SlotTable(NUM_SLOTS)
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
    dr.clear_slots(cache_pos, freed)
    plan = device_step(cache, cache_pos, table, ["f", "a"], [3, K + 1], [0, K])
    assert table.slot_of("f") == freed[0]


def test_host_sync_guard_catches_one_item(monkeypatch):
    """The guard is real: one ``.item()`` on device data in the store fails the step."""
    original = dr._flat_candidates

    def with_a_sync(plan, positions, acc_end, last_pos):
        if int(acc_end.sum().item()) < 0:  # the kind of check that used to live here
            raise AssertionError("unreachable")
        return original(plan, positions, acc_end, last_pos)

    monkeypatch.setattr(dr, "_flat_candidates", with_a_sync)
    cache, cache_pos = rings()
    with pytest.raises(RuntimeError, match="meta"):
        device_step(cache, cache_pos, dr.SlotTable(NUM_SLOTS), ["a", "b"], [K + 1] * 2, [K] * 2)
