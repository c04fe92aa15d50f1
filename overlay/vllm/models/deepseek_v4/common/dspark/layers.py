"""The DSpark draft's building blocks: RoPE tables, FP8 round trip, norms, attention, layer.
Each runs once per layer per step, so each is written for few tensor ops (graph-capturable on a
GPU, eager on CPU); the model, its weights and heads are in ``model.py``."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn as nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
from vllm.models.deepseek_v4.common.dspark.config import DSparkDraftShape
from vllm.models.deepseek_v4.common.fp8_ds_mla import QUANT_BLOCK, roundtrip_blocks
from vllm.platforms import current_platform

__all__ = [
    "DSparkDraftAttention",
    "DSparkDraftLayer",
    "DraftRMSNorm",
    "DraftRope",
    "RopeTables",
    "block_key_bias",
    "fp8_nope_roundtrip",
    "stacked_projection",
    "unit_rms_norm",
]


@dataclass
class RopeTables:
    """GPT-J RoPE pair tables over a whole head at positions ``P``, shared by every layer's q, kv
    and de-rotation: ``cos`` fp32 ``[*P, 1, D/2, 1]``, ``sin3`` = ``(-s, s, -s)`` (``[..., :2]``
    the signed sin, ``[..., 1:]`` its inverse). Non-RoPE pairs have ``c = 1, s = 0``, so one
    multiply-add covers the head; upstream's ``forward_native`` bit for bit on finite inputs."""

    cos: torch.Tensor
    sin3: torch.Tensor
    _signed: dict[bool, torch.Tensor] = field(default_factory=dict)

    def rotate(
        self, x: torch.Tensor, inverse: bool = False, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """``x [*P, heads, D]`` rotated (``inverse``: de-rotated), in ``out_dtype`` (default x's;
        fp32 skips the final cast for a caller that goes on in fp32)."""
        if inverse not in self._signed:
            self._signed[inverse] = self.sin3[..., 1:] if inverse else self.sin3[..., :2]
        pairs = x.unflatten(-1, (-1, 2))
        swapped = pairs.flip(-1) * self._signed[inverse]
        rotated = (pairs * self.cos + swapped).flatten(-2)
        out_dtype = x.dtype if out_dtype is None else out_dtype
        return rotated if rotated.dtype == out_dtype else rotated.to(out_dtype)


class DraftRope(nn.Module):
    """The draft's RoPE pair tables, built once at load from the rotary's fp32 ``cos_sin_cache``
    for positions below ``max_model_len`` (block positions are clamped to it). Only the rotating
    pairs are stored; a lookup pads the pass-through ones: six ops per pass."""

    def __init__(self, rotary_emb: nn.Module, head_dim: int, num_positions: int) -> None:
        super().__init__()
        cos_sin = rotary_emb.cos_sin_cache[:num_positions].float()
        cos, sin = cos_sin.chunk(2, dim=-1)  # [P, rope_dim / 2]
        self.num_positions = cos_sin.shape[0]
        self.pass_pairs = (head_dim - rotary_emb.rotary_dim) // 2
        self.register_buffer("cos", cos[:, None, :, None].contiguous(), persistent=False)
        sin3 = torch.stack((-sin, sin, -sin), dim=-1)[:, None].contiguous()
        self.register_buffer("sin3", sin3, persistent=False)

    def at(self, positions: torch.Tensor) -> RopeTables:
        """Tables for ``positions`` (any shape, values in ``[0, num_positions)``)."""
        pad = (0, 0, self.pass_pairs, 0)
        cos = torch.nn.functional.pad(self.cos[positions], pad, value=1.0)
        sin3 = torch.nn.functional.pad(self.sin3[positions], pad, value=0.0)
        return RopeTables(cos=cos, sin3=sin3)


def block_key_bias(window_mask: torch.Tensor, block_len: int) -> torch.Tensor:
    """fp32 ``[R, 1, 1, W+N]`` added to every block query's scores: 0 for the valid ring cells
    (``window_mask [R, W]``) and the N block rows (non-causal), -inf for the other cells."""
    bias = torch.where(window_mask, 0.0, float("-inf"))
    bias = torch.nn.functional.pad(bias, (0, block_len), value=0.0)
    return bias.view(window_mask.shape[0], 1, 1, -1)


_NOPE_BLOCK_MASKS: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _nope_blocks(num_blocks: int, nope_blocks: int, device: torch.device) -> torch.Tensor:
    """``[num_blocks, 1]`` bool, True for the FP8 blocks; one constant per device."""
    key = (num_blocks, nope_blocks, device)
    if key not in _NOPE_BLOCK_MASKS:
        _NOPE_BLOCK_MASKS[key] = torch.arange(num_blocks, device=device)[:, None] < nope_blocks
    return _NOPE_BLOCK_MASKS[key]


def fp8_nope_roundtrip(
    kv: torch.Tensor, rope_dim: int, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Quantise-dequantise the non-RoPE dims as the fp8_ds_mla KV cache stores them (FP8 e4m3,
    one UE8M0 scale per 64 dims), so the ring feeds the draft what it was trained on; an fp32
    ``kv`` is rounded once, to ``out_dtype`` (default kv's). RoPE blocks come back by one select."""
    out_dtype = kv.dtype if out_dtype is None else out_dtype
    dim = kv.shape[-1]
    nope = dim - rope_dim
    if nope <= 0 or nope % QUANT_BLOCK or rope_dim % QUANT_BLOCK:
        return kv if kv.dtype == out_dtype else kv.to(out_dtype)
    blocks = kv.unflatten(-1, (-1, QUANT_BLOCK))
    fp8 = _nope_blocks(dim // QUANT_BLOCK, nope // QUANT_BLOCK, kv.device)
    restored = torch.where(fp8, roundtrip_blocks(blocks), blocks).flatten(-2)
    return restored if restored.dtype == out_dtype else restored.to(out_dtype)


def unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMSNorm over the last dim (fp32 statistics, result in x's dtype): vLLM's eager
    ``rms_norm`` arithmetic in one torch op instead of seven."""
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), None, eps)


class DraftRMSNorm(RMSNorm):
    """vLLM's RMSNorm with a one-op ``forward_native`` (nine ops upstream). It applies the weight
    in fp32 and rounds once, where vLLM rounds the normalised x first: results agree to one
    rounding step of x's dtype (tested)."""

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None or self.variance_size_override is not None:
            return super().forward_native(x, residual)
        if not self.has_weight:
            return unit_rms_norm(x, self.variance_epsilon)
        if self.weight.dtype != x.dtype:
            return super().forward_native(x, residual)
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.variance_epsilon)


def _dense_weight(layer: nn.Module) -> torch.Tensor:
    """A linear layer's weight as fp32 ``[out, in]``, FP8 scales applied; the block size is read
    from the layer, as shapes that are not multiples of it leave partial edge blocks."""
    weight = layer.weight.float()
    scale = getattr(layer, "weight_scale_inv", None)
    if scale is None:
        scale = getattr(layer, "weight_scale", None)
    if scale is None or scale.numel() == 0:
        return weight
    scale = scale.float()
    block = getattr(layer, "weight_block_size", None)
    if block is None:  # per-tensor or per-channel
        return weight * (scale if scale.numel() == 1 else scale.reshape(-1, 1))
    block_out, block_in = block
    expanded = scale.repeat_interleave(block_out, 0).repeat_interleave(block_in, 1)
    return weight * expanded[: weight.shape[0], : weight.shape[1]]


def _make_moe(vllm_config: VllmConfig, prefix: str) -> nn.Module:
    """The platform's DeepSeek-V4 MoE (vLLM FusedMoE underneath, quant-aware)."""
    if current_platform.is_cpu():
        from vllm.models.deepseek_v4.cpu.model import DeepseekV4MoE

        return DeepseekV4MoE(vllm_config, prefix=prefix)
    hf = vllm_config.model_config.hf_config
    if current_platform.is_rocm():
        from vllm.models.deepseek_v4.amd.model import DeepseekV4MoE as AmdMoE

        return AmdMoE(vllm_config, prefix=prefix)
    from vllm.models.deepseek_v4.nvidia.model import DeepseekV4MoE as NvMoE

    return NvMoE(vllm_config, prefix=prefix, num_hash_layers=hf.num_hash_layers)


def stacked_projection(
    n_in: int, sizes: list[int], quant_config, prefix: str
) -> MergedColumnParallelLinear:
    """Projections of the same rows as one GEMM, each loaded as a shard by vLLM's loader;
    replicated, as every TP rank runs the whole draft."""
    return MergedColumnParallelLinear(
        n_in,
        sizes,
        bias=False,
        return_bias=False,
        quant_config=quant_config,
        prefix=prefix,
        disable_tp=True,
    )


class DSparkDraftAttention(nn.Module):
    """DeepSeek-V4 latent attention of one draft layer over ring context + block (non-causal,
    per-head sink; q gets a weightless RMSNorm, the output is de-rotated, then grouped wo_a)."""

    def __init__(self, shape: DSparkDraftShape, quant_config, prefix: str) -> None:
        super().__init__()
        self.shape = s = shape
        self.scale = s.head_dim**-0.5
        linear = partial(ReplicatedLinear, bias=False, return_bias=False, quant_config=quant_config)
        # wq_a and wkv read the same rows: one GEMM, as upstream's ``fused_wqa_wkv``.
        self.fused_wqa_wkv = stacked_projection(
            s.hidden_size, [s.q_lora_rank, s.head_dim], quant_config, f"{prefix}.fused_wqa_wkv"
        )
        self.q_norm = DraftRMSNorm(s.q_lora_rank, eps=s.rms_eps)
        self.wq_b = linear(s.q_lora_rank, s.num_heads * s.head_dim, prefix=f"{prefix}.wq_b")
        self.kv_norm = DraftRMSNorm(s.head_dim, eps=s.rms_eps)
        self.heads_per_group = s.num_heads // s.o_groups
        self.wo_a = linear(
            self.heads_per_group * s.head_dim, s.o_groups * s.o_lora_rank, prefix=f"{prefix}.wo_a"
        )
        self.wo_b = linear(s.o_groups * s.o_lora_rank, s.hidden_size, prefix=f"{prefix}.wo_b")
        # Stored [1, 1, heads, 1], the shape it joins the scores in (loaded from [heads]).
        self.attn_sink = nn.Parameter(
            torch.zeros(1, 1, s.num_heads, 1, dtype=torch.float32), requires_grad=False
        )
        # wo_a runs per group ([G, o_lora, heads_per_group * head_dim]) from a dense copy taken
        # before a platform GEMM method may repack (and free) the linear's own weight.
        self._wo_a_grouped: torch.Tensor | None = None
        quant_method = self.wo_a.quant_method
        original = quant_method.process_weights_after_loading

        def capture_then_process(layer: nn.Module) -> None:
            self.set_wo_a_grouped(_dense_weight(layer))
            original(layer)

        quant_method.process_weights_after_loading = capture_then_process

    def set_wo_a_grouped(self, weight: torch.Tensor) -> None:
        s = self.shape
        weight = weight.reshape(s.o_groups, s.o_lora_rank, self.heads_per_group * s.head_dim)
        self._wo_a_grouped = weight.to(self.wq_b_dtype()).contiguous()

    def wq_b_dtype(self) -> torch.dtype:
        return self.q_norm.weight.dtype

    def forward(
        self, x: torch.Tensor, rope: RopeTables, ctx_kv: torch.Tensor, key_bias: torch.Tensor
    ) -> torch.Tensor:
        """``x [R*N, H]`` block rows (request-major) -> ``[R*N, H]``; ``rope`` at ``[R, N]``,
        ``ctx_kv [R, W, D]`` the gathered ring rows, ``key_bias`` from ``block_key_bias``."""
        s = self.shape
        rows = x.shape[0]
        num_requests, n = rope.cos.shape[:2]
        q_a, kv = self.fused_wqa_wkv(x).split([s.q_lora_rank, s.head_dim], dim=-1)
        q = self.wq_b(self.q_norm(q_a)).view(num_requests, n, s.num_heads, s.head_dim)
        kv = self.kv_norm(kv).view(num_requests, n, 1, s.head_dim)
        # q's heads and the row's latent KV share the row's RoPE: one rotation for both,
        # rounded to x's dtype as upstream's kernels take them.
        q_kv = rope.rotate(torch.cat([unit_rms_norm(q, s.rms_eps), kv], dim=2))
        q, block_kv = q_kv.split([s.num_heads, 1], dim=2)
        # The FP8 round trip hands fp32 back (exact: FP8 values times a power of two, and
        # the bf16 RoPE dims); the concatenation promotes the bf16 ring rows to match.
        block_kv = fp8_nope_roundtrip(block_kv.squeeze(2), s.rope_dim, out_dtype=torch.float32)
        keys = torch.cat([ctx_kv, block_kv], dim=1)  # [R, W+N, D] fp32

        scores = torch.einsum("rnhd,rkd->rnhk", q.float(), keys)
        scores = torch.add(key_bias, scores, alpha=self.scale)  # scale, then mask: one op
        sink = self.attn_sink.expand(num_requests, n, -1, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out = torch.einsum("rnhk,rkd->rnhd", probs, keys).to(x.dtype)
        out = rope.rotate(out, inverse=True)

        assert self._wo_a_grouped is not None, "wo_a weights were never processed"
        grouped = out.reshape(rows, s.o_groups, self.heads_per_group * s.head_dim)
        z = torch.einsum("tgk,gok->tgo", grouped, self._wo_a_grouped)
        return self.wo_b(z.reshape(rows, s.o_groups * s.o_lora_rank))


class DSparkDraftLayer(nn.Module):
    """One DeepSeek-V4 decoder layer of the draft: mHC(attention), mHC(MoE)."""

    def __init__(self, vllm_config: VllmConfig, shape: DSparkDraftShape, prefix: str):
        super().__init__()
        from vllm.model_executor.layers.mhc import MHCPostOp, MHCPreOp

        self.shape = s = shape
        self.attn = DSparkDraftAttention(s, vllm_config.quant_config, f"{prefix}.attn")
        self.ffn = _make_moe(vllm_config, f"{prefix}.ffn")
        self.attn_norm = DraftRMSNorm(s.hidden_size, eps=s.rms_eps)
        self.ffn_norm = DraftRMSNorm(s.hidden_size, eps=s.rms_eps)
        mix = (2 + s.hc_mult) * s.hc_mult
        width = s.hc_mult * s.hidden_size
        for kind in ("attn", "ffn"):
            for name, size in (("fn", (mix, width)), ("base", (mix,)), ("scale", (3,))):
                param = nn.Parameter(torch.empty(size, dtype=torch.float32), requires_grad=False)
                self.register_parameter(f"hc_{kind}_{name}", param)
        self.mhc_pre = MHCPreOp()
        self.mhc_post = MHCPostOp()

    def _mix(self, x: torch.Tensor, kind: str):
        s = self.shape
        return self.mhc_pre(
            residual=x,
            fn=getattr(self, f"hc_{kind}_fn"),
            hc_scale=getattr(self, f"hc_{kind}_scale"),
            hc_base=getattr(self, f"hc_{kind}_base"),
            rms_eps=s.rms_eps,
            hc_pre_eps=s.hc_eps,
            hc_sinkhorn_eps=s.hc_eps,
            hc_post_mult_value=2.0,
            sinkhorn_repeat=s.hc_sinkhorn_iters,
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTables,
        input_ids: torch.Tensor,
        ctx_kv: torch.Tensor,
        key_bias: torch.Tensor,
    ) -> torch.Tensor:
        """``x [R*N, hc, H]`` -> ``[R*N, hc, H]``."""
        post, comb, h = self._mix(x, "attn")
        h = self.attn(self.attn_norm(h), rope, ctx_kv, key_bias)
        x = self.mhc_post(h, x, post, comb)
        post, comb, h = self._mix(x, "ffn")
        h = self.ffn(self.ffn_norm(h), input_ids)
        return self.mhc_post(h, x, post, comb)
