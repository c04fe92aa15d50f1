"""Tests for the ragged DSpark context path (overlay/vllm/v1/spec_decode/dspark/context_store.py).

Every store result is compared bitwise against `reference_store`, a plain per-request,
per-row Python loop written here from the contract (not from the module). Store plans come
from the product's planner (`plan_step`, through `tests.support.step_plans`), so a step here
obeys what the runner guarantees: every request keeps its anchor row.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.overlay import load_overlay_module
from tests.support.step_plans import store_plan

dr = load_overlay_module("vllm/v1/spec_decode/dspark/context_store.py")
rings = load_overlay_module("vllm/v1/spec_decode/dspark/rings.py")

BIT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


# ---------------------------------------------------------------------------
# Independent reference and helpers
# ---------------------------------------------------------------------------


def reference_store(cache, cache_pos, kv, positions, qsl, slots, num_rejected=None):
    """The contract, one request and one row at a time, in Python ints."""
    window = cache.shape[1]
    qsl = [int(x) for x in qsl]
    positions = [int(x) for x in positions]
    slots = [int(x) for x in slots]
    num_requests = len(qsl) - 1
    rej = [0] * num_requests if num_rejected is None else [int(x) for x in num_rejected]
    for r in range(num_requests):
        start, end = qsl[r], qsl[r + 1] - rej[r]
        if end <= start:
            continue
        last = positions[end - 1]
        for row in range(start, end):
            pos = positions[row]
            if pos > last - window:
                cache[slots[r], pos % window] = kv[row]
                cache_pos[slots[r], pos % window] = pos


def reference_mask(cache_pos, slots, anchors, window):
    out = torch.zeros(len(slots), window, dtype=torch.bool)
    for i, (slot, anchor) in enumerate(zip(slots.tolist(), anchors.tolist(), strict=True)):
        for c in range(window):
            held = int(cache_pos[slot, c])
            out[i, c] = held >= 0 and anchor - window <= held < anchor
    return out


def bits(t):
    return t.view(BIT_VIEW[t.dtype]) if t.dtype in BIT_VIEW else t


def assert_bitwise_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a), bits(b))


def make_cache(num_slots, window, dim, dtype, gen):
    """Cache pre-filled with junk and plausible positions, so untouched cells are checked."""
    cache = torch.randn(num_slots, window, dim, generator=gen).to(dtype)
    cache_pos = torch.randint(-1, 2000, (num_slots, window), generator=gen)
    return cache, cache_pos


def qsl_of(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def contiguous_positions(starts, lengths):
    return torch.cat(
        [torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)]
        or [torch.zeros(0, dtype=torch.int64)]
    )


def store(cache, cache_pos, kv, positions, qsl, slots, rej=None, bound=None):
    """Plan and run the store on ``cache`` (all rows live); the scratch row is added here.

    ``bound`` (default: ``rej``) is the plan's per-request rejection bound; the device
    store gets the actual ``rej``.
    """
    num_slots, window = cache.shape[:2]
    plan = store_plan(
        qsl, slots, rej if bound is None else bound, window=window, num_slots=num_slots
    )
    ext_c, ext_p = torch.cat([cache, cache[:1]]), torch.cat([cache_pos, cache_pos[:1]])
    rej = torch.zeros(plan.num_requests, dtype=torch.int64) if rej is None else torch.as_tensor(rej)
    accepted = dr.last_accepted(plan, positions.long(), rej)
    dr.store_context_kv(ext_c, ext_p, kv, positions.long(), plan, accepted)
    cache.copy_(ext_c[:num_slots])
    cache_pos.copy_(ext_p[:num_slots])
    return plan


def run_both(cache, cache_pos, kv, positions, qsl, slots, rej, bound=None):
    """Store with the module and with the reference on copies; assert bitwise equality."""
    got_c, got_p = cache.clone(), cache_pos.clone()
    ref_c, ref_p = cache.clone(), cache_pos.clone()
    store(got_c, got_p, kv, positions, qsl, slots, rej, bound)
    reference_store(ref_c, ref_p, kv, positions, qsl, slots, rej)
    assert_bitwise_equal(got_c, ref_c)
    assert torch.equal(got_p, ref_p)
    return got_c, got_p


# ---------------------------------------------------------------------------
# Property tests
# ---------------------------------------------------------------------------


@st.composite
def ragged_steps(draw, window, dtype):
    """A packed step mixing prefill chunks (1..300 rows) and verify segments (1..6 rows)."""
    num_requests = draw(st.integers(1, 64))
    num_slots = num_requests + draw(st.integers(0, 8))
    lengths, rejected, starts, gapped = [], [], [], []
    for _ in range(num_requests):
        if draw(st.integers(0, 3)) == 0:  # prefill chunk
            n = draw(st.integers(1, 300))
            # Mostly 0; sometimes all but the first row, or a partial suffix (it separates
            # "last W accepted" from "last W rows").
            rej = draw(st.one_of(st.just(0), st.just(n - 1), st.integers(0, n - 1)))
        else:  # verify rows: anchor + drafts, a suffix rejected (never the anchor)
            n = draw(st.integers(1, 6))
            rej = draw(st.integers(0, n - 1))
        lengths.append(n)
        rejected.append(rej)
        starts.append(draw(st.integers(0, 1000)))
        gapped.append(draw(st.booleans()) and draw(st.booleans()))
    seed = draw(st.integers(0, 2**31 - 1))
    return num_requests, window, dtype, num_slots, lengths, rejected, starts, gapped, seed


def build_step(num_requests, window, dtype, num_slots, lengths, rejected, starts, gapped, seed):
    """Step tensors; the rejection bound is the actual count plus a random slack."""
    gen = torch.Generator().manual_seed(seed)
    dim = 8
    cache, cache_pos = make_cache(num_slots, window, dim, dtype, gen)
    segs = []
    for s, n, gap in zip(starts, lengths, gapped, strict=True):
        # Gapped segments have strictly increasing but non-contiguous positions, so
        # "position > last - W" differs from "the last W rows".
        steps = (
            torch.randint(1, 4, (n,), generator=gen) if gap else torch.ones(n, dtype=torch.int64)
        )
        segs.append(s + steps.cumsum(0) - steps[0])
    positions = torch.cat(segs)
    kv = torch.randn(positions.numel(), dim, generator=gen).to(dtype)
    slots = torch.randperm(num_slots, generator=gen)[:num_requests]
    rej = torch.tensor(rejected)
    slack = torch.randint(0, 3, (num_requests,), generator=gen)
    bound = torch.minimum(rej + slack, torch.tensor(lengths) - 1)
    return cache, cache_pos, kv, positions, qsl_of(lengths), slots, rej, bound


@pytest.mark.parametrize("window", [4, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_store_matches_per_request_reference(window, dtype):
    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(ragged_steps(window, dtype))
    def check(step):
        run_both(*build_step(*step))

    check()


@settings(max_examples=40, deadline=None)
@given(
    num_requests=st.integers(1, 64),
    seg_len=st.integers(1, 300),
    window=st.sampled_from([4, 128]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    with_rejections=st.booleans(),
    gapped=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_flat_path_equals_ragged_path_on_uniform_batches(
    num_requests, seg_len, window, dtype, with_rejections, gapped, seed
):
    gen = torch.Generator().manual_seed(seed)
    seg_len = min(seg_len, 6) if num_requests > 16 else seg_len  # keep T modest
    lengths = [seg_len] * num_requests
    starts = torch.randint(0, 1000, (num_requests,), generator=gen).tolist()
    positions = contiguous_positions(starts, lengths)
    if gapped:  # strictly increasing with holes: some accepted rows leave the window
        steps = torch.randint(1, 4, (num_requests, seg_len), generator=gen)
        positions = positions.view(num_requests, seg_len)[:, :1] + steps.cumsum(1)
        positions = positions.reshape(-1)
    kv = torch.randn(positions.numel(), 8, generator=gen).to(dtype)
    slots = torch.randperm(num_requests + 3, generator=gen)[:num_requests]
    rej = torch.randint(0, seg_len, (num_requests,), generator=gen) if with_rejections else None
    cache, cache_pos = make_cache(num_requests + 3, window, 8, dtype, gen)
    qsl = qsl_of(lengths)

    flat_c, flat_p = run_both(cache, cache_pos, kv, positions, qsl, slots, rej)
    # Same call with the ragged path forced on the uniform batch.
    ragged_c, ragged_p = cache.clone(), cache_pos.clone()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dr, "is_flat_step", lambda lengths: False)
        plan = store(ragged_c, ragged_p, kv, positions, qsl, slots, rej)
    assert not plan.uniform and plan.num_candidates > 0
    assert_bitwise_equal(flat_c, ragged_c)
    assert torch.equal(flat_p, ragged_p)


# ---------------------------------------------------------------------------
# Targeted store tests
# ---------------------------------------------------------------------------


def test_uniform_batches_take_flat_path_and_ragged_ones_the_ragged_path(monkeypatch):
    calls = []
    for name in ("_flat_candidates", "_ragged_candidates"):
        original = getattr(dr, name)

        def spy(*args, _name=name, _original=original):
            calls.append(_name)
            return _original(*args)

        monkeypatch.setattr(dr, name, spy)
    cache, cache_pos = torch.zeros(4, 8, 2), torch.full((4, 8), -1)
    slots = torch.tensor([1, 3])
    flat = store(cache, cache_pos, torch.ones(6, 2), torch.arange(6), qsl_of([3, 3]), slots)
    ragged = store(cache, cache_pos, torch.ones(6, 2), torch.arange(6), qsl_of([5, 1]), slots)
    assert calls == ["_flat_candidates", "_ragged_candidates"]
    assert (flat.uniform, flat.seg_len, flat.num_candidates) == (True, 3, 6)
    assert (ragged.uniform, ragged.num_candidates) == (False, 6)
    assert ragged.cand_rows.tolist() == list(range(6))
    assert ragged.cand_req.tolist() == [0] * 5 + [1]


def test_ragged_step_then_flat_step_equals_per_request():
    gen = torch.Generator().manual_seed(0)
    window, dim = 16, 4
    cache = torch.zeros(4, window, dim, dtype=torch.bfloat16)
    cache_pos = torch.full((4, window), -1)
    ref_c, ref_p = cache.clone(), cache_pos.clone()
    slots = torch.tensor([2, 0, 3])

    # Step 1 (ragged): a 40-row prefill chunk, a 5-row chunk, a 3-row verify.
    lengths1, starts1 = [40, 5, 3], [0, 0, 10]
    pos1 = contiguous_positions(starts1, lengths1)
    kv1 = torch.randn(pos1.numel(), dim, generator=gen).to(torch.bfloat16)
    rej1 = torch.tensor([0, 0, 1])
    assert not store(cache, cache_pos, kv1, pos1, qsl_of(lengths1), slots, rej1).uniform

    # Step 2 (flat): every request verifies 4 rows starting after its anchor.
    anchors = (pos1[qsl_of(lengths1)[1:] - 1 - rej1] + 1).tolist()  # next position per request
    lengths2 = [4, 4, 4]
    pos2 = contiguous_positions(anchors, lengths2)
    kv2 = torch.randn(pos2.numel(), dim, generator=gen).to(torch.bfloat16)
    rej2 = torch.tensor([3, 0, 2])
    assert store(cache, cache_pos, kv2, pos2, qsl_of(lengths2), slots, rej2).uniform

    # Per request, one request at a time.
    for r in range(3):
        for lengths, pos, kv, rej in ((lengths1, pos1, kv1, rej1), (lengths2, pos2, kv2, rej2)):
            q = qsl_of(lengths)
            lo, hi = int(q[r]), int(q[r + 1])
            reference_store(
                ref_c,
                ref_p,
                kv[lo:hi],
                pos[lo:hi],
                [0, hi - lo],
                slots[r : r + 1],
                rej[r : r + 1],
            )
    assert_bitwise_equal(cache, ref_c)
    assert torch.equal(cache_pos, ref_p)


def test_rejected_rows_never_overwrite_live_context():
    window, dim = 4, 2
    cache = torch.zeros(1, window, dim)
    cache_pos = torch.full((1, window), -1)
    # Context 0..3 fills the ring.
    ctx = torch.arange(4.0)[:, None].expand(4, dim).contiguous()
    store(cache, cache_pos, ctx, torch.arange(4), qsl_of([4]), torch.tensor([0]))
    # Verify rows at 4..7: anchor accepted, 3 drafts rejected. Positions 5, 6, 7 alias
    # cells 1, 2, 3, which hold 1, 2, 3: still inside the next window [1, 4].
    verify = torch.full((4, dim), 99.0)
    store(
        cache,
        cache_pos,
        verify,
        torch.arange(4, 8),
        qsl_of([4]),
        torch.tensor([0]),
        torch.tensor([3]),
    )
    assert cache_pos[0].tolist() == [4, 1, 2, 3]
    assert cache[0, :, 0].tolist() == [99.0, 1.0, 2.0, 3.0]
    mask = dr.window_mask(cache_pos, torch.tensor([0]), torch.tensor([5]), window)
    assert mask.tolist() == [[True, True, True, True]]


def test_long_segment_keeps_last_window_of_accepted_positions():
    window, dim = 8, 3
    cache = torch.zeros(2, window, dim)
    cache_pos = torch.full((2, window), -1)
    positions = torch.arange(100, 130)  # 30 rows
    kv = positions.float()[:, None].expand(30, dim).contiguous()
    store(cache, cache_pos, kv, positions, qsl_of([30]), torch.tensor([1]), torch.tensor([5]))
    # Accepted 100..124; the last 8 are 117..124.
    assert sorted(cache_pos[1].tolist()) == list(range(117, 125))
    for c in range(window):
        assert cache[1, c, 0].item() == float(cache_pos[1, c])
        assert int(cache_pos[1, c]) % window == c
    assert (cache_pos[0] == -1).all() and (cache[0] == 0).all()


def test_arbitrary_bit_patterns_are_copied_bitwise():
    """NaN payloads, -0.0, inf and subnormals survive the store unchanged."""
    gen = torch.Generator().manual_seed(3)
    lengths = [7, 2, 130, 1]
    raw = torch.randint(-(2**15), 2**15, (sum(lengths), 64), generator=gen, dtype=torch.int16)
    raw[0, :4] = torch.tensor([0x7FC1, 0x7F81, -32768, 0x0001], dtype=torch.int16)  # NaNs, -0
    kv = raw.view(torch.bfloat16)
    cache = torch.zeros(5, 128, 64, dtype=torch.bfloat16)
    cache_pos = torch.full((5, 128), -1)
    positions = contiguous_positions([0, 50, 300, 9], lengths)
    run_both(cache, cache_pos, kv, positions, qsl_of(lengths), torch.tensor([4, 0, 2, 1]), None)


@pytest.mark.parametrize(
    ("lo", "hi"),
    [(0, 24), (24, 48), (4, 12), (2, 12)],
    ids=["layer0", "layer1", "misaligned-offset", "odd-row-bytes"],
)
def test_non_contiguous_kv_and_cache_views(lo, hi):
    """A layer's column slice of a wider cache and of a [T, K * D] projection.

    The last two cases cannot be viewed as 16-byte words and take the plain copy.
    """
    gen = torch.Generator().manual_seed(4)
    lengths = [6, 6, 40]
    both_layers = torch.randn(sum(lengths), 48, generator=gen).to(torch.bfloat16)
    wide_cache = torch.randn(3, 16, 48, generator=gen).to(torch.bfloat16)
    kv, cache = both_layers[:, lo:hi], wide_cache[:, :, lo:hi]
    untouched = torch.cat([wide_cache[:, :, :lo], wide_cache[:, :, hi:]], dim=2).clone()
    cache_pos = torch.randint(-1, 60, (3, 16), generator=gen)
    positions = contiguous_positions([3, 0, 10], lengths)
    run_both(cache, cache_pos, kv, positions, qsl_of(lengths), torch.tensor([2, 0, 1]), None)
    # run_both stores into clones; store into the view itself and check its neighbours.
    store(cache, cache_pos, kv, positions, qsl_of(lengths), torch.tensor([2, 0, 1]))
    after = torch.cat([wide_cache[:, :, :lo], wide_cache[:, :, hi:]], dim=2)
    assert_bitwise_equal(after, untouched)


def test_rejected_rows_write_nothing_and_the_anchor_is_kept():
    cache = torch.ones(3, 4, 2)
    cache_pos = torch.full((3, 4), 7)
    kv = torch.zeros(5, 2)
    store(
        cache,
        cache_pos,
        kv,
        torch.tensor([10, 11, 12, 0, 1]),
        torch.tensor([0, 3, 5]),
        torch.tensor([1, 2]),
        torch.tensor([2, 1]),
    )
    # Request 0 keeps only position 10 (cell 2), request 1 only position 0 (cell 0).
    assert (cache[0] == 1).all() and (cache_pos[0] == 7).all()
    assert cache_pos[1].tolist() == [7, 7, 10, 7] and cache_pos[2].tolist() == [0, 7, 7, 7]
    assert cache[1, 2].tolist() == [0.0, 0.0] and cache[2, 0].tolist() == [0.0, 0.0]
    assert (cache[1, [0, 1, 3]] == 1).all() and (cache[2, 1:] == 1).all()


# ---------------------------------------------------------------------------
# Layout helpers
# ---------------------------------------------------------------------------


def _plan(qsl, slots=None, bound=None, window=8, num_slots=8):
    slots = list(range(max(len(qsl) - 1, 0))) if slots is None else slots
    return store_plan(qsl, slots, bound, window=window, num_slots=num_slots)


def test_plan_layout_flat_and_ragged():
    flat = _plan([0, 6, 12, 18], bound=[1, 0, 5])
    assert flat.uniform and flat.seg_len == 6 and flat.num_rows == 18
    assert flat.seg_end.tolist() == [6, 12, 18] and flat.max_rejected_rows == 6
    assert flat.num_candidates == 3 * 6  # min(6, W + max bound) columns per request
    assert _plan([0, 300]).uniform and not _plan([0]).uniform and _plan([0]).num_candidates == 0
    # Ragged: each request's last min(len, W + bound) rows, in packed order.
    ragged = _plan([0, 20, 22, 30], bound=[0, 1, 3], window=4)
    assert not ragged.uniform
    assert ragged.cand_rows.tolist() == [*range(16, 20), 20, 21, *range(23, 30)]
    assert ragged.cand_req.tolist() == [0] * 4 + [1] * 2 + [2] * 7
    assert ragged.slots.dtype == torch.int64 and ragged.slots.tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda: _plan([1, 3]), r"query_start_loc_cpu\[0\] must be 0"),
        (lambda: _plan([0, 3, 2]), r"request 1 has -1 rows"),
        (lambda: _plan([0.0, 3.0]), "query_start_loc_cpu must hold integers"),
        (lambda: _plan([]), r"query_start_loc_cpu must have shape \[1\]"),
        (lambda: _plan([[0, 3]], slots=[0]), "query_start_loc_cpu must have shape"),
        (lambda: _plan([0, 3, 5], bound=[0]), "num_draft_tokens must have shape"),
        (lambda: _plan([0, 3, 5], bound=[0, 2]), r"num_draft_tokens\[r\] must be < its row count"),
        (lambda: _plan([0, 3, 5], bound=[-1, 0]), r"num_draft_tokens must be in \[0, k=1\]"),
        (lambda: _plan([0, 3, 5], bound=[0.0, 1.0]), "num_draft_tokens must hold integers"),
        # R is the number of ring rows the proposer assigned: a mismatched layout is named.
        (lambda: _plan([0, 3, 5], slots=[0]), r"query_start_loc_cpu must have shape \[2\], got \(3,\)"),
        (lambda: _plan([0, 3, 5], slots=[0, 8]), r"slots must be in \[0, S=8\)"),
        (lambda: _plan([0, 3, 5], slots=[-1, 0]), "slots must be in"),
        (lambda: _plan([0, 3, 5], slots=[2, 2]), "slots must be distinct"),
    ],
)
def test_plan_rejects_bad_input_with_its_own_message(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()


def test_plan_refuses_device_tensors_it_would_have_to_read():
    meta_qsl = torch.tensor([0, 3]).to("meta")
    with pytest.raises(ValueError, match="query_start_loc_cpu must be a host"):
        _plan(meta_qsl, slots=[0])


# ---------------------------------------------------------------------------
# window_mask
# ---------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    window=st.sampled_from([4, 16]),
    num_requests=st.integers(1, 12),
    seed=st.integers(0, 2**31 - 1),
)
def test_window_mask_matches_reference(window, num_requests, seed):
    gen = torch.Generator().manual_seed(seed)
    cache_pos = torch.randint(-1, 60, (num_requests + 2, window), generator=gen)
    slots = torch.randperm(num_requests + 2, generator=gen)[:num_requests]
    anchors = torch.randint(0, 70, (num_requests,), generator=gen)
    got = dr.window_mask(cache_pos, slots, anchors, window)
    assert got.dtype == torch.bool and got.shape == (num_requests, window)
    assert torch.equal(got, reference_mask(cache_pos, slots, anchors, window))


def test_window_mask_pad_rows_attend_nothing():
    """A draft pad row reads the scratch row with anchor 0: no cell is visible."""
    cache_pos = torch.tensor([[0, 1, 2, 3], [7, 4, 5, 6]])
    mask = dr.window_mask(cache_pos, torch.tensor([1, 0]), torch.tensor([0, 0]), 4)
    assert not mask.any()


# ---------------------------------------------------------------------------
# SlotTable: KV follows the request id
# ---------------------------------------------------------------------------


def _decode_step(table, cache, cache_pos, req_ids, next_pos, kv_value):
    """One decode step (1 row per request) for the given batch order."""
    slots = table.assign(req_ids)
    positions = torch.tensor([next_pos[r] for r in req_ids])
    kv = torch.tensor([[float(kv_value[r](next_pos[r]))] for r in req_ids])
    store(cache, cache_pos, kv, positions, qsl_of([1] * len(req_ids)), slots)
    for r in req_ids:
        next_pos[r] += 1
    return slots


def test_slot_table_reorder_and_condense_keep_context_with_request():
    window = 4
    table = rings.SlotTable(4)
    cache = torch.zeros(4, window, 1)
    cache_pos = torch.full((4, window), -1)
    value = {"a": lambda p: 1000 + p, "b": lambda p: 2000 + p, "c": lambda p: 3000 + p}
    next_pos = {"a": 0, "b": 0, "c": 0}

    first = _decode_step(table, cache, cache_pos, ["a", "b", "c"], next_pos, value)
    assert first == [0, 1, 2]
    # vLLM reorders the batch: rows move, slots do not.
    assert _decode_step(table, cache, cache_pos, ["c", "a", "b"], next_pos, value) == [2, 0, 1]
    # "b" finishes; the batch condenses and "c" moves to batch row 1.
    freed = table.release(["b"])
    assert freed == [1]
    rings.clear_slots(cache_pos, freed)
    assert _decode_step(table, cache, cache_pos, ["a", "c"], next_pos, value) == [0, 2]
    # Each ring row holds only its own request's values, at its own positions.
    for req, slot in (("a", 0), ("c", 2)):
        held = sorted(int(p) for p in cache_pos[slot] if p >= 0)
        assert held == [0, 1, 2]
        for c in range(window):
            if cache_pos[slot, c] >= 0:
                assert cache[slot, c, 0].item() == value[req](int(cache_pos[slot, c]))
    # A new request takes the lowest free row (the one "b" released).
    assert table.assign(["a", "d", "c"]) == [0, 1, 2]
    assert sorted(table.held_ids) == ["a", "c", "d"]


def test_reused_slot_does_not_expose_old_context():
    window = 8
    table = rings.SlotTable(2)
    cache = torch.zeros(2, window, 1)
    cache_pos = torch.full((2, window), -1)
    # Request "old" fills row 0 with positions 92..99.
    slot = table.assign(["old"])
    positions = torch.arange(92, 100)
    store(cache, cache_pos, torch.ones(8, 1), positions, qsl_of([8]), slot)
    freed = table.release(["old"])
    assert freed == [0]
    rings.clear_slots(cache_pos, freed)
    assert (cache_pos[0] == -1).all()

    # Request "new" reuses row 0 after a prefix-cache hit: it only stores 96..97,
    # so the cells for 90..95 are holes. Its anchor is 98: window [90, 98).
    slot = table.assign(["new"])
    assert slot == [0]
    store(cache, cache_pos, torch.full((2, 1), 5.0), torch.tensor([96, 97]), qsl_of([2]), slot)
    mask = dr.window_mask(cache_pos, torch.tensor(slot), torch.tensor([98]), window)
    visible = sorted(int(cache_pos[0, c]) for c in range(window) if mask[0, c])
    assert visible == [96, 97]
    assert (cache[0][mask[0]] == 5.0).all()


def test_slot_table_full_and_bad_input():
    table = rings.SlotTable(2)
    table.assign(["a", "b"])
    with pytest.raises(rings.SlotTableFullError, match="full"):
        table.assign(["a", "c"])
    assert sorted(table.held_ids) == ["a", "b"]  # all-or-nothing: "c" got no row
    with pytest.raises(ValueError, match="distinct"):
        table.assign(["a", "a"])
    assert table.release(["never-seen"]) == []
    for bad in (0, True, 2.0, "3"):  # a bool or float row count is refused, not truncated
        with pytest.raises(ValueError, match=rf"^num_slots must be an int >= 1, got {bad!r}$"):
            rings.SlotTable(bad)


def test_clear_slots():
    cache_pos = torch.arange(12).view(3, 4)
    rings.clear_slots(cache_pos, [0, 2])
    assert cache_pos.tolist() == [[-1] * 4, [4, 5, 6, 7], [-1] * 4]


# ---------------------------------------------------------------------------
# Which cells a store writes (mutation testing: a duplicate write is invisible on CPU)
# ---------------------------------------------------------------------------


class _RecordIndexPut(torch.overrides.TorchFunctionMode):
    """Records the index tuples of every in-place ``index_put_`` (the store's scatters)."""

    def __init__(self):
        super().__init__()
        self.indices = []
        self.dtypes = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.index_put_:
            self.indices.append(tuple(i.clone() for i in args[1]))
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


def reference_cells(positions, qsl, slots, window, num_rejected):
    """(ring row, cell) per row the contract writes, in Python ints (one entry per row)."""
    cells = []
    for r in range(len(qsl) - 1):
        start, end = int(qsl[r]), int(qsl[r + 1]) - int(num_rejected[r])
        if end <= start:
            continue
        last = int(positions[end - 1])
        cells += [
            (int(slots[r]), int(positions[row]) % window)
            for row in range(start, end)
            if int(positions[row]) > last - window
        ]
    return cells


@pytest.mark.parametrize(
    "lengths, positions, rejected",
    [
        # The case: positions 10, 11, 12, 14 with W=4; 10 is out (14 - 4), and a
        # loosened bound (>=) would write 10 and 14 into the same cell. Ragged batch.
        ([4, 2], [10, 11, 12, 14, 3, 4], [0, 0]),
        # Same gap on a uniform batch (flat path), one request with a rejected suffix.
        ([4, 4], [10, 11, 12, 14, 20, 22, 23, 24, 99], [0, 1]),
        # Prefill chunk longer than W beside verify rows with rejections.
        ([9, 3, 1], [*range(30, 39), 7, 9, 10, 5], [0, 2, 0]),
    ],
)
def test_store_writes_each_reference_cell_exactly_once(lengths, positions, rejected):
    """The live (ring row, cell) pairs written are unique and equal the contract's set.

    On CPU the last duplicate write wins, so the final cache can look right while a GPU
    (nondeterministic duplicate ``index_put_``) would keep either row.
    """
    window, num_slots = 4, 5
    positions = torch.tensor(positions[: sum(lengths)])
    qsl, slots = qsl_of(lengths), torch.tensor([3, 0, 4][: len(lengths)])
    gen = torch.Generator().manual_seed(0)
    cache, cache_pos = make_cache(num_slots, window, 2, torch.float32, gen)
    kv = torch.randn(positions.numel(), 2, generator=gen)
    with _RecordIndexPut() as seen:
        store(cache, cache_pos, kv, positions, qsl, slots, rejected)
    want = reference_cells(positions, qsl, slots, window, rejected)
    assert len(want) == len(set(want))  # the contract itself never writes a cell twice
    assert len(seen.indices) == 2  # one scatter for the values, one for the positions
    for ring, cell in seen.indices:
        live = [(int(a), int(b)) for a, b in zip(ring, cell, strict=True) if int(a) != num_slots]
        assert sorted(live) == sorted(want)


def test_plan_is_frozen():
    """The plan is built once on the host and replayed by the device work: no field changes."""
    plan = _plan([0, 3, 5])
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.window = 4


@pytest.mark.parametrize(
    "qsl, first_bad",
    [
        ([0, 4, 9, 7], 2),  # request 2 goes backwards
        ([0, 0, 4, 3], 0),  # request 0 is empty (every request keeps its anchor row)
        ([0, 1, 1, 3], 1),  # request 0 has exactly one row, request 1 none
        ([0, 2, 3, 3, 3], 2),  # two empty requests: the first one is named
    ],
)
def test_bad_query_start_loc_names_the_first_request_without_a_row(qsl, first_bad):
    """The message names the first request with fewer than one row, read off the list here,
    not a request that merely has exactly one."""
    with pytest.raises(ValueError) as err:
        _plan(qsl)
    r = first_bad
    assert str(err.value).startswith(
        f"request {r} has {qsl[r + 1] - qsl[r]} rows (query_start_loc_cpu[{r + 1}] - "
        f"query_start_loc_cpu[{r}])"
    )


def test_plans_compare_by_identity():
    """Plans hold tensors, which have no boolean equality: ``==`` is identity (never a tensor
    comparison), so two plans of the same step are different objects and can be compared."""
    first, second = _plan([0, 3, 5]), _plan([0, 3, 5])
    assert first == first and first != second and len({first, second}) == 2


@pytest.mark.parametrize("qsl, slots", [([0], [])])
def test_step_without_rows_writes_nothing(qsl, slots):
    """No requests: the store plans and runs without error and leaves every cell as it was."""
    gen = torch.Generator().manual_seed(3)
    cache, cache_pos = make_cache(3, 4, 2, torch.float32, gen)
    want_c, want_p = cache.clone(), cache_pos.clone()
    empty = torch.zeros(0, dtype=torch.int64)
    store(cache, cache_pos, torch.zeros(0, 2), empty, torch.tensor(qsl), torch.tensor(slots, dtype=torch.int64))
    assert torch.equal(cache, want_c) and torch.equal(cache_pos, want_p)


def test_single_row_slot_table_serves_one_request_at_a_time():
    table = rings.SlotTable(1)
    assert table.assign(["a"]) == [0]
    with pytest.raises(rings.SlotTableFullError):
        table.assign(["a", "b"])
    assert table.release(["a"]) == [0] and table.assign(["b"]) == [0]


@pytest.mark.parametrize(
    "dim, dtype, word",
    [
        (64, torch.bfloat16, torch.complex128),  # 128-byte rows: moved as 16-byte words
        (8, torch.float32, torch.complex128),  # 32-byte rows
        (3, torch.bfloat16, torch.bfloat16),  # 6-byte rows: element by element
        (6, torch.float32, torch.float32),  # 24 bytes, not a multiple of 16
    ],
)
def test_rows_move_as_16_byte_words_when_their_size_allows(dim, dtype, word):
    """The fast copy (a row as 16-byte words, ~4x fewer index-kernel elements) is taken exactly
    when a row is a whole number of 16-byte words; the bits stored equal the reference."""
    gen = torch.Generator().manual_seed(1)
    lengths = [3, 5]
    positions = contiguous_positions([0, 40], lengths)
    cache, cache_pos = make_cache(4, 4, dim, dtype, gen)
    kv = torch.randn(positions.numel(), dim, generator=gen).to(dtype)
    with _RecordIndexPut() as seen:
        got_c, _ = run_both(cache, cache_pos, kv, positions, qsl_of(lengths), torch.tensor([2, 0]), None)
    assert seen.dtypes[0] == word  # the value scatter (the second one writes positions)


def test_step_plan_takes_the_flat_path_on_uniform_batches():
    """The step plan keeps the fast path on uniform steps, and ships no candidate list for
    it (the flat path reads none); a ragged plan has no flat segment length."""
    uniform = _plan([0, 4, 8, 12], num_slots=4)
    assert uniform.uniform and uniform.seg_len == 4
    assert uniform.cand_rows.numel() == 0 and uniform.cand_req.numel() == 0
    ragged = _plan([0, 4, 9], num_slots=4)
    assert not ragged.uniform and ragged.seg_len == 0


def test_query_start_loc_not_starting_at_zero_names_its_first_entry():
    with pytest.raises(ValueError, match=r"^query_start_loc_cpu\[0\] must be 0, got 2$"):
        _plan([2, 5, 9])


def test_allocated_rings_have_a_scratch_row_and_start_empty():
    """S live ring rows plus one scratch row that discarded rows are sent to; every cell empty."""
    cache, cache_pos = rings.allocate_rings(3, 8, 5, torch.bfloat16, "cpu")
    assert cache.shape == (4, 8, 5) and cache.dtype == torch.bfloat16 and not cache.any()
    assert cache_pos.shape == (4, 8) and cache_pos.dtype == torch.int64
    assert (cache_pos == -1).all()


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_ship_hands_back_one_int64_view_per_array_on_the_device(device):
    import numpy as np

    shipped = dr.ship({"a": np.array([1, 2], dtype=np.int32), "b": np.array([7])}, device)
    assert list(shipped) == ["a", "b"]
    assert all(t.device.type == device and t.dtype == torch.int64 for t in shipped.values())
    assert [tuple(t.shape) for t in shipped.values()] == [(2,), (1,)]
    if device == "cpu":
        assert shipped["a"].tolist() == [1, 2] and shipped["b"].tolist() == [7]
