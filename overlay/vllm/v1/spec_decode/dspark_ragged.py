"""Ragged DSpark context path: per-request sliding-window KV without padding.

Under continuous batching one engine step packs rows from many requests: prefill chunks
of any length and verify rows (anchor + drafts) of which a suffix was rejected. Each
DSpark draft layer keeps, per request, a ring of the last ``W`` context positions
(``cache[slot, pos % W]``). This module turns one packed step into a single scatter
into those rings, without a Python loop over requests and without padding the step to
a rectangle.

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


def _raise_first_failure(checks: list[tuple[str, torch.Tensor]]) -> None:
    """Evaluate all value checks with one host sync, then raise for the first failure."""
    if not checks:
        return
    ok = torch.stack([c.reshape(()) for _, c in checks]).tolist()
    for (message, _), passed in zip(checks, ok, strict=True):
        if not passed:
            raise ValueError(message)


def _qsl_checks(qsl: torch.Tensor, num_rows: int | None) -> list[tuple[str, torch.Tensor]]:
    """Value checks on query_start_loc (shape and dtype are checked by the caller)."""
    checks = [
        ("query_start_loc[0] must be 0", qsl[0] == 0),
        (
            "query_start_loc must be non-decreasing",
            (qsl[1:] >= qsl[:-1]).all(),
        ),
    ]
    if num_rows is not None:
        checks.append(
            (
                f"query_start_loc[-1] must equal the number of kv rows T={num_rows}",
                qsl[-1] == num_rows,
            )
        )
    return checks


def _check_qsl(query_start_loc: object) -> torch.Tensor:
    qsl = _require_tensor("query_start_loc", query_start_loc, 1, "[R+1]")
    _require_int("query_start_loc", qsl)
    if qsl.numel() < 1:
        raise ValueError("query_start_loc must have R+1 >= 1 entries, got an empty tensor")
    _raise_first_failure(_qsl_checks(qsl, None))
    return qsl


def _rejected_or_zeros(
    num_rejected: object, num_requests: int, device: torch.device
) -> torch.Tensor:
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


def segment_lengths(query_start_loc: torch.Tensor) -> torch.Tensor:
    """Rows per request, ``qsl[r+1] - qsl[r]``, as int64 ``[R]``."""
    qsl = _check_qsl(query_start_loc)
    return (qsl[1:] - qsl[:-1]).long()


def is_ragged(query_start_loc: torch.Tensor) -> bool:
    """True when requests carry different row counts; selects the ragged path.

    Mixed prefill chunks and verify rows make a step ragged; a decode-only step where
    every request verifies the same number of drafts is uniform (flat path).
    """
    lengths = segment_lengths(query_start_loc)
    if lengths.numel() <= 1:
        return False
    return bool((lengths != lengths[0]).any())


def anchor_rows(
    query_start_loc: torch.Tensor, num_rejected: torch.Tensor | None = None
) -> torch.Tensor:
    """Packed row of each request's last accepted row, ``qsl[r+1] - 1 - rej[r]`` (int64).

    The draft block starts right after this row. A request with no accepted row would
    point into its neighbour, so ``num_rejected[r]`` must be smaller than its length.
    """
    qsl = _check_qsl(query_start_loc)
    num_requests = qsl.numel() - 1
    rej = _rejected_or_zeros(num_rejected, num_requests, qsl.device)
    lengths = (qsl[1:] - qsl[:-1]).long()
    _raise_first_failure(
        [
            ("num_rejected must be >= 0", (rej >= 0).all()),
            (
                "num_rejected[r] must be < segment length so each request keeps an accepted row",
                (rej < lengths).all(),
            ),
        ]
    )
    return qsl[1:].long() - 1 - rej


# ---------------------------------------------------------------------------
# Store
# ---------------------------------------------------------------------------


def _flat_write_rows(
    positions: torch.Tensor,
    num_requests: int,
    seg_len: int,
    rej: torch.Tensor,
    slots: torch.Tensor,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform batch: view the step as ``[R, L]`` and mask with broadcasting.

    Returns the packed rows to write and their ring slot. No per-row gathers of
    request data are needed because every request owns exactly ``L`` rows.
    """
    pos = positions.view(num_requests, seg_len)
    accepted_len = seg_len - rej  # [R]
    last_col = (accepted_len - 1).clamp(min=0)
    last_pos = pos.gather(1, last_col[:, None])  # [R, 1]
    col = torch.arange(seg_len, device=pos.device)
    keep = (col[None, :] < accepted_len[:, None]) & (pos > last_pos - window)
    req, col_idx = keep.nonzero(as_tuple=True)
    return req * seg_len + col_idx, slots[req]


def _ragged_write_rows(
    positions: torch.Tensor,
    qsl: torch.Tensor,
    lengths: torch.Tensor,
    rej: torch.Tensor,
    slots: torch.Tensor,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Heterogeneous batch: tag each packed row with its request, mask, compact.

    Every temporary is sized by T (rows) or R (requests), never ``R * max_len``,
    so no padding is allocated.
    """
    num_rows = positions.numel()
    num_requests = lengths.numel()
    req_of_row = torch.repeat_interleave(
        torch.arange(num_requests, device=positions.device), lengths, output_size=num_rows
    )
    accepted_end = qsl[1:].long() - rej  # [R], exclusive end of accepted rows
    last_row = (accepted_end - 1).clamp(min=0)  # only read where a row was accepted
    last_pos = positions[last_row]  # [R]
    row = torch.arange(num_rows, device=positions.device)
    keep = (row < accepted_end[req_of_row]) & (positions > last_pos[req_of_row] - window)
    rows = keep.nonzero(as_tuple=True)[0]
    return rows, slots[req_of_row[rows]]


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

    Uniform batches take the flat ``[R, L]`` path, ragged ones the per-row path; both
    end in the same single scatter. Host syncs: one for validation, one to compact the
    rows to write, independent of R. Invalid input raises ValueError before any write.
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

    qsl = _require_tensor("query_start_loc", query_start_loc, 1, "[R+1]")
    _require_int("query_start_loc", qsl)
    if qsl.numel() < 1:
        raise ValueError("query_start_loc must have R+1 >= 1 entries, got an empty tensor")
    _require_device("query_start_loc", qsl, device)
    num_requests = qsl.numel() - 1

    slots = _require_tensor("slots", slots, 1, f"[R] with R={num_requests}")
    _require_int("slots", slots)
    if slots.numel() != num_requests:
        raise ValueError(
            f"slots must have shape [R] with R={num_requests}, got {tuple(slots.shape)}"
        )
    _require_device("slots", slots, device)
    rej = _rejected_or_zeros(num_rejected, num_requests, device)

    # Value checks and the flat/ragged decision, evaluated with one host sync.
    positions = positions.long()
    slots = slots.long()
    qsl = qsl.long()
    lengths = qsl[1:] - qsl[:-1]
    sorted_slots = slots.sort().values
    # Row t > 0 continues its predecessor's segment unless some segment starts at t.
    continues = ~torch.isin(torch.arange(1, num_rows, device=device), qsl)
    checks = _qsl_checks(qsl, num_rows) + [
        (f"slots must be in [0, S={num_slots})", ((slots >= 0) & (slots < num_slots)).all()),
        (
            "slots must be distinct (one ring row per request)",
            (sorted_slots[1:] != sorted_slots[:-1]).all(),
        ),
        ("num_rejected must be >= 0", (rej >= 0).all()),
        (
            "num_rejected[r] must be <= segment length qsl[r+1] - qsl[r]",
            (rej <= lengths).all(),
        ),
        ("positions must be >= 0", (positions >= 0).all()),
        (
            "positions must be strictly increasing within each request's segment",
            (positions[1:] > positions[:-1])[continues].all(),
        ),
    ]
    uniform = (lengths == lengths[:1]).all()
    flags = torch.stack([c.reshape(()) for _, c in checks] + [uniform]).tolist()
    for (message, _), passed in zip(checks, flags[:-1], strict=True):
        if not passed:
            raise ValueError(message)
    if num_rows == 0 or num_requests == 0:
        return

    if flags[-1]:
        rows, ring_rows = _flat_write_rows(
            positions, num_requests, num_rows // num_requests, rej, slots, window
        )
    else:
        rows, ring_rows = _ragged_write_rows(positions, qsl, lengths, rej, slots, window)

    # The one scatter: (ring row, pos % W) pairs are unique, so the write is deterministic.
    pos = positions[rows]
    cells = (ring_rows, pos % window)
    cache.index_put_(cells, kv[rows])
    cache_pos.index_put_(cells, pos)


# ---------------------------------------------------------------------------
# Read side
# ---------------------------------------------------------------------------


def window_mask(
    cache_pos: torch.Tensor,
    slots: torch.Tensor,
    anchor_positions: torch.Tensor,
    W: int,  # noqa: N803 - the paper's name for the window
) -> torch.Tensor:
    """Bool ``[R, W]``: which ring cells the draft block of request ``r`` may attend.

    A cell is valid iff ``anchor - W <= cache_pos < anchor`` and ``cache_pos >= 0``.
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
    _raise_first_failure(
        [(f"slots must be in [0, S={num_slots})", ((slots >= 0) & (slots < num_slots)).all())]
    )
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
    _raise_first_failure(
        [(f"slots must be in [0, S={num_slots})", ((idx >= 0) & (idx < num_slots)).all())]
    )
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
