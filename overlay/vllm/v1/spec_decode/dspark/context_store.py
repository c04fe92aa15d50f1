"""DSpark context store: one engine step's rows into the per-request KV rings, no padding.

Under continuous batching one engine step packs rows from many requests: prefill chunks
of any length and verify rows (anchor + drafts) of which a suffix was rejected. Each
DSpark draft layer keeps, per request, a ring of the last ``W`` context positions
(``cache[slot, pos % W]``, see :mod:`.rings`). This module turns one packed step into a single scatter
into those rings, without a Python loop over requests and without padding the step.

Plan once, run sync-free (as FlashInfer splits ``plan()`` from ``run()``):

- :func:`store_layout` turns one step's host metadata, already checked by
  ``step_plan.plan_step`` (the one place a step is validated), into the store's host
  numbers and index arrays. It fixes which packed rows the store looks at (each
  request's last ``W + max_rejected`` rows); the step plan ships them to the device with
  its own arrays in one copy and keeps the frozen :class:`StorePlan`.
- :func:`store_context_kv` and :func:`window_mask` trust the plan:
  no validation, no host read of device data, shapes fixed by the plan. The actual
  rejection counts stay on the device; candidate rows they drop are written to the
  scratch ring row ``S`` (rings have ``S + 1`` rows), which nothing ever reads.

Pure torch + numpy + stdlib on purpose: unit-tested without vLLM, same ops on CPU and GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

__all__ = [
    "AcceptedRows",
    "StorePlan",
    "is_flat_step",
    "last_accepted",
    "ship",
    "store_context_kv",
    "store_layout",
    "window_mask",
]


def ship(arrays: dict[str, np.ndarray], device: torch.device | str) -> dict[str, torch.Tensor]:
    """Host int arrays -> int64 device tensors with one (non-blocking) copy.

    The arrays are packed into one buffer (pinned when the device is a GPU, so the copy
    is asynchronous) and handed back as views of its device copy.
    """
    device = torch.device(device)
    sizes = [a.size for a in arrays.values()]
    packed = np.concatenate([a.reshape(-1).astype(np.int64, copy=False) for a in arrays.values()])
    host = torch.from_numpy(packed)
    if device.type == "cuda":
        host = host.pin_memory()
    on_device = host if device.type == "cpu" else host.to(device, non_blocking=True)
    return dict(zip(arrays, on_device.split(sizes), strict=True))


# ---------------------------------------------------------------------------
# Host layout (the step plan has checked its inputs)
# ---------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class StorePlan:
    """Where one step's context rows may go; host numbers plus device index tensors.

    The store looks at each request's last ``W + max_rejected[r]`` rows (its
    candidates): whatever the device-side rejection counts turn out to be, the last W
    accepted rows are among them. ``eq=False``: tensor fields have no boolean equality.
    """

    num_requests: int  # R
    num_rows: int  # T, packed rows of the step
    window: int  # W
    num_slots: int  # S live ring rows; row S of every ring is scratch
    uniform: bool  # every request has the same row count: flat path
    seg_len: int  # rows per request on the flat path (0 when ragged)
    num_candidates: int  # M, rows the store looks at
    max_rejected_rows: int  # sum of the rejection bounds
    slots: torch.Tensor  # [R] ring row per request, device
    seg_end: torch.Tensor  # [R] qsl[r+1], device
    cand_rows: torch.Tensor  # [M] packed row of each candidate (ragged path), device
    cand_req: torch.Tensor  # [M] request of each candidate (ragged path), device


def is_flat_step(lengths: np.ndarray) -> bool:
    """Every request has the same number of rows: the step is an ``[R, L]`` rectangle."""
    return lengths.size > 0 and lengths.min() == lengths.max()


def store_layout(
    qsl: np.ndarray, lengths: np.ndarray, slots: np.ndarray, bound: np.ndarray,
    window: int, num_slots: int,
) -> tuple[dict[str, np.ndarray], dict[str, int | bool]]:
    """Host index arrays and numbers of a store plan, from checked int64 host metadata.

    ``qsl [R+1]`` and ``lengths [R]`` the step's layout, ``slots [R]`` distinct ring rows,
    ``bound [R]`` the most rows each request may reject. The step plan ships the arrays
    with its own in one copy and builds the :class:`StorePlan` from both.
    """
    num_requests = lengths.size
    uniform = is_flat_step(lengths)
    counts = np.minimum(lengths, window + bound)
    if uniform:
        seg_len = int(lengths[0])
        num_candidates = num_requests * int(counts.max())
        cand_rows = cand_req = np.zeros(0, dtype=np.int64)
    else:
        seg_len = 0
        num_candidates = int(counts.sum())
        cand_req = np.repeat(np.arange(num_requests), counts)
        # Ragged arange: candidate k of request r is packed row qsl[r+1] - counts[r] + k.
        shift = qsl[1:] - counts - (np.cumsum(counts) - counts)
        cand_rows = np.arange(num_candidates) + shift[cand_req]
    plan = {
        "num_requests": num_requests,
        "num_rows": int(qsl[-1]),
        "window": window,
        "num_slots": num_slots,
        "uniform": bool(uniform),
        "seg_len": seg_len,
        "num_candidates": num_candidates,
        "max_rejected_rows": int(bound.sum()),
    }
    arrays = {"slots": slots, "seg_end": qsl[1:], "cand_rows": cand_rows, "cand_req": cand_req}
    return arrays, plan


# ---------------------------------------------------------------------------
# Device work: trusts the plan
# ---------------------------------------------------------------------------


def _flat_candidates(plan: StorePlan, positions, acc_end, last_pos):
    """Uniform batch: the candidates are the last ``c`` columns of an ``[R, L]`` view."""
    num_requests, seg_len = plan.num_requests, plan.seg_len
    cols = plan.num_candidates // num_requests
    first = seg_len - cols
    rows = torch.arange(first, seg_len, device=positions.device) + (
        plan.seg_end[:, None] - seg_len
    )  # [R, c]
    pos = positions.view(num_requests, seg_len)[:, first:]
    keep = (rows < acc_end[:, None]) & (pos > last_pos[:, None] - plan.window)
    ring = torch.where(keep, plan.slots[:, None], plan.num_slots)
    return rows.view(-1), ring.view(-1), pos.reshape(-1)


def _ragged_candidates(plan: StorePlan, positions, acc_end, last_pos):
    """Heterogeneous batch: candidates listed by the plan, at most W + bound per request."""
    req = plan.cand_req
    pos = positions.index_select(0, plan.cand_rows)
    keep = (plan.cand_rows < acc_end.index_select(0, req)) & (
        pos > last_pos.index_select(0, req) - plan.window
    )
    ring = torch.where(keep, plan.slots.index_select(0, req), plan.num_slots)
    return plan.cand_rows, ring, pos


class AcceptedRows(NamedTuple):
    """Per request: one past its last accepted packed row, and that row's position."""

    end: torch.Tensor  # [R] qsl[r+1] - num_rejected[r]
    last_pos: torch.Tensor  # [R] position of row end - 1 (every request keeps its anchor)


def last_accepted(
    plan: StorePlan, positions: torch.Tensor, num_rejected: torch.Tensor
) -> AcceptedRows:
    """Where each request's accepted rows end: the store and the draft anchors both need it."""
    end = plan.seg_end - num_rejected
    return AcceptedRows(end, positions.index_select(0, end - 1))


def store_context_kv(
    cache: torch.Tensor,
    cache_pos: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    plan: StorePlan,
    accepted: AcceptedRows,
) -> None:
    """Write one step's accepted context rows into each request's KV ring, in place.

    For request ``r`` (ring row ``slots[r]``) let ``last`` be the position of its last
    accepted row. Exactly the accepted rows with ``position > last - W`` are written:
    ``cache[slots[r], pos % W] = kv[row]`` and ``cache_pos[slots[r], pos % W] = pos``.
    Rejected rows never reach a live row: their cell may still hold live context.

    ``cache [S+1, W, D]``, ``cache_pos [S+1, W]`` int64, ``kv [T, D]`` (cache dtype),
    ``positions [T]`` int64 strictly increasing within a request, ``accepted`` the
    step's :func:`last_accepted` (its rejection counts, on the device, at most the plan's
    bounds). Uniform steps take the flat ``[R, L]`` path, ragged ones the plan's candidate
    list; both end in the same scatter. No host read; the shapes depend on the plan only.
    """
    acc_end, last_pos = accepted
    candidates = _flat_candidates if plan.uniform else _ragged_candidates
    rows, ring, pos = candidates(plan, positions, acc_end, last_pos)
    # Kept (ring row, pos % W) pairs are unique, so the live writes are deterministic.
    cells = (ring, pos.remainder(plan.window))
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
    draft attention. An anchor of 0 attends nothing (padded draft rows use it).
    """
    held = cache_pos.index_select(0, slots)  # [R, W]
    anchor = anchor_positions[:, None]
    return (held >= (anchor - W).clamp(min=0)) & (held < anchor)
