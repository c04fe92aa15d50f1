"""Packed multi-request DSpark prefill across tensor-parallel ranks.

One prefill chunk of up to ``MAX_PACKED_TOKENS`` rows from many requests is described by
``query_start_loc`` alone. Its rows are split contiguously over the TP ranks, so a rank
projects only ``L = P / tp_size`` rows into draft context KV instead of all ``N``; the
ranks then all-gather the ``P`` projected rows so that every rank stores the full chunk
into its replica of the draft's per-request ring cache (``context_store.store_context_kv``).

Layout (DESIGN section 6): ``P = align_up(N, tp_size)``; rank ``k`` owns packed rows
``[k*L, (k+1)*L)``; a request may straddle ranks; rows ``N..P-1`` are pad rows with zero
input, synthetic non-aliasing positions, slot ``-1`` and request id ``-1``. Pad rows
produce exactly zero output and are never written.

Plan once, run trusting the plan: :func:`plan_packed_prefill` checks the host metadata
(``query_start_loc`` on the CPU, TP size, rank, group) and raises ``ValueError`` naming
the field; the ring rows and rejection bounds are checked by ``context_store.plan_store``.
The device helpers below do no validation and no host read. Pure torch +
torch.distributed: importable and testable without the rest of vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from .context_store import (
    AcceptedRows,
    StorePlan,
    host_layout,
    store_context_kv,
)

__all__ = [
    "MAX_PACKED_TOKENS",
    "PackedPrefill",
    "plan_packed_prefill",
    "local_request_ids",
    "pad_positions",
    "pad_slot_mapping",
    "pad_rows",
    "logit_row_indices",
    "validate_request_tables",
    "ingest_packed_prefill",
]

# The recipe's max_num_batched_tokens: the largest chunk one engine step packs.
MAX_PACKED_TOKENS = 8192


@dataclass(frozen=True, eq=False)
class PackedPrefill:
    """Geometry of one packed chunk (identical on every rank) and this rank's place in it.

    ``eq=False`` because a tensor field has no boolean equality; plans compare by identity.
    """

    query_start_loc: torch.Tensor  # [R+1], private host copy of the caller's tensor
    num_requests: int  # R
    num_tokens: int  # N, real rows
    num_padded: int  # P = align_up(N, tp_size)
    rows_per_rank: int  # L = P / tp_size
    tp_size: int
    rank: int = 0  # this process's rank in ``group``
    group: dist.ProcessGroup | None = None  # None only for tp_size == 1

    @property
    def num_pad_rows(self) -> int:
        """P - N: rows that exist only so every rank holds the same L rows."""
        return self.num_padded - self.num_tokens

    def rank_rows(self, rank: int | None = None) -> tuple[int, int]:
        """(first packed row, number of real rows) of ``rank`` (default: this rank)."""
        rank = self.rank if rank is None else rank
        _check_rank(self.tp_size, rank)
        base = rank * self.rows_per_rank
        return base, min(max(self.num_tokens - base, 0), self.rows_per_rank)


def _is_int(x: object) -> bool:
    # bool is an int subclass but a flag passed as a size is a bug.
    return isinstance(x, int) and not isinstance(x, bool)


def _check_rank(tp_size: int, rank: object) -> None:
    if not _is_int(rank) or not 0 <= rank < tp_size:
        raise ValueError(f"rank must be an int in [0, {tp_size}) (tp_size), got {rank!r}")


def _check_group(tp_size: int, rank: int, group: object) -> None:
    if group is None:  # a geometry-only plan; ingestion refuses it for tp_size > 1
        return
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group was given but torch.distributed is not initialized")
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"group must be a torch.distributed ProcessGroup, got {type(group).__name__}"
        )
    size = dist.get_world_size(group)
    if size != tp_size:
        raise ValueError(f"group has world size {size}, expected tp_size={tp_size}")
    own = dist.get_rank(group)
    if own != rank:
        raise ValueError(f"rank={rank} does not match this process's rank {own} in group")


def plan_packed_prefill(
    query_start_loc: torch.Tensor | np.ndarray,
    tp_size: int,
    *,
    rank: int = 0,
    group: dist.ProcessGroup | None = None,
    max_tokens: int = MAX_PACKED_TOKENS,
) -> PackedPrefill:
    """Validate the chunk's host metadata and derive the TP row split; no device work.

    Every later helper trusts the plan, so all metadata checks live here. ``group`` may be
    omitted for a geometry-only plan; ingestion with ``tp_size > 1`` needs it. A numpy
    ``query_start_loc`` (the runner's host view) is read as it is, without a tensor
    round trip.
    """
    if not _is_int(tp_size) or tp_size < 1:
        raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
    if not _is_int(max_tokens) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    host_view = query_start_loc if isinstance(query_start_loc, np.ndarray) else None
    qsl = torch.from_numpy(host_view.copy()) if host_view is not None else query_start_loc
    if not isinstance(qsl, torch.Tensor):
        raise ValueError(
            "query_start_loc must be a torch.Tensor or numpy array of shape [R+1], got "
            f"{type(qsl).__name__}"
        )
    if qsl.dim() != 1:
        raise ValueError(
            f"query_start_loc must be 1-D [R+1], got shape {tuple(qsl.shape)} ({qsl.dim()}-D)"
        )
    if qsl.dtype.is_floating_point or qsl.dtype.is_complex or qsl.dtype == torch.bool:
        raise ValueError(f"query_start_loc must have an integer dtype, got {qsl.dtype}")
    if qsl.numel() < 2:
        raise ValueError(
            "query_start_loc must have at least 2 entries (R >= 1 request), "
            f"got shape {tuple(qsl.shape)}"
        )
    host, _ = host_layout(qsl if host_view is None else host_view, min_rows=1)
    n = int(host[-1])
    if n > max_tokens:
        raise ValueError(
            f"query_start_loc[-1] (N, tokens in the chunk) must be in [1, {max_tokens}], got {n}"
        )
    _check_rank(tp_size, rank)
    _check_group(tp_size, rank, group)
    padded = -(-n // tp_size) * tp_size
    return PackedPrefill(
        query_start_loc=qsl if host_view is not None else qsl.clone(),
        num_requests=qsl.numel() - 1,
        num_tokens=n,
        num_padded=padded,
        rows_per_rank=padded // tp_size,
        tp_size=tp_size,
        rank=rank,
        group=group,
    )


def local_request_ids(plan: PackedPrefill, rank: int | None = None) -> torch.Tensor:
    """Request owning each of ``rank``'s L rows (int32, -1 for pad rows).

    O(L + R) and loop-free: row ``base + j`` belongs to request ``#{r >= 1 : qsl[r] <= row}``,
    so scatter each request start into its (clamped) local row and prefix-sum. No sort, no
    L x R comparison.
    """
    base, real = plan.rank_rows(rank)
    rows = plan.rows_per_rank
    qsl = plan.query_start_loc
    starts = (qsl[1:-1].to(torch.int64) - base).clamp_(0, rows)  # requests 1..R-1
    counts = torch.zeros(rows + 1, dtype=torch.int32, device=qsl.device)
    counts.scatter_add_(0, starts, torch.ones_like(starts, dtype=torch.int32))
    ids = counts[:rows].cumsum(0, dtype=torch.int32)
    ids[real:] = -1
    return ids


def pad_positions(plan: PackedPrefill, positions: torch.Tensor, max_model_len: int) -> torch.Tensor:
    """Positions for all P rows: real ones, then ``max(positions) + 1 + i`` clamped below
    ``max_model_len``.

    Pads continue past the largest live position so even a position-based causal test
    cannot expose them, while staying valid RoPE indices. Pad rows are additionally
    excluded by request id -1 and slot -1 (a clamped pad may repeat a position). Returns
    ``positions`` itself when there is no padding. Device work, no host read.
    """
    if plan.num_pad_rows == 0:
        return positions
    step = torch.arange(1, plan.num_pad_rows + 1, device=positions.device, dtype=torch.int64)
    pads = (positions.max().to(torch.int64) + step).clamp_(max=max_model_len - 1)
    return torch.cat([positions, pads.to(positions.dtype)])


def pad_slot_mapping(plan: PackedPrefill, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Slot mapping for all P rows, -1 (vLLM's PAD_SLOT_ID, "do not write") for pads.

    Returns ``slot_mapping`` itself when there is no padding.
    """
    if plan.num_pad_rows == 0:
        return slot_mapping
    return torch.cat([slot_mapping, slot_mapping.new_full((plan.num_pad_rows,), -1)])


def pad_rows(plan: PackedPrefill, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden [N, ...]`` extended to ``[P, ...]`` with zero pad rows (zero in, zero out).

    Returns ``hidden`` itself when there is no padding (no copy of large features).
    """
    if plan.num_pad_rows == 0:
        return hidden
    out = hidden.new_zeros((plan.num_padded, *hidden.shape[1:]))
    out[: plan.num_tokens] = hidden
    return out


def logit_row_indices(plan: PackedPrefill) -> torch.Tensor:
    """Packed row of each request's last token, ``qsl[r+1] - 1`` (int64, [R], host).

    Always in ``[0, N)``, so a logit row can never select a pad row.
    """
    return plan.query_start_loc[1:].to(torch.int64) - 1


def validate_request_tables(plan: PackedPrefill, **tables: torch.Tensor | None) -> None:
    """Check every request-indexed table has leading dimension R; ``None`` entries are skipped.

    Tables are indexed by request id, so a table built for another batch would silently
    route a request to someone else's rows. Shapes only: no data is read.
    """
    r = plan.num_requests
    for name, table in tables.items():
        if table is None:
            continue
        if not isinstance(table, torch.Tensor):
            raise ValueError(
                f"request table {name!r} must be a torch.Tensor with leading dimension "
                f"R={r}, got {type(table).__name__}"
            )
        if table.dim() < 1 or table.shape[0] != r:
            raise ValueError(
                f"request table {name!r} has shape {tuple(table.shape)}; its leading "
                f"dimension must equal the number of requests R={r}"
            )


def _local_features(plan: PackedPrefill, features: torch.Tensor) -> torch.Tensor:
    """This rank's L input rows, zero pad rows appended; never copies the whole chunk."""
    base, real = plan.rank_rows()
    rows = features[base : base + real]
    if real == plan.rows_per_rank:
        return rows
    out = features.new_zeros((plan.rows_per_rank, *features.shape[1:]))
    out[:real] = rows
    return out


def _all_gather_rows(out: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Concatenate every rank's rows into ``out`` in rank order (one collective).

    torch 2.13 renames all_gather_into_tensor to all_gather_single; older torch (and the
    Spark image, should it differ) only has the former.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local, group=group)


def ingest_packed_prefill(
    plan: PackedPrefill,
    store: StorePlan,
    features: torch.Tensor,
    positions: torch.Tensor,
    project: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    max_model_len: int,
    num_rejected: torch.Tensor | None = None,
    accepted: AcceptedRows | None = None,
) -> torch.Tensor:
    """Project this rank's L rows into draft context KV, all-gather P rows, store N rows.

    Args:
        plan: from ``plan_packed_prefill``; the same geometry on every rank.
        store: from ``context_store.plan_store`` for the same ``query_start_loc``: the
            ring rows of the requests and the rows each may reject.
        features: ``[N, ...]`` packed target features of the whole chunk (replicated on
            every rank, as the target's hidden states are after its all-reduce).
        positions: ``[N]`` int64 absolute positions, strictly increasing per request.
        project: ``project(features_local [L, ...], positions_local [L]) -> [L, K, D]``,
            the draft's context-KV projection for all K draft layers at once (for DSV4
            ``RoPE(kv_norm(W_kv main_norm(main_proj(x))))``). It always gets exactly L rows
            (fixed shape), pads zeroed and at synthetic positions.
        kv_caches: K ``(cache [S+1, W, D], cache_pos [S+1, W] int64)`` pairs, one per
            draft layer, in the layout of ``context_store.store_context_kv``.
        max_model_len: bound for the synthetic pad positions.
        num_rejected: ``[R]`` device rows to drop at each request's end (verify rows in a
            mixed step), at most the store plan's bounds; ``None`` for a pure prefill.
        accepted: ``context_store.last_accepted`` of the same step, if the caller has it.

    Returns:
        The gathered ``[P, K, D]`` context KV (pad rows exactly zero), identical on every
        rank. The K caches are updated in place, identically on every rank. The
        projection's output shape is checked before the all-gather and the store.
    """
    if plan.tp_size > 1 and plan.group is None:
        raise ValueError(
            f"plan.group must be a torch.distributed ProcessGroup when tp_size={plan.tp_size} "
            "(None is only valid for tp_size=1)"
        )
    cache = kv_caches[0][0]
    layers, rows, dim = len(kv_caches), plan.rows_per_rank, cache.shape[-1]
    base, real = plan.rank_rows()

    local_pos = pad_positions(plan, positions, max_model_len)[base : base + rows]
    local_kv = project(_local_features(plan, features), local_pos)
    want = (rows, layers, dim)
    if not isinstance(local_kv, torch.Tensor) or tuple(local_kv.shape) != want:
        got = (
            tuple(local_kv.shape) if isinstance(local_kv, torch.Tensor) else type(local_kv).__name__
        )
        raise ValueError(f"project must return [L, K, D]={list(want)}, got {got}")
    if local_kv.dtype != cache.dtype or local_kv.device != cache.device:
        raise ValueError(
            f"project must return {cache.dtype} on {cache.device} (the caches' dtype and "
            f"device), got {local_kv.dtype} on {local_kv.device}"
        )
    if real < rows:
        # Forced, not assumed: a projection with a bias maps zero input to nonzero output.
        local_kv = torch.cat([local_kv[:real], local_kv.new_zeros((rows - real, layers, dim))])
    local_kv = local_kv.contiguous()

    if plan.tp_size == 1:
        full_kv = local_kv
    else:
        full_kv = local_kv.new_empty((plan.num_padded, layers, dim))
        _all_gather_rows(full_kv, local_kv, plan.group)

    n = plan.num_tokens
    for k, (cache, cache_pos) in enumerate(kv_caches):
        store_context_kv(
            cache, cache_pos, full_kv[:n, k], positions, store, num_rejected, accepted
        )
    return full_kv
