"""The step plan (``dspark_step.plan_step``): layout decisions, host numbers, named errors.

Expected values are worked out by hand from the step's host metadata (lengths, draft
counts, prefill flags), not taken from the module.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from vllm.v1.spec_decode.dspark.step_plan import capture_sizes, draft_anchor_positions, plan_step

K, WINDOW, SLOTS = 4, 8, 6


def plan(lengths, slots=None, drafts=None, prefilling=None, temperature=None, **kw):
    qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return plan_step(
        qsl,
        list(range(len(lengths))) if slots is None else slots,
        num_draft_tokens=drafts,
        prefilling=prefilling,
        temperature_cpu=temperature,
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
    assert (p.packed.num_tokens, p.packed.num_requests) == (45, 2)
    assert p.store.max_rejected_rows == K and p.num_discarded == 1
    # A prefilling request's rejection bound is 0 whatever the draft count says.
    assert plan([K + 1, 3], drafts=[K, 2], prefilling=[False, True]).store.max_rejected_rows == K


def test_anchor_positions_follow_the_device_rejections_and_pads_are_zero():
    p = plan([K + 1, 3], drafts=[K, 0])
    positions = torch.tensor([10, 11, 12, 13, 14, 0, 1, 2])
    anchors = draft_anchor_positions(p, positions, torch.tensor([3, 0]))
    assert anchors.tolist() == [12, 3]  # request 0 keeps rows 10..11, request 1 rows 0..2
    p = plan([1, 1, 1], drafts=[0, 0, 0])
    anchors = draft_anchor_positions(p, torch.tensor([5, 9, 0]), torch.zeros(3, dtype=torch.long))
    assert anchors.tolist() == [6, 10, 1, 0]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"lengths": [3], "slots": [0, 1]}, r"query_start_loc_cpu must be a host tensor or numpy array \[R\+1\]"),
        ({"lengths": [3, 2], "drafts": [1]}, r"num_draft_tokens must have shape \[R\]"),
        ({"lengths": [6], "drafts": [K + 1]}, rf"num_draft_tokens must be in \[0, k={K}\]"),
        ({"lengths": [6], "drafts": [-1]}, rf"num_draft_tokens must be in \[0, k={K}\]"),
        ({"lengths": [3], "drafts": [3]}, "keeps its anchor row"),
        ({"lengths": [3, 2], "prefilling": [True]}, r"prefilling must have shape \[R\]"),
        ({"lengths": [3], "temperature": [0.5, 1.0]}, r"temperature_cpu must have shape \[R\]"),
        ({"lengths": [1, 1, 1], "sizes": [1, 2]}, "exceed the largest draft size"),
        ({"lengths": [3], "slots": [SLOTS]}, rf"slots must be in \[0, S={SLOTS}\)"),
    ],
)
def test_bad_step_metadata_raises_before_any_device_work(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        plan(**kwargs)


def test_largest_prefill_chunk_is_packed_and_one_rank_owns_it_by_default():
    """N = 8192 is still a packed chunk (DESIGN section 6: 1 <= N <= 8192); without tp_size
    the plan is for one GPU, whose single rank owns every row."""
    p = plan([K + 1, 8192 - (K + 1)], drafts=[K, 0], prefilling=[False, True])
    assert p.packed is not None and p.packed.num_tokens == 8192
    assert (p.packed.tp_size, p.packed.rows_per_rank, p.packed.num_pad_rows) == (1, 8192, 0)


def test_greedy_step_samples_nothing():
    """No temperatures given: every request drafts greedily."""
    assert plan([K + 1] * 2, drafts=[K, K]).num_sampled == 0
    assert plan([K + 1] * 2, drafts=[K, K], temperature=[0.0, 0.0]).num_sampled == 0


@pytest.mark.parametrize(
    "qsl, got",
    [
        ([0, 3], "list"),
        (torch.tensor([[0, 3]]), r"shape \(1, 2\) on cpu"),
        (np.array([[0, 3]]), r"shape \(1, 2\) on cpu"),
        (torch.tensor([0, 3], device="meta"), r"shape \(2,\) on meta"),
    ],
)
def test_query_start_loc_that_is_not_a_host_vector_names_what_it_got(qsl, got):
    with pytest.raises(ValueError, match=rf"R=1, got {got}$"):
        plan_step(qsl, [0], num_draft_tokens=None, prefilling=None, temperature_cpu=None,
                  window=WINDOW, num_slots=SLOTS, num_spec_tokens=K, draft_sizes=[1])


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
    kw = dict(num_draft_tokens=[K, 0, 1], prefilling=[False, True, False], temperature_cpu=None,
              window=WINDOW, num_slots=SLOTS, num_spec_tokens=K, draft_sizes=capture_sizes(SLOTS))
    from_tensor = plan_step(qsl, [3, 1, 5], **kw)
    from_numpy = plan_step(qsl.numpy(), [3, 1, 5], **kw)
    for a, b in ((from_tensor, from_numpy), (from_tensor.store, from_numpy.store)):
        for field in dataclasses.fields(a):
            x, y = getattr(a, field.name), getattr(b, field.name)
            if isinstance(x, torch.Tensor):
                assert torch.equal(x, y), field.name
            elif field.name not in ("store", "packed"):
                assert x == y, field.name
    assert from_numpy.packed is not None
    assert torch.equal(from_numpy.packed.query_start_loc, qsl)
    assert (from_numpy.packed.num_tokens, from_numpy.packed.num_requests) == (47, 3)
    # The plan keeps its own copy: the runner may refill its buffer next step.
    buffer = qsl.numpy().copy()
    p = plan_step(buffer, [3, 1, 5], **kw)
    buffer[:] = 0
    assert p.packed.query_start_loc.tolist() == [0, K + 1, K + 41, K + 43]
