"""The DSpark draft's building blocks: RoPE tables, FP8 round trip, norms, attention, layer.

One DeepSeek-V4 draft layer is hyper-connection mixing (mHC) around a latent attention and
the platform's MoE. The attention reads a request's ring context (``vllm.v1.spec_decode.dspark.rings``) plus
the whole block, non-causally, with a per-head sink; q gets a weightless RMSNorm and RoPE
on its last 64 dims, the output is de-rotated and projected by the grouped ``wo_a`` then
``wo_b``. Every piece here runs once per layer per step, so each is written for few tensor
ops (the step is graph-capturable on a GPU and eager on CPU); the model around them, its
weight loading and its heads are in ``model.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    """GPT-J RoPE at some positions as pair tables over a whole head, for one pass.

    For positions of shape ``P``: ``cos`` fp32 ``[*P, 1, D/2, 1]`` (one entry per dim
    pair, broadcast over heads) and ``sin3`` ``[*P, 1, D/2, 3]`` = ``(-s, s, -s)``:
    ``[..., :2]`` is the signed sin ``(-s, s)`` and ``[..., 1:]`` its inverse ``(s, -s)``,
    so that a pair ``(x0, x1)`` becomes ``(x0 c - x1 s, x1 c + x0 s)``. The non-RoPE
    pairs (the first ``D - rope_dim`` dims) have ``c = 1, s = 0`` and pass through
    unchanged, so one multiply-add covers the head without slicing. Every draft layer
    shares one rotary (same config), so a block (or a context chunk) looks its tables up
    once and q, kv and the output de-rotation of all layers reuse them; each direction's
    view is taken on first use (context KV is never de-rotated). Same arithmetic as
    upstream's ``forward_native`` (fp32 products and sum), equal bit for bit on finite
    inputs.
    """

    cos: torch.Tensor
    sin3: torch.Tensor
    _signed: dict[bool, torch.Tensor] = field(default_factory=dict)

    def rotate(
        self, x: torch.Tensor, inverse: bool = False, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """``x [*P, heads, D]`` rotated (``inverse``: de-rotated, i.e. ``-s``).

        The result is in ``out_dtype`` (default: x's dtype); fp32 skips the final cast
        for a caller that goes on in fp32.
        """
        if inverse not in self._signed:
            self._signed[inverse] = self.sin3[..., 1:] if inverse else self.sin3[..., :2]
        pairs = x.unflatten(-1, (-1, 2))
        swapped = pairs.flip(-1) * self._signed[inverse]
        rotated = (pairs * self.cos + swapped).flatten(-2)
        out_dtype = x.dtype if out_dtype is None else out_dtype
        return rotated if rotated.dtype == out_dtype else rotated.to(out_dtype)


class DraftRope(nn.Module):
    """The draft's RoPE pair tables at every position it serves, built once at load.

    Rows are taken from the rotary's fp32 ``cos_sin_cache`` (upstream's values) for
    positions ``[0, num_positions)``: the model's ``max_model_len`` (context positions
    stay below it, block positions are clamped to it), not the rotary's full range.
    Only the ``rope_dim / 2`` rotating pairs are stored (512 bytes per position); a
    lookup pads the pass-through pairs, six ops per pass instead of building the tables
    from the cache every time.
    """

    def __init__(self, rotary_emb: nn.Module, head_dim: int, num_positions: int) -> None:
        super().__init__()
        cos_sin = rotary_emb.cos_sin_cache[:num_positions].float()
        cos, sin = cos_sin.chunk(2, dim=-1)  # [P, rope_dim / 2]
        self.num_positions = cos_sin.shape[0]
        self.pass_pairs = (head_dim - rotary_emb.rotary_dim) // 2
        self.register_buffer("cos", cos[:, None, :, None].contiguous(), persistent=False)
        # (-s, s, -s): [..., :2] is the signed sin, [..., 1:] its inverse.
        sin3 = torch.stack((-sin, sin, -sin), dim=-1)[:, None].contiguous()
        self.register_buffer("sin3", sin3, persistent=False)

    def at(self, positions: torch.Tensor) -> RopeTables:
        """Tables for ``positions`` (any shape, values in ``[0, num_positions)``)."""
        pad = (0, 0, self.pass_pairs, 0)
        cos = torch.nn.functional.pad(self.cos[positions], pad, value=1.0)
        sin3 = torch.nn.functional.pad(self.sin3[positions], pad, value=0.0)
        return RopeTables(cos=cos, sin3=sin3)


def block_key_bias(window_mask: torch.Tensor, block_len: int) -> torch.Tensor:
    """fp32 ``[R, 1, 1, W+N]`` added to every block query's scores, built once per pass.

    Keys are the W ring cells (``window_mask [R, W]`` True where valid: 0, else -inf)
    then the N block rows, which every block query attends (non-causal: 0).
    """
    bias = torch.where(window_mask, 0.0, float("-inf"))
    bias = torch.nn.functional.pad(bias, (0, block_len), value=0.0)
    return bias.view(window_mask.shape[0], 1, 1, -1)


_NOPE_BLOCK_MASKS: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _nope_blocks(num_blocks: int, nope_blocks: int, device: torch.device) -> torch.Tensor:
    """``[num_blocks, 1]`` bool, True for the FP8 blocks; one constant per device."""
    key = (num_blocks, nope_blocks, device)
    if key not in _NOPE_BLOCK_MASKS:
        mask = torch.arange(num_blocks, device=device)[:, None] < nope_blocks
        _NOPE_BLOCK_MASKS[key] = mask
    return _NOPE_BLOCK_MASKS[key]


def fp8_nope_roundtrip(
    kv: torch.Tensor, rope_dim: int, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Quantise-dequantise the non-RoPE dims the way the fp8_ds_mla KV cache stores them.

    The target (and upstream's draft) keep the first ``head_dim - rope_dim`` dims of the
    latent KV as FP8 e4m3 with one power-of-two (UE8M0) scale per 64 dims and the RoPE
    dims in bf16. Applying the same round trip to the private draft ring keeps the
    draft's attention inputs equal to what it was trained against. ``kv`` may be fp32
    (straight from RoPE): the FP8 dims are computed from it, the result (RoPE dims
    included) is rounded once to ``out_dtype`` (default: kv's dtype). The whole head is
    cut into 64-dim blocks and the RoPE blocks are taken back unchanged, which costs one
    select instead of a slice and a concatenation.
    """
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
    """Weightless RMSNorm over the last dim: fp32 statistics, result in x's dtype.

    torch's single ``rms_norm`` op computes ``x * rsqrt(mean(x^2) + eps)`` in fp32 for a
    bf16 input and casts back, the arithmetic of vLLM's eager ``rms_norm`` in one op
    instead of seven.
    """
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), None, eps)


class DraftRMSNorm(RMSNorm):
    """vLLM's RMSNorm with a one-op eager path for the draft, which runs every step.

    Where vLLM dispatches to its fused kernel nothing changes. Its eager path
    (``forward_native``: CPU, or a GPU without the custom op) is nine tensor ops;
    torch's ``rms_norm`` with the weight is one. It applies the weight in fp32 and
    rounds once, where vLLM's eager path rounds the normalised x to x's dtype first:
    results agree to one rounding step of x's dtype (tested).
    """

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None or self.variance_size_override is not None:
            return super().forward_native(x, residual)
        if not self.has_weight:
            return unit_rms_norm(x, self.variance_epsilon)
        if self.weight.dtype != x.dtype:
            return super().forward_native(x, residual)
        return torch.nn.functional.rms_norm(
            x, (x.shape[-1],), self.weight, self.variance_epsilon
        )


def _dense_weight(layer: nn.Module) -> torch.Tensor:
    """A linear layer's weight as a float32 [out, in] matrix, its FP8 scales applied.

    Block-FP8 scales cover ``layer.weight_block_size`` blocks (the last row/column of
    blocks may be partial); the block is read from the layer, never inferred from the
    shapes, which would be wrong whenever a dimension is not a multiple of the block.
    """
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
    """Replicated projections of the same rows as one GEMM, each loaded as a shard.

    Not split across TP ranks (every rank runs the whole draft); the checkpoint's separate
    weights (and their block-FP8 scales) load into their shard with vLLM's loader.
    """
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
    """DeepSeek-V4 latent attention of one draft layer over ring context + block."""

    def __init__(self, shape: DSparkDraftShape, quant_config, prefix: str) -> None:
        super().__init__()
        s = shape
        self.shape = s
        self.scale = s.head_dim**-0.5

        def linear(n_in: int, n_out: int, name: str) -> ReplicatedLinear:
            return ReplicatedLinear(
                n_in,
                n_out,
                bias=False,
                return_bias=False,
                quant_config=quant_config,
                prefix=f"{prefix}.{name}",
            )

        # wq_a and wkv read the same rows: one GEMM, as upstream's ``fused_wqa_wkv``.
        self.fused_wqa_wkv = stacked_projection(
            s.hidden_size, [s.q_lora_rank, s.head_dim], quant_config, f"{prefix}.fused_wqa_wkv"
        )
        self.q_norm = DraftRMSNorm(s.q_lora_rank, eps=s.rms_eps)
        self.wq_b = linear(s.q_lora_rank, s.num_heads * s.head_dim, "wq_b")
        self.kv_norm = DraftRMSNorm(s.head_dim, eps=s.rms_eps)
        self.heads_per_group = s.num_heads // s.o_groups
        self.wo_a = linear(self.heads_per_group * s.head_dim, s.o_groups * s.o_lora_rank, "wo_a")
        self.wo_b = linear(s.o_groups * s.o_lora_rank, s.hidden_size, "wo_b")
        # Stored [1, 1, heads, 1], the shape it joins the scores in (loaded from [heads]).
        self.attn_sink = nn.Parameter(
            torch.zeros(1, 1, s.num_heads, 1, dtype=torch.float32), requires_grad=False
        )
        # wo_a is applied per group ([G, o_lora, heads_per_group * head_dim]); the
        # dense copy is taken when weights are processed, before a platform GEMM
        # method may repack (and free) the linear's own weight.
        self._wo_a_grouped: torch.Tensor | None = None
        quant_method = self.wo_a.quant_method
        original = quant_method.process_weights_after_loading

        def capture_then_process(layer: nn.Module) -> None:
            self.set_wo_a_grouped(_dense_weight(layer))
            original(layer)

        quant_method.process_weights_after_loading = capture_then_process

    def set_wo_a_grouped(self, weight: torch.Tensor) -> None:
        s = self.shape
        self._wo_a_grouped = (
            weight.reshape(s.o_groups, s.o_lora_rank, self.heads_per_group * s.head_dim)
            .to(self.wq_b_dtype())
            .contiguous()
        )

    def wq_b_dtype(self) -> torch.dtype:
        return self.q_norm.weight.dtype

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTables,
        ctx_kv: torch.Tensor,
        key_bias: torch.Tensor,
    ) -> torch.Tensor:
        """``x [R*N, H]`` block rows (request-major) -> attention output ``[R*N, H]``.

        ``rope`` holds the block's RoPE tables at positions ``[R, N]``, ``ctx_kv [R, W,
        D]`` the gathered ring rows, ``key_bias [R, 1, 1, W+N]`` (``block_key_bias``) 0 for
        the keys a request's queries attend, -inf for its context cells outside the valid
        window (the N block keys are always attended).
        """
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

        s = shape
        self.shape = s
        self.attn = DSparkDraftAttention(s, vllm_config.quant_config, f"{prefix}.attn")
        self.ffn = _make_moe(vllm_config, f"{prefix}.ffn")
        self.attn_norm = DraftRMSNorm(s.hidden_size, eps=s.rms_eps)
        self.ffn_norm = DraftRMSNorm(s.hidden_size, eps=s.rms_eps)
        mix = (2 + s.hc_mult) * s.hc_mult
        width = s.hc_mult * s.hidden_size
        for kind in ("attn", "ffn"):
            self.register_parameter(
                f"hc_{kind}_fn",
                nn.Parameter(torch.empty(mix, width, dtype=torch.float32), requires_grad=False),
            )
            self.register_parameter(
                f"hc_{kind}_base",
                nn.Parameter(torch.empty(mix, dtype=torch.float32), requires_grad=False),
            )
            self.register_parameter(
                f"hc_{kind}_scale",
                nn.Parameter(torch.empty(3, dtype=torch.float32), requires_grad=False),
            )
        self.mhc_pre = MHCPreOp()
        self.mhc_post = MHCPostOp()

    def _mix(self, x: torch.Tensor, kind: str):
        s = self.shape
        post, comb, layer_input = self.mhc_pre(
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
        return layer_input, post, comb

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTables,
        input_ids: torch.Tensor,
        ctx_kv: torch.Tensor,
        key_bias: torch.Tensor,
    ) -> torch.Tensor:
        """``x [R*N, hc, H]`` -> ``[R*N, hc, H]``."""
        h, post, comb = self._mix(x, "attn")
        h = self.attn(self.attn_norm(h), rope, ctx_kv, key_bias)
        x = self.mhc_post(h, x, post, comb)
        h, post, comb = self._mix(x, "ffn")
        h = self.ffn(self.ffn_norm(h), input_ids)
        return self.mhc_post(h, x, post, comb)
