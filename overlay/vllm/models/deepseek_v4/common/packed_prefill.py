"""Packed multi-request DSpark prefill across tensor-parallel ranks.

One prefill chunk of up to ``MAX_PACKED_TOKENS`` rows from many requests is described by
``query_start_loc`` alone. Its rows are split contiguously over the TP ranks, so a rank
projects only ``L = P / tp_size`` rows into draft context KV instead of all ``N``; the
ranks then all-gather the ``P`` projected rows so that every rank stores the full chunk
into its replica of the draft's per-request ring cache (``dspark_ragged.store_context_kv``).

Layout (DESIGN section 6): ``P = align_up(N, tp_size)``; rank ``k`` owns packed rows
``[k*L, (k+1)*L)``; a request may straddle ranks; rows ``N..P-1`` are pad rows with zero
input, synthetic non-aliasing positions, slot ``-1`` and request id ``-1``. Pad rows
produce exactly zero output and are never written.

Pure torch + torch.distributed: importable and testable without vLLM. Every check runs
before any compute or write and raises ``ValueError`` naming the field, its shape and the
expectation, because a bad table would otherwise read or overwrite another request's KV.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

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

_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


@dataclass(frozen=True, eq=False)
class PackedPrefill:
    """Geometry of one packed chunk; identical on every rank of the TP group.

    ``eq=False`` because a tensor field has no boolean equality; plans compare by identity.
    """

    query_start_loc: torch.Tensor  # [R+1], private copy of the caller's tensor
    num_requests: int  # R
    num_tokens: int  # N, real rows
    num_padded: int  # P = align_up(N, tp_size)
    rows_per_rank: int  # L = P / tp_size
    tp_size: int

    @property
    def num_pad_rows(self) -> int:
        """P - N: rows that exist only so every rank holds the same L rows."""
        return self.num_padded - self.num_tokens

    def rank_rows(self, rank: int) -> tuple[int, int]:
        """(first packed row, number of real rows) of ``rank``; pads follow the real rows."""
        _check_rank(self, rank)
        base = rank * self.rows_per_rank
        return base, min(max(self.num_tokens - base, 0), self.rows_per_rank)


def _is_int(x: object) -> bool:
    # bool is an int subclass but a flag passed as a size is a bug.
    return isinstance(x, int) and not isinstance(x, bool)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def plan_packed_prefill(
    query_start_loc: torch.Tensor, tp_size: int, *, max_tokens: int = MAX_PACKED_TOKENS
) -> PackedPrefill:
    """Validate ``query_start_loc`` and derive the TP row split (one host sync, here only).

    Every later helper trusts the plan, so all metadata checks live here.
    """
    if not _is_int(tp_size) or tp_size < 1:
        raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
    if not _is_int(max_tokens) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    qsl = query_start_loc
    if not isinstance(qsl, torch.Tensor):
        raise ValueError(
            f"query_start_loc must be a torch.Tensor of shape [R+1], got {type(qsl).__name__}"
        )
    if qsl.dim() != 1:
        raise ValueError(
            f"query_start_loc must be 1-D [R+1], got shape {_shape(qsl)} ({qsl.dim()}-D)"
        )
    if qsl.dtype not in _INT_DTYPES:
        raise ValueError(f"query_start_loc must have an integer dtype, got {qsl.dtype}")
    if qsl.numel() < 2:
        raise ValueError(
            f"query_start_loc must have at least 2 entries (R >= 1 request), got shape {_shape(qsl)}"
        )
    host = qsl.detach().to("cpu", torch.int64)
    if int(host[0]) != 0:
        raise ValueError(f"query_start_loc[0] must be 0, got {int(host[0])}")
    lens = host[1:] - host[:-1]
    bad = torch.nonzero(lens <= 0)
    if bad.numel():
        r = int(bad[0, 0])
        raise ValueError(
            "query_start_loc must be strictly increasing (every request has >= 1 row): "
            f"request {r} has query_start_loc[{r}]={int(host[r])}, "
            f"query_start_loc[{r + 1}]={int(host[r + 1])}"
        )
    n = int(host[-1])
    if n > max_tokens:
        raise ValueError(
            f"query_start_loc[-1] (N, tokens in the chunk) must be in [1, {max_tokens}], got {n}"
        )
    padded = -(-n // tp_size) * tp_size
    return PackedPrefill(
        query_start_loc=qsl.detach().clone(),
        num_requests=qsl.numel() - 1,
        num_tokens=n,
        num_padded=padded,
        rows_per_rank=padded // tp_size,
        tp_size=tp_size,
    )


def _check_plan(plan: object) -> None:
    if not isinstance(plan, PackedPrefill):
        raise ValueError(
            f"plan must be a PackedPrefill from plan_packed_prefill, got {type(plan).__name__}"
        )


def _check_rank(plan: PackedPrefill, rank: object) -> None:
    if not _is_int(rank) or not 0 <= rank < plan.tp_size:
        raise ValueError(f"rank must be an int in [0, {plan.tp_size}) (tp_size), got {rank!r}")


def local_request_ids(plan: PackedPrefill, rank: int) -> torch.Tensor:
    """Request owning each of ``rank``'s L rows (int32, -1 for pad rows).

    O(L + R) and loop-free: row ``base + j`` belongs to request ``#{r >= 1 : qsl[r] <= row}``,
    so scatter each request start into its (clamped) local row and prefix-sum. No sort, no
    L x R comparison, no host sync.
    """
    _check_plan(plan)
    _check_rank(plan, rank)
    base, real = plan.rank_rows(rank)
    rows = plan.rows_per_rank
    qsl = plan.query_start_loc
    starts = (qsl[1:-1].to(torch.int64) - base).clamp_(0, rows)  # requests 1..R-1
    counts = torch.zeros(rows + 1, dtype=torch.int32, device=qsl.device)
    counts.scatter_add_(0, starts, torch.ones_like(starts, dtype=torch.int32))
    ids = counts[:rows].cumsum(0, dtype=torch.int32)
    ids[real:] = -1
    return ids


def _check_rows(name: str, t: object, plan: PackedPrefill, *, one_d: bool, integer: bool):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor with N={plan.num_tokens} rows")
    if one_d and t.dim() != 1:
        raise ValueError(f"{name} must be 1-D [N={plan.num_tokens}], got shape {_shape(t)}")
    if t.dim() < 1 or t.shape[0] != plan.num_tokens:
        raise ValueError(
            f"{name} must have N={plan.num_tokens} rows (real packed rows, no padding), "
            f"got shape {_shape(t)}"
        )
    if integer and t.dtype not in _INT_DTYPES:
        raise ValueError(f"{name} must have an integer dtype, got {t.dtype}")


def _check_positions(plan: PackedPrefill, positions: object, max_model_len: object) -> None:
    if not _is_int(max_model_len) or max_model_len < 1:
        raise ValueError(f"max_model_len must be an int >= 1, got {max_model_len!r}")
    _check_rows("positions", positions, plan, one_d=True, integer=True)
    lo, hi = torch.stack([positions.amin(), positions.amax()]).tolist()
    if lo < 0 or hi >= max_model_len:
        raise ValueError(
            f"positions must lie in [0, max_model_len={max_model_len}), got min {lo}, max {hi}"
        )


def pad_positions(plan: PackedPrefill, positions: torch.Tensor, max_model_len: int) -> torch.Tensor:
    """Positions for all P rows: real ones, then ``max(positions) + 1 + i`` clamped below
    ``max_model_len``.

    Pads continue past the largest live position so even a position-based causal test
    cannot expose them, while staying valid RoPE indices. Pad rows are additionally
    excluded by request id -1 and slot -1 (a clamped pad may repeat a position). Returns
    ``positions`` itself when there is no padding.
    """
    _check_plan(plan)
    _check_positions(plan, positions, max_model_len)
    return _pad_positions(plan, positions, max_model_len)


def _pad_positions(plan: PackedPrefill, positions: torch.Tensor, max_model_len: int):
    if plan.num_pad_rows == 0:
        return positions
    step = torch.arange(1, plan.num_pad_rows + 1, device=positions.device, dtype=torch.int64)
    pads = (positions.max().to(torch.int64) + step).clamp_(max=max_model_len - 1)
    return torch.cat([positions, pads.to(positions.dtype)])


def pad_slot_mapping(plan: PackedPrefill, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Slot mapping for all P rows, -1 (vLLM's PAD_SLOT_ID, "do not write") for pads.

    Returns ``slot_mapping`` itself when there is no padding.
    """
    _check_plan(plan)
    _check_rows("slot_mapping", slot_mapping, plan, one_d=True, integer=True)
    low = int(slot_mapping.min())
    if low < -1:
        raise ValueError(f"slot_mapping values must be >= -1 (-1 = do not write), got {low}")
    if plan.num_pad_rows == 0:
        return slot_mapping
    pads = slot_mapping.new_full((plan.num_pad_rows,), -1)
    return torch.cat([slot_mapping, pads])


def pad_rows(plan: PackedPrefill, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden [N, ...]`` extended to ``[P, ...]`` with zero pad rows (zero in, zero out).

    Returns ``hidden`` itself when there is no padding (no copy of large features).
    """
    _check_plan(plan)
    _check_rows("hidden", hidden, plan, one_d=False, integer=False)
    if plan.num_pad_rows == 0:
        return hidden
    out = hidden.new_zeros((plan.num_padded, *hidden.shape[1:]))
    out[: plan.num_tokens] = hidden
    return out


def logit_row_indices(plan: PackedPrefill) -> torch.Tensor:
    """Packed row of each request's last token, ``qsl[r+1] - 1`` (int64, [R]).

    Always in ``[0, N)``, so a logit row can never select a pad row.
    """
    _check_plan(plan)
    return plan.query_start_loc[1:].to(torch.int64) - 1


def validate_request_tables(plan: PackedPrefill, **tables: torch.Tensor | None) -> None:
    """Check every request-indexed table has leading dimension R; ``None`` entries are skipped.

    Tables are indexed by request id, so a table built for another batch would silently
    route a request to someone else's rows.
    """
    _check_plan(plan)
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
                f"request table {name!r} has shape {_shape(table)}; its leading dimension "
                f"must equal the number of requests R={r}"
            )


def _ragged_store() -> Callable[..., None]:
    """``dspark_ragged.store_context_kv``, imported on first use (keeps this module import-light)."""
    from vllm.v1.spec_decode.dspark_ragged import store_context_kv

    return store_context_kv


def _check_group(plan: PackedPrefill, rank: int, group: object) -> None:
    if group is None:
        if plan.tp_size != 1:
            raise ValueError(
                f"group must be a torch.distributed ProcessGroup when tp_size={plan.tp_size} "
                "(None is only valid for tp_size=1)"
            )
        return
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group was given but torch.distributed is not initialized")
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"group must be a torch.distributed ProcessGroup, got {type(group).__name__}"
        )
    size = dist.get_world_size(group)
    if size != plan.tp_size:
        raise ValueError(f"group has world size {size}, expected tp_size={plan.tp_size}")
    own = dist.get_rank(group)
    if own != rank:
        raise ValueError(f"rank={rank} does not match this process's rank {own} in group")


def _check_caches(kv_caches: object) -> tuple[torch.Size, torch.dtype, torch.device]:
    if not isinstance(kv_caches, Sequence) or len(kv_caches) == 0:
        raise ValueError(
            "kv_caches must be a non-empty sequence of (cache [S, W, D], cache_pos [S, W]) "
            "pairs, one per draft layer"
        )
    first = None
    for k, pair in enumerate(kv_caches):
        if not isinstance(pair, Sequence) or len(pair) != 2:
            raise ValueError(f"kv_caches[{k}] must be a (cache, cache_pos) pair")
        cache, cache_pos = pair
        if not isinstance(cache, torch.Tensor) or cache.dim() != 3:
            shape = _shape(cache) if isinstance(cache, torch.Tensor) else type(cache).__name__
            raise ValueError(f"kv_caches[{k}] cache must be a 3-D tensor [S, W, D], got {shape}")
        if not cache.is_floating_point():
            raise ValueError(f"kv_caches[{k}] cache must be floating point, got {cache.dtype}")
        if (
            not isinstance(cache_pos, torch.Tensor)
            or cache_pos.dtype != torch.int64
            or _shape(cache_pos) != _shape(cache)[:2]
        ):
            got = (
                f"{_shape(cache_pos)} {cache_pos.dtype}"
                if isinstance(cache_pos, torch.Tensor)
                else type(cache_pos).__name__
            )
            raise ValueError(
                f"kv_caches[{k}] cache_pos must be int64 [S, W]={list(cache.shape[:2])}, got {got}"
            )
        if first is None:
            first = cache
        elif (cache.shape, cache.dtype, cache.device) != (first.shape, first.dtype, first.device):
            raise ValueError(
                f"kv_caches[{k}] cache is {_shape(cache)} {cache.dtype} on {cache.device}; "
                f"every draft layer must match kv_caches[0]: {_shape(first)} {first.dtype} "
                f"on {first.device}"
            )
    return first.shape, first.dtype, first.device


def _check_ingest(
    plan, rank, group, features, positions, kv_caches, slots, max_model_len, num_rejected
) -> tuple[torch.Size, torch.dtype, torch.device]:
    """All ingestion checks; value checks share one host sync (one stats vector)."""
    _check_plan(plan)
    _check_rank(plan, rank)
    _check_group(plan, rank, group)
    _check_rows("features", features, plan, one_d=False, integer=False)
    if not _is_int(max_model_len) or max_model_len < 1:
        raise ValueError(f"max_model_len must be an int >= 1, got {max_model_len!r}")
    _check_rows("positions", positions, plan, one_d=True, integer=True)
    cache_info = _check_caches(kv_caches)
    r, n = plan.num_requests, plan.num_tokens
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype not in _INT_DTYPES:
        got = f"{_shape(slots)} {slots.dtype}" if isinstance(slots, torch.Tensor) else slots
        raise ValueError(f"slots must be a 1-D integer tensor [R={r}], got {got}")
    validate_request_tables(plan, slots=slots, num_rejected=num_rejected)
    if num_rejected is not None and (
        num_rejected.dim() != 1 or num_rejected.dtype not in _INT_DTYPES
    ):
        raise ValueError(
            f"num_rejected must be a 1-D integer [R={r}] tensor, "
            f"got {_shape(num_rejected)} {num_rejected.dtype}"
        )

    dev = positions.device
    qsl = plan.query_start_loc.to(dev, torch.int64)
    pos = positions.to(torch.int64)
    ring = slots.to(dev, torch.int64).sort().values
    # First row whose position does not exceed its predecessor's in the same request
    # (the ring store keys cells by position, so a repeat would alias); n = none.
    cont = torch.ones(max(n - 1, 0), dtype=torch.bool, device=dev)
    cont[qsl[1:-1] - 1] = False
    rows = torch.arange(1, n, device=dev)
    bad_row = (
        torch.where((pos[1:] <= pos[:-1]) & cont, rows, n).amin() if n > 1 else pos.new_tensor(n)
    )
    stats = [pos.amin(), pos.amax(), ring[0], ring[-1], (ring[1:] == ring[:-1]).sum(), bad_row]
    if num_rejected is not None:
        rej = num_rejected.to(dev, torch.int64)
        stats.append(((rej < 0) | (rej > qsl[1:] - qsl[:-1])).sum())
    pos_lo, pos_hi, slot_lo, slot_hi, dups, bad_row, *rej_bad = torch.stack(stats).tolist()

    if pos_lo < 0 or pos_hi >= max_model_len:
        raise ValueError(
            f"positions must lie in [0, max_model_len={max_model_len}), "
            f"got min {pos_lo}, max {pos_hi}"
        )
    if slot_lo < 0 or slot_hi >= cache_info[0][0]:
        raise ValueError(
            f"slots must lie in [0, S={cache_info[0][0]}), got min {slot_lo}, max {slot_hi}"
        )
    if dups:
        raise ValueError(
            f"slots must be distinct (one cache row per request), got {slots.tolist()}"
        )
    if rej_bad and rej_bad[0]:
        raise ValueError("num_rejected[r] must lie in [0, request r's row count]")
    if bad_row < n:
        raise ValueError(
            "positions must be strictly increasing within each request: row "
            f"{bad_row} has position {int(pos[bad_row])} after {int(pos[bad_row - 1])}"
        )
    return cache_info


def _local_features(plan: PackedPrefill, rank: int, features: torch.Tensor) -> torch.Tensor:
    """This rank's L input rows, zero pad rows appended; never copies the whole chunk."""
    base, real = plan.rank_rows(rank)
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
    rank: int,
    group: dist.ProcessGroup | None,
    features: torch.Tensor,
    positions: torch.Tensor,
    project: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    slots: torch.Tensor,
    *,
    max_model_len: int,
    num_rejected: torch.Tensor | None = None,
) -> torch.Tensor:
    """Project this rank's L rows into draft context KV, all-gather P rows, store N rows.

    Args:
        plan: from ``plan_packed_prefill``; identical on every rank.
        rank: this process's rank in ``group`` (0 for TP=1).
        group: TP process group, or ``None`` for ``tp_size == 1``.
        features: ``[N, ...]`` packed target features of the whole chunk (replicated on
            every rank, as the target's hidden states are after its all-reduce).
        positions: ``[N]`` absolute positions, strictly increasing within each request.
        project: ``project(features_local [L, ...], positions_local [L]) -> [L, K, D]``,
            the draft's context-KV projection for all K draft layers at once (for DSV4
            ``RoPE(kv_norm(W_kv main_norm(main_proj(x))))``). It always gets exactly L rows
            (fixed shape), pads zeroed and at synthetic positions.
        kv_caches: K ``(cache [S, W, D], cache_pos [S, W] int64)`` pairs, one per draft
            layer, in the layout of ``dspark_ragged.store_context_kv``.
        slots: ``[R]`` distinct cache rows, one per request (keyed by request id upstream).
        max_model_len: bound for real and synthetic positions.
        num_rejected: optional ``[R]`` rows to drop at each request's end (verify rows in a
            mixed step); ``None`` for a pure prefill chunk.

    Returns:
        The gathered ``[P, K, D]`` context KV (pad rows exactly zero), identical on every
        rank. The K caches are updated in place, identically on every rank.

    All input checks run before ``project`` is called and before anything is written; the
    projection's output is checked before the all-gather and the store.
    """
    (_, _, dim), dtype, device = _check_ingest(
        plan, rank, group, features, positions, kv_caches, slots, max_model_len, num_rejected
    )
    store = _ragged_store()
    layers, rows = len(kv_caches), plan.rows_per_rank
    base, real = plan.rank_rows(rank)

    local_pos = _pad_positions(plan, positions, max_model_len)[base : base + rows]
    local_kv = project(_local_features(plan, rank, features), local_pos)
    want = (rows, layers, dim)
    if not isinstance(local_kv, torch.Tensor) or _shape(local_kv) != want:
        got = _shape(local_kv) if isinstance(local_kv, torch.Tensor) else type(local_kv).__name__
        raise ValueError(f"project must return [L, K, D]={list(want)}, got {got}")
    if local_kv.dtype != dtype or local_kv.device != device:
        raise ValueError(
            f"project must return {dtype} on {device} (the caches' dtype and device), "
            f"got {local_kv.dtype} on {local_kv.device}"
        )
    if real < rows:
        # Forced, not assumed: a projection with a bias maps zero input to nonzero output.
        local_kv = torch.cat([local_kv[:real], local_kv.new_zeros((rows - real, layers, dim))])
    local_kv = local_kv.contiguous()

    if group is None or plan.tp_size == 1:
        full_kv = local_kv
    else:
        full_kv = local_kv.new_empty((plan.num_padded, layers, dim))
        _all_gather_rows(full_kv, local_kv, group)

    n = plan.num_tokens
    qsl = plan.query_start_loc.to(device)
    store_pos = positions.to(device)
    store_slots = slots.to(device)
    rej = None if num_rejected is None else num_rejected.to(device)
    for k, (cache, cache_pos) in enumerate(kv_caches):
        store(cache, cache_pos, full_kv[:n, k], store_pos, qsl, store_slots, rej)
    return full_kv
