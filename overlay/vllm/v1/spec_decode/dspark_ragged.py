"""Ragged DSpark context path: per-request sliding-window KV without padding.

Under continuous batching one engine step packs rows from many requests: prefill chunks
of any length and verify rows (anchor + drafts) of which a suffix was rejected. Each
DSpark draft layer keeps, per request, a ring of the last ``W`` context positions
(``cache[slot, pos % W]``). This module turns one packed step into a single scatter
into those rings (one ``index_put_`` on the KV cache, one on its position table),
without a Python loop over requests and without padding the step to a rectangle.

Layout of one step (all tensors on the same device):

- ``query_start_loc`` ``[R+1]``: request ``r`` owns packed rows ``[qsl[r], qsl[r+1])``.
- ``num_rejected`` ``[R]``: the last ``rej[r]`` rows of request ``r`` were rejected by
  the target; its accepted rows are ``[qsl[r], qsl[r+1] - rej[r])``.
- ``slots`` ``[R]``: the ring row of each request, from :class:`SlotTable`. KV is keyed
  by request id, never by batch row, so vLLM may reorder or condense the batch.

Pure torch + stdlib on purpose: it is unit-tested without vLLM and the same ops run on
CPU and GPU.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "SlotTable",
    "anchor_rows",
    "clear_slots",
    "is_ragged",
    "segment_lengths",
    "store_context_kv",
    "window_mask",
]

EMPTY_POS = -1
"""``cache_pos`` value of a cell that holds no context."""


# ---------------------------------------------------------------------------
# Validation helpers. Every public function checks its inputs before touching any
# tensor, so a bad call raises ValueError and leaves the caches byte-identical.
# Value checks are reduced to a few scalars copied to the host together: one sync
# per call, however many requests or checks.
# ---------------------------------------------------------------------------


def _require_tensor(name: str, t: object, ndim: int, shape_doc: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape {shape_doc}, got {type(t)}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have shape {shape_doc}, got {tuple(t.shape)}")
    return t


def _require_int(name: str, t: torch.Tensor) -> None:
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")


def _require_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like the cache, got {t.device}")


def _host_scalars(**facts: torch.Tensor) -> dict[str, int]:
    """Copy several 0-d tensors to the host with a single sync."""
    values = torch.stack(list(facts.values())).tolist()
    return dict(zip(facts, values, strict=True))


def _min_max(t: torch.Tensor, empty: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``aminmax`` that also accepts an empty tensor: gives ``empty``, a passing value."""
    if t.numel() == 0:
        value = torch.full((), empty, dtype=torch.int64, device=t.device)
        return value, value
    return torch.aminmax(t)


def _check_qsl_tensor(qsl: object, device: torch.device | None = None) -> torch.Tensor:
    qsl = _require_tensor("query_start_loc", qsl, 1, "[R+1]")
    _require_int("query_start_loc", qsl)
    if qsl.numel() < 1:
        raise ValueError("query_start_loc must have R+1 >= 1 entries, got an empty tensor")
    if device is not None:
        _require_device("query_start_loc", qsl, device)
    return qsl.long()


def _check_qsl_facts(facts: dict[str, int], num_rows: int | None) -> None:
    if facts["qsl_first"] != 0:
        raise ValueError(f"query_start_loc[0] must be 0, got {facts['qsl_first']}")
    if facts["min_len"] < 0:
        raise ValueError("query_start_loc must be non-decreasing")
    if num_rows is not None and facts["qsl_last"] != num_rows:
        raise ValueError(
            f"query_start_loc[-1] must equal the number of kv rows T={num_rows}, "
            f"got {facts['qsl_last']}"
        )


def _check_rejected_tensor(num_rejected: object, num_requests: int, device) -> torch.Tensor:
    if num_rejected is None:
        return torch.zeros(num_requests, dtype=torch.int64, device=device)
    rej = _require_tensor("num_rejected", num_rejected, 1, f"[R] with R={num_requests}")
    _require_int("num_rejected", rej)
    if rej.numel() != num_requests:
        raise ValueError(
            f"num_rejected must have shape [R] with R={num_requests}, got {tuple(rej.shape)}"
        )
    _require_device("num_rejected", rej, device)
    return rej.long()


# ---------------------------------------------------------------------------
# Batch layout
# ---------------------------------------------------------------------------


def _layout_facts(qsl: torch.Tensor) -> tuple[torch.Tensor, dict[str, int]]:
    lengths = qsl[1:] - qsl[:-1]
    min_len, max_len = _min_max(lengths)
    facts = _host_scalars(qsl_first=qsl[0], min_len=min_len, max_len=max_len)
    _check_qsl_facts(facts, None)
    return lengths, facts


def segment_lengths(query_start_loc: torch.Tensor) -> torch.Tensor:
    """Rows per request, ``qsl[r+1] - qsl[r]``, as int64 ``[R]``."""
    lengths, _ = _layout_facts(_check_qsl_tensor(query_start_loc))
    return lengths


def is_ragged(query_start_loc: torch.Tensor) -> bool:
    """True when requests carry different row counts; selects the ragged path.

    Mixed prefill chunks and verify rows make a step ragged; a decode-only step where
    every request verifies the same number of drafts is uniform (flat path).
    """
    _, facts = _layout_facts(_check_qsl_tensor(query_start_loc))
    return facts["min_len"] != facts["max_len"]


def anchor_rows(
    query_start_loc: torch.Tensor, num_rejected: torch.Tensor | None = None
) -> torch.Tensor:
    """Packed row of each request's last accepted row, ``qsl[r+1] - 1 - rej[r]`` (int64).

    The draft block starts right after this row. A request with no accepted row would
    point into its neighbour, so ``num_rejected[r]`` must be smaller than its length.
    """
    qsl = _check_qsl_tensor(query_start_loc)
    num_requests = qsl.numel() - 1
    rej = _check_rejected_tensor(num_rejected, num_requests, qsl.device)
    lengths = qsl[1:] - qsl[:-1]
    min_len, _ = _min_max(lengths)
    min_rej, _ = _min_max(rej)
    min_kept, _ = _min_max(lengths - rej)
    facts = _host_scalars(qsl_first=qsl[0], min_len=min_len, min_rej=min_rej, min_kept=min_kept)
    _check_qsl_facts(facts, None)
    if facts["min_rej"] < 0:
        raise ValueError("num_rejected must be >= 0")
    if num_requests and facts["min_kept"] < 1:
        raise ValueError(
            "num_rejected[r] must be < segment length so each request keeps an accepted row"
        )
    return qsl[1:] - 1 - rej


# ---------------------------------------------------------------------------
# Store
# ---------------------------------------------------------------------------


@dataclass
class _StepLayout:
    """A validated step, as the write paths need it (int64 tensors, device of the cache)."""

    window: int
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [R]
    num_accepted: torch.Tensor  # [R] len[r] - rej[r]
    accepted_end: torch.Tensor  # [R] exclusive end row of the accepted rows
    first_candidate: torch.Tensor  # [R] rows before it are outside the window
    num_candidates: torch.Tensor  # [R] accepted rows from first_candidate on (<= W)
    total_candidates: int
    uniform: bool

    @property
    def num_requests(self) -> int:
        return self.slots.numel()


def _check_store_args(
    cache, cache_pos, kv, positions, query_start_loc, slots, num_rejected
) -> _StepLayout | None:
    """Validate everything ``store_context_kv`` needs; raise ValueError before any write.

    Returns None for an empty step (R = 0).
    """
    cache = _require_tensor("cache", cache, 3, "[S, W, D]")
    num_slots, window, dim = cache.shape
    device = cache.device
    if window < 1:
        raise ValueError(f"cache must have a window W >= 1, got shape {tuple(cache.shape)}")

    cache_pos = _require_tensor("cache_pos", cache_pos, 2, f"[S, W] = [{num_slots}, {window}]")
    if tuple(cache_pos.shape) != (num_slots, window):
        raise ValueError(
            f"cache_pos must have shape [S, W] = [{num_slots}, {window}], "
            f"got {tuple(cache_pos.shape)}"
        )
    if cache_pos.dtype != torch.int64:
        raise ValueError(f"cache_pos must be int64, got {cache_pos.dtype}")
    _require_device("cache_pos", cache_pos, device)

    kv = _require_tensor("kv", kv, 2, f"[T, D] with D={dim}")
    num_rows = kv.shape[0]
    if kv.shape[1] != dim:
        raise ValueError(f"kv must have shape [T, D] with D={dim}, got {tuple(kv.shape)}")
    if kv.dtype != cache.dtype:
        raise ValueError(f"kv must have the cache dtype {cache.dtype}, got {kv.dtype}")
    _require_device("kv", kv, device)

    positions = _require_tensor("positions", positions, 1, f"[T] with T={num_rows}")
    _require_int("positions", positions)
    if positions.numel() != num_rows:
        raise ValueError(
            f"positions must have shape [T] with T={num_rows}, got {tuple(positions.shape)}"
        )
    _require_device("positions", positions, device)
    positions = positions.long()

    qsl = _check_qsl_tensor(query_start_loc, device)
    num_requests = qsl.numel() - 1
    slots = _require_tensor("slots", slots, 1, f"[R] with R={num_requests}")
    _require_int("slots", slots)
    if slots.numel() != num_requests:
        raise ValueError(
            f"slots must have shape [R] with R={num_requests}, got {tuple(slots.shape)}"
        )
    _require_device("slots", slots, device)
    slots = slots.long()
    rej = _check_rejected_tensor(num_rejected, num_requests, device)

    if num_requests == 0:  # an empty step: nothing to write, only qsl == [0] to check
        if num_rows != 0 or int(qsl[0]) != 0:
            raise ValueError(f"query_start_loc must be [0] for an empty step with T={num_rows}")
        return None

    # Per-request layout, computed before validation but only used after it.
    q_lo, q_hi = qsl[:-1], qsl[1:]
    lengths = q_hi - q_lo
    accepted_end = q_hi - rej
    num_accepted = accepted_end - q_lo
    # Positions strictly increase, so the last W accepted rows hold every position that
    # can be in the window; earlier rows never need a look.
    num_candidates = num_accepted.clamp(0, window)
    first_candidate = accepted_end - num_candidates

    # Position steps between neighbouring rows; a step back is fine where a segment
    # starts, so those entries (and the two ends) are set to 1.
    steps = torch.ones(num_rows + 1, dtype=torch.int64, device=device)
    torch.sub(positions[1:], positions[:-1], out=steps[1:num_rows])
    steps.index_fill_(0, qsl.clamp(0, num_rows), 1)
    sorted_slots = slots.sort().values
    slot_gaps = sorted_slots[1:] - sorted_slots[:-1]

    # Fast path: two reductions cover the value checks; only a failing call pays for
    # finding out which argument is wrong.
    shortest, longest = torch.aminmax(lengths)
    facts = torch.stack(
        [
            qsl[0],
            qsl[-1],
            shortest,
            longest,
            sorted_slots[-1],
            torch.cat([lengths, rej, num_accepted, slots, positions]).amin(),  # must be >= 0
            torch.cat([steps, slot_gaps]).amin(),  # must be >= 1
            num_candidates.sum(),
        ]
    ).tolist()
    qsl_first, qsl_last, min_len, max_len, max_slot, min_nonneg, min_step, total = facts
    if min_nonneg < 0 or min_step < 1 or max_slot >= num_slots:
        _explain_store_failure(
            qsl, lengths, rej, num_accepted, slots, num_slots, positions, steps, num_rows
        )
    _check_qsl_facts({"qsl_first": qsl_first, "qsl_last": qsl_last, "min_len": 0}, num_rows)

    return _StepLayout(
        window=window,
        positions=positions,
        slots=slots,
        num_accepted=num_accepted,
        accepted_end=accepted_end,
        first_candidate=first_candidate,
        num_candidates=num_candidates,
        total_candidates=total,
        uniform=min_len == max_len,
    )


def _explain_store_failure(
    qsl, lengths, rej, num_accepted, slots, num_slots, positions, steps, num_rows
):
    """Slow path of a failed check: find the offending argument and raise for it."""
    qsl_first, qsl_last = qsl[0].item(), qsl[-1].item()
    _check_qsl_facts(
        {"qsl_first": qsl_first, "qsl_last": qsl_last, "min_len": lengths.min().item()},
        num_rows,
    )
    if slots.min().item() < 0 or slots.max().item() >= num_slots:
        raise ValueError(f"slots must be in [0, S={num_slots})")
    if slots.unique().numel() != slots.numel():
        raise ValueError("slots must be distinct (one ring row per request)")
    if rej.min().item() < 0:
        raise ValueError("num_rejected must be >= 0")
    if num_accepted.min().item() < 0:
        raise ValueError("num_rejected[r] must be <= segment length qsl[r+1] - qsl[r]")
    if positions.numel() and positions.min().item() < 0:
        raise ValueError("positions must be >= 0")
    if steps.min().item() < 1:
        raise ValueError("positions must be strictly increasing within each request's segment")
    raise AssertionError("a store check failed without a matching explanation")


def _flat_write_rows(step: _StepLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uniform batch: view the step as ``[R, L]`` and mask with broadcasting.

    Returns the packed rows to write, their ring rows and positions. Request data
    broadcasts along the columns, so nothing is gathered per row.
    """
    num_requests = step.num_requests
    seg_len = step.positions.numel() // num_requests
    pos = step.positions.view(num_requests, seg_len)
    accepted = step.num_accepted[:, None]  # [R, 1]
    last_pos = pos.gather(1, (accepted - 1).clamp_(min=0))  # [R, 1]
    col = torch.arange(seg_len, device=pos.device)
    keep = (col < accepted) & (pos > last_pos - step.window)
    rows = keep.view(-1).nonzero().squeeze(1)
    ring_rows = step.slots.index_select(0, rows // seg_len)
    return rows, ring_rows, step.positions.index_select(0, rows)


def _ragged_write_rows(step: _StepLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Heterogeneous batch: enumerate each request's candidate rows, then mask.

    A request contributes at most W candidate rows (its last W accepted rows), so the
    work scales with the rows written, not with T, and no ``[R, max_len]`` padding is
    ever allocated.
    """
    device = step.positions.device
    counts, total = step.num_candidates, step.total_candidates
    req = torch.repeat_interleave(
        torch.arange(step.num_requests, device=device), counts, output_size=total
    )
    # Ragged arange: candidate k of request r is packed row first_candidate[r] + k.
    shift = step.first_candidate - (counts.cumsum(0) - counts)
    rows = torch.arange(total, device=device).add_(shift.index_select(0, req))
    pos = step.positions.index_select(0, rows)
    last_pos = step.positions.index_select(0, (step.accepted_end - 1).clamp_(min=0))
    # All True unless positions have gaps: then older candidates fall out of the window.
    keep = (pos > last_pos.sub_(step.window).index_select(0, req)).nonzero().squeeze(1)
    ring_rows = step.slots.index_select(0, req.index_select(0, keep))
    return rows.index_select(0, keep), ring_rows, pos.index_select(0, keep)


def store_context_kv(
    cache: torch.Tensor,
    cache_pos: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    slots: torch.Tensor,
    num_rejected: torch.Tensor | None = None,
) -> None:
    """Write one step's accepted context rows into each request's KV ring, in place.

    For request ``r`` (ring row ``slots[r]``) let ``last`` be the position of its last
    accepted row. Exactly the accepted rows with ``position > last - W`` are written:
    ``cache[slots[r], pos % W] = kv[row]`` and ``cache_pos[slots[r], pos % W] = pos``.
    Rejected rows are never written: their cell ``pos % W`` may still hold live context
    of the next window. Older rows would be overwritten in the same call anyway, and
    skipping them keeps the scatter free of duplicate indices (deterministic).

    Shapes: ``cache [S, W, D]``, ``cache_pos [S, W]`` int64 (-1 = empty), ``kv [T, D]``
    (same dtype as ``cache``), ``positions [T]`` (>= 0, strictly increasing within a
    request), ``query_start_loc [R+1]``, ``slots [R]`` (distinct, in ``[0, S)``),
    ``num_rejected [R]`` with ``0 <= rej[r] <= len[r]`` (None = nothing rejected).

    Uniform batches take the flat ``[R, L]`` path, ragged ones the candidate-row path;
    both end in the same single scatter. Host syncs: one for validation, one to compact
    the rows to write, independent of R. Invalid input raises ValueError before any write.
    """
    step = _check_store_args(cache, cache_pos, kv, positions, query_start_loc, slots, num_rejected)
    if step is None or step.total_candidates == 0:
        return
    rows, ring_rows, pos = (_flat_write_rows if step.uniform else _ragged_write_rows)(step)
    # The one scatter: (ring row, pos % W) pairs are unique, so the write is deterministic.
    cells = (ring_rows, pos % step.window)
    dst, src = _as_wide_words(cache, kv)
    dst.index_put_(cells, src.index_select(0, rows))
    cache_pos.index_put_(cells, pos)


def _as_wide_words(cache: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """View both tensors' rows as 16-byte words when both layouts allow, else as they are.

    Index kernels copy element by element, so moving a 1 KiB bf16 row as 64 words
    instead of 512 elements is ~4x faster on CPU. Only bits are copied, never values
    computed, so the result is byte-identical.
    """
    if cache.dtype.itemsize >= 16 or (cache.shape[-1] * cache.dtype.itemsize) % 16:
        return cache, kv
    try:
        return cache.view(torch.complex128), kv.view(torch.complex128)
    except RuntimeError:  # a last dim not contiguous, or a storage offset not aligned
        return cache, kv


# ---------------------------------------------------------------------------
# Read side
# ---------------------------------------------------------------------------


def _check_slot_range(slots: torch.Tensor, num_slots: int) -> None:
    min_slot, max_slot = _min_max(slots)
    facts = _host_scalars(min_slot=min_slot, max_slot=max_slot)
    if slots.numel() and not (0 <= facts["min_slot"] and facts["max_slot"] < num_slots):
        raise ValueError(f"slots must be in [0, S={num_slots})")


def window_mask(
    cache_pos: torch.Tensor,
    slots: torch.Tensor,
    anchor_positions: torch.Tensor,
    W: int,  # noqa: N803 - the paper's name for the window
) -> torch.Tensor:
    """Bool ``[R, W]``: which ring cells the draft block of request ``r`` may attend.

    A cell is valid iff ``anchor - W <= cache_pos < anchor`` and ``cache_pos >= 0``;
    ``W`` may be smaller than the ring width, never larger.
    Checking the stored position (not just "cell was written") is what keeps stale
    cells from a released slot, a prefix-cache hole or a preempted request out of the
    draft attention.
    """
    cache_pos = _require_tensor("cache_pos", cache_pos, 2, "[S, W]")
    if cache_pos.dtype != torch.int64:
        raise ValueError(f"cache_pos must be int64, got {cache_pos.dtype}")
    num_slots, ring = cache_pos.shape
    if isinstance(W, bool) or not isinstance(W, int) or not 1 <= W <= ring:
        raise ValueError(f"W must be an int in [1, ring width {ring}], got {W!r}")
    slots = _require_tensor("slots", slots, 1, "[R]")
    _require_int("slots", slots)
    _require_device("slots", slots, cache_pos.device)
    anchor = _require_tensor("anchor_positions", anchor_positions, 1, f"[R] with R={slots.numel()}")
    _require_int("anchor_positions", anchor)
    if anchor.numel() != slots.numel():
        raise ValueError(
            f"anchor_positions must have shape [R] with R={slots.numel()}, "
            f"got {tuple(anchor.shape)}"
        )
    _require_device("anchor_positions", anchor, cache_pos.device)
    _check_slot_range(slots.long(), num_slots)
    held = cache_pos[slots.long()]  # [R, ring]
    anchor = anchor.long()[:, None]
    return (held >= 0) & (held >= anchor - W) & (held < anchor)


def clear_slots(cache_pos: torch.Tensor, slots: torch.Tensor | Sequence[int]) -> None:
    """Mark ring rows empty (``cache_pos = -1``) so a reused row exposes no old context."""
    cache_pos = _require_tensor("cache_pos", cache_pos, 2, "[S, W]")
    if cache_pos.dtype != torch.int64:
        raise ValueError(f"cache_pos must be int64, got {cache_pos.dtype}")
    idx = torch.as_tensor(slots, dtype=torch.int64, device=cache_pos.device).reshape(-1)
    num_slots = cache_pos.shape[0]
    _check_slot_range(idx, num_slots)
    cache_pos[idx] = EMPTY_POS


# ---------------------------------------------------------------------------
# Request id -> ring row
# ---------------------------------------------------------------------------


class SlotTableFullError(RuntimeError):
    """More live requests than ring rows; raise max_num_seqs or the table size."""


class SlotTable:
    """Stable ring row per request id.

    vLLM reorders and condenses its persistent batch when requests finish, so the batch
    row of a request changes between steps. Keying the KV ring by request id keeps each
    request's context with it. New ids get the lowest free row (a lone request stays on
    row 0). Host-side bookkeeping only: a dict lookup per request id.
    """

    def __init__(self, num_slots: int, device: torch.device | str = "cpu") -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        self.num_slots = num_slots
        self.device = torch.device(device)
        self._slot_of: dict[Hashable, int] = {}
        self._free: list[int] = list(range(num_slots))  # heap: lowest free row first

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, req_id: Hashable) -> bool:
        return req_id in self._slot_of

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot_of(self, req_id: Hashable) -> int | None:
        """Ring row held by ``req_id``, or None."""
        return self._slot_of.get(req_id)

    def assign(self, req_ids: Sequence[Hashable]) -> torch.Tensor:
        """Ring row per batch row (int64 ``[R]``); known ids keep theirs, new ids get one.

        All-or-nothing: if the new ids do not fit, nothing is assigned.
        """
        req_ids = list(req_ids)
        if len(set(req_ids)) != len(req_ids):
            raise ValueError("req_ids must be distinct (one batch row per request)")
        new_ids = [r for r in req_ids if r not in self._slot_of]
        if len(new_ids) > len(self._free):
            raise SlotTableFullError(
                f"SlotTable is full: {len(new_ids)} new requests, {len(self._free)} free of "
                f"{self.num_slots} rows; release finished requests or size the table to "
                "max_num_seqs"
            )
        for req_id in new_ids:
            self._slot_of[req_id] = heapq.heappop(self._free)
        return torch.tensor(
            [self._slot_of[r] for r in req_ids], dtype=torch.int64, device=self.device
        )

    def release(
        self,
        req_id: Hashable,
        cache_pos: torch.Tensor | Iterable[torch.Tensor] | None = None,
    ) -> int | None:
        """Free the row of a finished request and mark it empty in ``cache_pos``.

        Pass every draft layer's ``cache_pos`` (one tensor or several) so a later owner
        of the row cannot attend this request's context. Returns the freed row, or
        None when the id held none (it may have finished before it was ever drafted).
        """
        slot = self._slot_of.get(req_id)
        if slot is None:
            return None
        if cache_pos is not None:
            tables = [cache_pos] if isinstance(cache_pos, torch.Tensor) else list(cache_pos)
            for table in tables:  # validate all before clearing any
                _require_tensor("cache_pos", table, 2, "[S, W]")
                if table.shape[0] != self.num_slots or table.dtype != torch.int64:
                    raise ValueError(
                        f"cache_pos must be int64 [S, W] with S={self.num_slots}, got "
                        f"{table.dtype} {tuple(table.shape)}"
                    )
            for table in tables:
                table[slot] = EMPTY_POS
        del self._slot_of[req_id]
        heapq.heappush(self._free, slot)
        return slot
