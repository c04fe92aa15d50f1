"""DSpark context store: one engine step's rows into the per-request KV rings, no padding.

One scatter per step, no loop over requests (overlay/README.md, "Context path").
:func:`store_layout` turns the host metadata ``step_plan.plan_step`` checked into index arrays
(each request's last ``W + max_rejected`` rows are its candidates); :func:`store_context_kv` and
:func:`window_mask` trust them: no host read, shapes fixed by the plan. The rejection counts stay
on the device; candidates they drop land in scratch ring row ``S``, which nothing reads.
Pure torch + numpy + stdlib: unit-tested without vLLM, same ops on CPU and GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

__all__ = ["AcceptedRows", "StorePlan", "is_flat_step", "last_accepted", "ship",
           "store_context_kv", "store_layout", "window_mask"]


def ship(arrays: dict[str, np.ndarray], device: torch.device | str) -> dict[str, torch.Tensor]:
    """Host int arrays -> int64 device tensors: views of one packed buffer, copied once
    (pinned on a GPU, so the copy is asynchronous)."""
    device = torch.device(device)
    sizes = [a.size for a in arrays.values()]
    packed = np.concatenate([a.reshape(-1).astype(np.int64, copy=False) for a in arrays.values()])
    host = torch.from_numpy(packed)
    if device.type == "cuda":
        host = host.pin_memory()
    on_device = host if device.type == "cpu" else host.to(device, non_blocking=True)
    return dict(zip(arrays, on_device.split(sizes), strict=True))


@dataclass(frozen=True, eq=False)
class StorePlan:
    """Where one step's context rows may go: host numbers plus device index tensors. Whatever
    the device-side rejection counts, each request's last W accepted rows are among its
    candidates. ``eq=False``: tensor fields have no boolean equality."""

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
    """Host index arrays and numbers of a :class:`StorePlan` from checked int64 metadata;
    ``bound [R]``: the most rows each request may reject."""
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
    plan = dict(num_requests=num_requests, num_rows=int(qsl[-1]), window=window,
                num_slots=num_slots, uniform=bool(uniform), seg_len=seg_len,
                num_candidates=num_candidates, max_rejected_rows=int(bound.sum()))
    arrays = {"slots": slots, "seg_end": qsl[1:], "cand_rows": cand_rows, "cand_req": cand_req}
    return arrays, plan


def _flat_candidates(plan: StorePlan, positions, acc_end, last_pos):
    """Uniform batch: the candidates are the last ``c`` columns of an ``[R, L]`` view."""
    num_requests, seg_len = plan.num_requests, plan.seg_len
    first = seg_len - plan.num_candidates // num_requests  # the last c columns
    starts = plan.seg_end[:, None] - seg_len  # [R, 1] first packed row of each request
    rows = torch.arange(first, seg_len, device=positions.device) + starts  # [R, c]
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
    cache: torch.Tensor, cache_pos: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
    plan: StorePlan, accepted: AcceptedRows,
) -> None:
    """Write one step's accepted context rows into each request's KV ring, in place.

    Exactly the accepted rows with ``position > last - W`` (``last``: the request's last
    accepted position) go to ``cache[slots[r], pos % W]`` and ``cache_pos``. Rejected rows never
    reach a live row: their cell may still hold live context. ``kv [T, D]`` in the cache dtype,
    ``positions [T]`` strictly increasing within a request. No host read.
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
    """View both tensors' rows as 16-byte words when both layouts allow, else as they are:
    index kernels copy element by element, so a 1 KiB bf16 row moved as 64 words instead of
    512 elements is ~4x faster on CPU, and byte-identical (only bits are copied)."""
    if cache.dtype.itemsize >= 16 or (cache.shape[-1] * cache.dtype.itemsize) % 16:
        return cache, kv
    try:
        return cache.view(torch.complex128), kv.view(torch.complex128)
    except RuntimeError:  # a last dim not contiguous, or a storage offset not aligned
        return cache, kv


def window_mask(
    cache_pos: torch.Tensor, slots: torch.Tensor, anchor_positions: torch.Tensor,
    W: int,  # noqa: N803 - the paper's name for the window
) -> torch.Tensor:
    """Bool ``[R, W]``: cells with ``max(anchor - W, 0) <= cache_pos < anchor``, the ones the
    draft block of request ``r`` may attend. Checking the stored position keeps stale cells (a
    released slot, a prefix-cache hole, a preempted request) out; an anchor of 0 attends none."""
    held = cache_pos.index_select(0, slots)  # [R, W]
    anchor = anchor_positions[:, None]
    return (held >= (anchor - W).clamp(min=0)) & (held < anchor)
