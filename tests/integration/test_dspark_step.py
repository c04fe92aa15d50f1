"""The step plan (``step_plan.plan_step``): layout decisions, host numbers, named errors.

Expected values are worked out by hand from the step's host metadata (lengths, draft
counts, prefill flags), not taken from the module.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from vllm.v1.spec_decode.dspark.context_store import last_accepted
from vllm.v1.spec_decode.dspark.step_plan import capture_sizes, draft_anchor_positions, plan_step

K, WINDOW, SLOTS = 4, 8, 6


def plan(lengths, slots=None, drafts=None, prefilling=None, temperature=None, *, qsl=None, **kw):
    """``plan_step`` of one step; no drafts verified and nobody prefilling unless given."""
    num = len(lengths)
    return plan_step(
        np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]) if qsl is None else qsl,
        list(range(num)) if slots is None else slots,
        num_draft_tokens=np.zeros(num, np.int64) if drafts is None else np.asarray(drafts),
        prefilling=np.zeros(num, bool) if prefilling is None else np.asarray(prefilling),
        temperature_cpu=None if temperature is None else np.asarray(temperature),
        never_cut=kw.pop("never_cut", None),
        window=WINDOW,
        num_slots=SLOTS,
        num_spec_tokens=K,
        draft_sizes=kw.pop("sizes", capture_sizes(SLOTS)),
        **kw,
    )


def test_capture_sizes_cover_every_batch():
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(1) == [1]


def test_decode_step_is_flat_with_padded_draft_batch_and_host_counts():
    p = plan([K + 1] * 3, slots=[4, 0, 2], drafts=[K, K, 2], temperature=[0.0, 0.7, 1.0])
    assert p.store.uniform and p.packed is None
    assert (p.num_requests, p.num_rows, p.draft_rows) == (3, 15, 4)
    assert p.draft_slots.tolist() == [4, 0, 2, SLOTS]  # the pad row reads the scratch row
    assert (p.num_verified, p.num_discarded, p.num_sampled) == (10, 0, 2)
    assert p.store.max_rejected_rows == 10


def test_prefill_chunk_goes_through_packed_prefill_and_prefilling_rejects_nothing():
    p = plan([K + 1, 40], drafts=[K, 0], prefilling=[False, True])
    assert not p.store.uniform and p.packed is not None
    assert (p.num_requests, p.packed.num_tokens) == (2, 45)
    assert p.store.max_rejected_rows == K and p.num_discarded == 1
    # A prefilling request's rejection bound is 0 whatever the draft count says.
    assert plan([K + 1, 3], drafts=[K, 2], prefilling=[False, True]).store.max_rejected_rows == K


def test_anchor_positions_follow_the_device_rejections_and_pads_are_zero():
    p = plan([K + 1, 3], drafts=[K, 0])
    positions = torch.tensor([10, 11, 12, 13, 14, 0, 1, 2])
    anchors = draft_anchor_positions(p, last_accepted(p.store, positions, torch.tensor([3, 0])))
    assert anchors.tolist() == [12, 3]  # request 0 keeps rows 10..11, request 1 rows 0..2
    p = plan([1, 1, 1], drafts=[0, 0, 0])
    accepted = last_accepted(p.store, torch.tensor([5, 9, 0]), torch.zeros(3, dtype=torch.long))
    assert draft_anchor_positions(p, accepted).tolist() == [6, 10, 1, 0]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"lengths": [3], "slots": [0, 1]}, r"query_start_loc_cpu must have shape \[3\], got \(2,\)"),
        ({"lengths": [3], "qsl": np.array([1, 4])}, r"query_start_loc_cpu\[0\] must be 0, got 1"),
        ({"lengths": [3, 0], "drafts": [0, 0]}, r"request 1 has 0 rows \(query_start_loc_cpu\[2\]"),
        ({"lengths": [5, 0], "qsl": np.array([0, 5, 3])}, "request 1 has -2 rows"),
        ({"lengths": [3, 2], "drafts": [1]}, r"num_draft_tokens must have shape \[2\], got \(1,\)"),
        ({"lengths": [6], "drafts": [1.0]}, "num_draft_tokens must hold integers, got float64"),
        ({"lengths": [6], "drafts": [K + 1]}, rf"num_draft_tokens must be in \[0, k={K}\]"),
        ({"lengths": [6], "drafts": [-1]}, rf"num_draft_tokens must be in \[0, k={K}\]"),
        ({"lengths": [3], "drafts": [3]}, "request 0 has 3 rows .* but 3 verified drafts"),
        ({"lengths": [3, 2], "prefilling": [True]}, r"prefilling must have shape \[R\] with R=2"),
        ({"lengths": [3], "temperature": [0.5, 1.0]}, r"temperature_cpu must have shape \[R\]"),
        ({"lengths": [3, 2], "never_cut": [True]}, r"never_cut must have shape \[R\] with R=2"),
        ({"lengths": [1, 1, 1], "sizes": [1, 2]}, "exceed the largest draft size"),
        ({"lengths": [3], "slots": [SLOTS]}, rf"slots must be in \[0, S={SLOTS}\)"),
        ({"lengths": [3], "slots": [-1]}, rf"slots must be in \[0, S={SLOTS}\)"),
        ({"lengths": [3, 2], "slots": [1, 1]}, r"slots must be distinct"),
    ],
)
def test_bad_step_metadata_raises_before_any_device_work(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        plan(**kwargs, device="meta")  # no device work: the error comes before any copy


def test_largest_prefill_chunk_is_packed_and_one_rank_owns_it_by_default():
    """N = 8192 (the recipe's max_num_batched_tokens) is still a packed chunk; without
    tp_size the plan is for one GPU, whose single rank owns every row."""
    p = plan([K + 1, 8192 - (K + 1)], drafts=[K, 0], prefilling=[False, True])
    assert p.packed is not None and p.packed.num_tokens == 8192
    assert (p.packed.tp_size, p.packed.rows_per_rank, p.packed.num_pad_rows) == (1, 8192, 0)


def test_never_cut_rows_are_drafting_requests_and_pads_are_cut_freely():
    """A request in chunked prefill drafts nothing to keep; a pad row is no request."""
    p = plan([K + 1, 9, K + 1], drafts=[K, 0, K], prefilling=[False, True, False],
             never_cut=[True, True, False])
    assert p.never_cut.tolist() == [1, 0, 0, 0] and p.num_never_cut == 1
    assert plan([K + 1], drafts=[K]).never_cut.tolist() == [0]


def test_greedy_step_samples_nothing():
    """No temperatures given: every request drafts greedily."""
    assert plan([K + 1] * 2, drafts=[K, K]).num_sampled == 0
    assert plan([K + 1] * 2, drafts=[K, K], temperature=[0.0, 0.0]).num_sampled == 0


@pytest.mark.parametrize(
    "qsl, got",
    [
        (torch.tensor([[0, 3]]), r"must have shape \[2\], got \(1, 2\)"),
        (np.array([[0, 3]]), r"must have shape \[2\], got \(1, 2\)"),
        (torch.tensor([0, 3], device="meta"), r"must be a host \(CPU\) array \[2\], got meta"),
        (np.array([0.0, 3.0]), "must hold integers, got float64"),
    ],
)
def test_query_start_loc_that_is_not_a_host_vector_names_what_it_got(qsl, got):
    with pytest.raises(ValueError, match=rf"^query_start_loc_cpu {got}$"):
        plan([3], qsl=qsl)


def test_plan_is_frozen_and_compares_by_identity():
    """Built once on the host, replayed by the device work: no field changes after planning;
    it holds tensors, so ``==`` is identity (never a tensor comparison)."""
    first, second = plan([K + 1] * 2), plan([K + 1] * 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.num_sampled = 1
    assert first == first and first != second and len({first, second}) == 2


@pytest.mark.parametrize("lengths, prefilling, packed", [
    ([K + 1, K + 1], [False, False], False),  # R verify blocks of k + 1 rows: a decode step
    ([K + 1, K + 2], [False, True], True),  # one row more than that: a prefill chunk is in it
    ([K + 2], [True], True),
])
def test_a_step_with_more_rows_than_its_verify_blocks_carries_a_prefill_chunk(lengths, prefilling, packed):
    p = plan(lengths, drafts=[0] * len(lengths), prefilling=prefilling)
    assert (p.packed is not None) is packed


def test_runner_numpy_query_start_loc_plans_like_the_tensor():
    """The runner hands its int32 numpy view; the plan (packed part included) is the same."""
    lengths = [K + 1, 40, 2]
    qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    kw = dict(num_draft_tokens=np.array([K, 0, 1]), prefilling=np.array([False, True, False]),
              temperature_cpu=None, never_cut=None, window=WINDOW, num_slots=SLOTS,
              num_spec_tokens=K, draft_sizes=capture_sizes(SLOTS))
    from_tensor = plan_step(qsl, [3, 1, 5], **kw)
    from_numpy = plan_step(qsl.numpy(), [3, 1, 5], **kw)
    for a, b in ((from_tensor, from_numpy), (from_tensor.store, from_numpy.store)):
        for field in dataclasses.fields(a):
            x, y = getattr(a, field.name), getattr(b, field.name)
            if isinstance(x, torch.Tensor):
                assert torch.equal(x, y), field.name
            elif field.name != "store":
                assert x == y, field.name
    assert from_numpy.packed is not None and from_numpy.packed.num_tokens == 47
    # The plan keeps its own copy: the runner may refill its buffer next step (int64: the
    # one dtype the plan would not have to convert).
    for buffer in (qsl.numpy().copy(), qsl.numpy().astype(np.int64)):
        p = plan_step(buffer, [3, 1, 5], **kw)
        buffer[:] = 0
        assert p.store.seg_end.tolist() == [K + 1, K + 41, K + 43]
