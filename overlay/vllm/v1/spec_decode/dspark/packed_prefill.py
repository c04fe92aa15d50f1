"""Packed multi-request DSpark prefill across tensor-parallel ranks (overlay/README.md).

A chunk of ``N`` rows is split contiguously over the ranks: ``P = align_up(N, tp_size)``, rank
``k`` projects rows ``[k*L, (k+1)*L)`` into draft context KV (a request may straddle ranks: the
projection is per row), then the ranks all-gather the ``P`` rows and each stores the first
``N`` into its replica of the rings. Pad rows ``N..P-1`` get zero input and output and are never
stored. :func:`ingest_packed_prefill` trusts the step plan: no validation, no host read.
Pure torch + torch.distributed: testable without the rest of vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .context_store import AcceptedRows, StorePlan, store_context_kv

__all__ = ["MAX_PACKED_TOKENS", "PackedPrefill", "ingest_packed_prefill", "plan_packed_prefill"]

# The recipe's max_num_batched_tokens: the largest chunk one engine step packs.
MAX_PACKED_TOKENS = 8192


@dataclass(frozen=True)
class PackedPrefill:
    """Geometry of one packed chunk (identical on every rank) and this rank's place in it."""

    num_tokens: int  # N, real rows
    num_padded: int  # P = align_up(N, tp_size)
    rows_per_rank: int  # L = P / tp_size
    tp_size: int
    rank: int  # this process's rank in ``group``
    group: dist.ProcessGroup | None = None  # None only for tp_size == 1

    @property
    def num_pad_rows(self) -> int:
        """P - N: rows that exist only so every rank holds the same L rows."""
        return self.num_padded - self.num_tokens

    def rank_rows(self) -> tuple[int, int]:
        """(first packed row, number of real rows) of this rank."""
        base = self.rank * self.rows_per_rank
        return base, min(max(self.num_tokens - base, 0), self.rows_per_rank)


def plan_packed_prefill(
    num_tokens: int, tp_size: int, rank: int, group: dist.ProcessGroup | None = None
) -> PackedPrefill:
    """The TP row split of a chunk of ``num_tokens`` rows (checked by the step plan)."""
    padded = -(-num_tokens // tp_size) * tp_size
    return PackedPrefill(num_tokens, padded, padded // tp_size, tp_size, rank, group)


def _pad_positions(plan: PackedPrefill, positions: torch.Tensor, max_model_len: int):
    """Positions for all P rows: pads continue past the largest live one (so even a
    position-based causal test cannot expose them), clamped below ``max_model_len`` (valid
    RoPE indices). ``positions`` itself when there is no padding; no host read."""
    if plan.num_pad_rows == 0:
        return positions
    step = torch.arange(1, plan.num_pad_rows + 1, device=positions.device, dtype=torch.int64)
    pads = (positions.max().to(torch.int64) + step).clamp_(max=max_model_len - 1)
    return torch.cat([positions, pads.to(positions.dtype)])


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
    """Every rank's rows into ``out`` in rank order (one collective); all_gather_single is
    torch 2.13's name for all_gather_into_tensor, which older torch alone has."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local, group=group)


def ingest_packed_prefill(
    plan: PackedPrefill, store: StorePlan, features: torch.Tensor, positions: torch.Tensor,
    project: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ring: tuple[torch.Tensor, torch.Tensor], *, max_model_len: int, accepted: AcceptedRows,
) -> torch.Tensor:
    """Project this rank's L rows into draft context KV, all-gather P rows, store N rows.

    ``features [N, ...]``: the whole chunk, replicated on every rank (as the target's hidden
    states are after its all-reduce). ``project(features [L, ...], positions [L]) -> [L, D]``
    (all draft layers stacked in ``D``) always gets exactly L rows, pads zeroed. ``ring``:
    ``(cache, cache_pos)``; ``accepted``: the step's ``last_accepted`` (verify rows of a mixed
    step may be rejected). Returns the gathered ``[P, D]`` KV (pad rows exactly zero); the rings
    are updated in place, identically on every rank.
    """
    rows = plan.rows_per_rank
    base, real = plan.rank_rows()
    local_pos = _pad_positions(plan, positions, max_model_len)[base : base + rows]
    local_kv = project(_local_features(plan, features), local_pos)
    if real < rows:
        # Forced, not assumed: a projection with a bias maps zero input to nonzero output.
        local_kv = torch.cat([local_kv[:real], local_kv.new_zeros((rows - real, *local_kv.shape[1:]))])
    local_kv = local_kv.contiguous()

    if plan.tp_size == 1:
        full_kv = local_kv
    else:
        full_kv = local_kv.new_empty((plan.num_padded, *local_kv.shape[1:]))
        _all_gather_rows(full_kv, local_kv, plan.group)
    cache, cache_pos = ring
    store_context_kv(cache, cache_pos, full_kv[: plan.num_tokens], positions, store, accepted)
    return full_kv
