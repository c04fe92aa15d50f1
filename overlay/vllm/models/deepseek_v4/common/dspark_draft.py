"""DSpark draft model for DeepSeek-V4, device-agnostic (CPU and GPU run this code).

The draft weights ship inside the target checkpoint under ``mtp.{j}.*``. Per step:

1. ``combine_hidden_states``: ``main_x = main_norm(main_proj(concat(aux)))`` for every
   target row, ``aux`` = the target's hidden states at ``dspark_target_layer_ids``.
2. ``context_kv``: every draft layer projects the same ``main_x`` into its latent KV,
   ``RoPE_last64(kv_norm(wkv(main_x)))`` at the row's absolute position -> ``[T, K, 512]``.
   The proposer stores the accepted rows in per-request rings (``dspark_ragged``).
3. ``forward``: one backbone pass over the block ``[anchor, noise x (N-1)]`` at positions
   ``p .. p+N-1`` of every request. Each layer is a DeepSeek-V4 layer: hyper-connection
   mixing (mHC) around attention and MoE. Attention queries see the request's valid
   context window (``window_mask``) plus the whole block, non-causally, with a per-head
   attention sink; q has a weightless per-head RMSNorm and RoPE on its last 64 dims; the
   output is de-rotated and projected by the grouped ``wo_a`` then ``wo_b``.
   ``hc_head`` reduces the hc streams -> pre-norm head hidden ``[R, N, H]``.
4. ``compute_logits`` = shared target LM head over ``norm(h)``; the Markov head and the
   confidence head run on top (``dspark_markov``).

Built from vLLM's layers (``ReplicatedLinear``, ``RMSNorm``, mHC custom ops, the
platform's DeepSeek-V4 MoE, ``DSparkMarkovHead`` / ``DSparkConfidenceHead``) so the same
code loads bf16 weights on CPU and FP8 checkpoints where vLLM's quant config applies.
The attention itself is plain torch over a private per-request ring, not vLLM's paged
KV cache: the CPU sparse-MLA kernel reads only the paged fp8_ds_mla layout, and the
draft's KV is keyed by request id (see ``vllm/v1/spec_decode/dspark_proposer.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import regex as re
import torch
import torch.nn as nn
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.qwen3_dspark import (
    DSparkConfidenceHead,
    DSparkMarkovHead,
)
from vllm.model_executor.models.utils import maybe_prefix
from vllm.models.deepseek_v4.common.dspark_draft_config import (
    DSparkDraftShape,
    draft_block_positions,
    draft_hf_config,
    draft_noise_token_id,
)
from vllm.models.deepseek_v4.common.fp8_ds_mla import QUANT_BLOCK, roundtrip_blocks
from vllm.models.deepseek_v4.common.rope import build_deepseek_v4_rope
from vllm.platforms import current_platform

logger = init_logger(__name__)

__all__ = [
    "DSparkDeepseekV4Draft",
    "DSparkDraftShape",
    "DraftContext",
    "RopeTables",
    "block_key_bias",
    "draft_block_positions",
    "draft_hf_config",
    "draft_noise_token_id",
    "fp8_nope_roundtrip",
    "load_dspark_draft",
    "pad_to_tp_shards",
]


def pad_to_tp_shards(tensor: torch.Tensor, dim: int, local_size: int, tp_size: int) -> torch.Tensor:
    """Zero-pad ``tensor`` along ``dim`` to ``local_size * tp_size`` rows.

    Block-FP8 shared experts split their intermediate axis in whole 128-blocks: when the
    block count does not divide by TP, vLLM's DeepSeek-V4 MLP rounds each rank's share up
    and the trailing rank holds zeros (upstream ``_pad_shared_expert_weight``). The
    checkpoint tensor (weight, or its per-block scale) is padded to what the parameter
    expects so the standard TP loaders slice it evenly.
    """
    full = local_size * tp_size
    have = tensor.shape[dim]
    if have > full:
        raise ValueError(
            f"checkpoint tensor has {have} rows on dim {dim}, more than the {tp_size} TP "
            f"shards of {local_size} the parameter holds"
        )
    if have == full:
        return tensor
    pad_shape = list(tensor.shape)
    pad_shape[dim] = full - have
    return torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=dim)


@dataclass
class DraftContext:
    """What the block attention reads besides the block itself.

    ``caches[j]`` is layer j's ring ``[S, W, D]``; request r reads ring row
    ``slots[r]``; ``mask [R, W]`` (from ``dspark_ragged.window_mask``) says which cells
    hold context the block may attend.
    """

    caches: Sequence[torch.Tensor]
    slots: torch.Tensor
    mask: torch.Tensor


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
    """A linear layer's weight as a float32 [out, in] matrix, block-FP8 scales applied."""
    weight = layer.weight.float()
    scale = getattr(layer, "weight_scale_inv", None)
    if scale is None:
        scale = getattr(layer, "weight_scale", None)
    if scale is None or scale.numel() == 0:
        return weight
    scale = scale.float()
    if scale.numel() == 1:
        return weight * scale
    if scale.dim() == 1 or scale.shape[-1] == 1:
        return weight * scale.reshape(-1, 1)
    block_out = -(-weight.shape[0] // scale.shape[0])
    block_in = -(-weight.shape[1] // scale.shape[1])
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
        self.fused_wqa_wkv = MergedColumnParallelLinear(
            s.hidden_size,
            [s.q_lora_rank, s.head_dim],
            bias=False,
            return_bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.fused_wqa_wkv",
            disable_tp=True,
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


_STAGE = re.compile(r"^mtp\.(\d+)\.(.+)$")
_HEAD_PARAMS = ("norm.", "hc_head_fn", "hc_head_base", "hc_head_scale", "markov_head.")


class DSparkDeepseekV4Draft(nn.Module):
    """The whole draft: projection, K decoder layers, head stack, Markov/confidence heads.

    ``embed_tokens`` and ``lm_head`` are the target's (``share_target_heads``); the
    draft checkpoint has none of its own.
    """

    has_own_embed_tokens = False
    has_own_lm_head = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        from vllm.model_executor.layers.mhc import HCHeadOp

        hf = draft_hf_config(vllm_config)
        self.config = hf
        s = DSparkDraftShape.from_hf_config(hf)
        self.shape = s
        quant_config = vllm_config.quant_config
        base = maybe_prefix(prefix, "model")
        self.main_proj = ReplicatedLinear(
            s.hidden_size * len(s.target_layer_ids),
            s.hidden_size,
            bias=False,
            return_bias=False,
            quant_config=quant_config,
            prefix=f"{base}.main_proj",
        )
        self.main_norm = DraftRMSNorm(s.hidden_size, eps=s.rms_eps)
        # Pure sliding-window layers use plain RoPE (no YaRN) on the last rope_dim dims;
        # every draft layer has the same one, so the draft holds it once (RopeTables).
        self.rotary_emb = build_deepseek_v4_rope(
            hf,
            head_dim=s.head_dim,
            rope_head_dim=s.rope_dim,
            max_position_embeddings=s.max_position,
            compress_ratio=1,
        )
        self.rope = DraftRope(
            self.rotary_emb, s.head_dim, int(vllm_config.model_config.max_model_len)
        )
        # Layer ids continue after the target's so registered names never collide.
        self.layers = nn.ModuleList(
            DSparkDraftLayer(vllm_config, s, prefix=f"{base}.layers.{s.num_target_layers + j}")
            for j in range(s.num_draft_layers)
        )
        # Every layer's wkv stacked for the context rows: one GEMM (upstream's
        # ``context_wkv_proj``; loaded from each layer's ``attn.wkv``).
        self.context_wkv_proj = MergedColumnParallelLinear(
            s.hidden_size,
            [s.head_dim] * s.num_draft_layers,
            bias=False,
            return_bias=False,
            quant_config=quant_config,
            prefix=f"{base}.context_wkv_proj",
            disable_tp=True,
        )
        self.norm = DraftRMSNorm(s.hidden_size, eps=s.rms_eps)
        width = s.hc_mult * s.hidden_size
        self.hc_head_fn = nn.Parameter(
            torch.empty(s.hc_mult, width, dtype=torch.float32), requires_grad=False
        )
        self.hc_head_base = nn.Parameter(
            torch.empty(s.hc_mult, dtype=torch.float32), requires_grad=False
        )
        self.hc_head_scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)
        self.hc_head = HCHeadOp()
        self.markov_head = DSparkMarkovHead(
            s.vocab_size, s.vocab_size, s.markov_rank, prefix=f"{base}.markov_head"
        )
        self.confidence_head: DSparkConfidenceHead | None = None
        if s.confidence_head:
            self.confidence_head = DSparkConfidenceHead(
                s.hidden_size + s.markov_rank, prefix=f"{base}.confidence_head"
            )
        self.logits_processor = LogitsProcessor(s.vocab_size)
        self.embed_tokens: nn.Module | None = None
        self.lm_head: nn.Module | None = None

    # --- shared target pieces ------------------------------------------------

    def share_target_heads(self, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        """Alias the target's token embedding and LM head (frozen, shared)."""
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head

    # --- hooks used by the proposer ------------------------------------------

    def combine_hidden_states(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """``[T, m*H]`` concatenated target aux hidden states -> ``main_x [T, H]``."""
        return self.main_norm(self.main_proj(aux_hidden_states))

    def context_kv(self, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Context KV of every draft layer for rows ``main_x [T, H]``: ``[T, K, D]``."""
        s = self.shape
        if main_x.shape[0] == 0:
            return main_x.new_empty((0, len(self.layers), s.head_dim))
        per_layer = self.context_wkv_proj(main_x).view(-1, len(self.layers), s.head_dim)
        kv = torch.stack(
            [layer.attn.kv_norm(kv) for layer, kv in zip(self.layers, per_layer.unbind(1))],
            dim=1,
        )
        kv = self.rope.at(positions).rotate(kv, out_dtype=torch.float32)
        return fp8_nope_roundtrip(kv, s.rope_dim, out_dtype=main_x.dtype)

    def rope_at(self, positions: torch.Tensor) -> RopeTables:
        """RoPE tables of every draft layer at ``positions`` (any shape)."""
        return self.rope.at(positions)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        context: DraftContext,
    ) -> torch.Tensor:
        """Block pass. ``input_ids``/``positions`` ``[R, N]`` -> head hidden ``[R, N, H]``.

        Returns the pre-norm ``hc_head`` output (what the confidence head reads);
        ``compute_logits`` applies ``norm`` and the LM head.
        """
        if self.embed_tokens is None:
            raise RuntimeError("share_target_heads() must be called before forward()")
        num_requests, n = input_ids.shape
        s = self.shape
        if context.mask.shape != (num_requests, context.caches[0].shape[1]):
            raise ValueError(
                f"context.mask must be [R, W] = [{num_requests}, {context.caches[0].shape[1]}], "
                f"got {tuple(context.mask.shape)}"
            )
        flat_ids = input_ids.reshape(-1)
        rope = self.rope.at(positions)
        key_bias = block_key_bias(context.mask, n)
        x = self.embed_tokens(flat_ids)
        x = x.unsqueeze(1).repeat(1, s.hc_mult, 1)
        slots = context.slots if context.slots.dtype == torch.int64 else context.slots.long()
        for layer, cache in zip(self.layers, context.caches, strict=True):
            ctx_kv = cache.index_select(0, slots)
            x = layer(x, rope, flat_ids, ctx_kv, key_bias)
        h = self.hc_head(
            x, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, s.rms_eps, s.hc_eps
        )
        return h.view(num_requests, n, s.hidden_size)

    def compute_logits(self, head_hidden: torch.Tensor) -> torch.Tensor:
        """Base logits ``U = lm_head(norm(h))`` over the full (target) vocabulary."""
        if self.lm_head is None:
            raise RuntimeError("share_target_heads() must be called before compute_logits()")
        lead = head_hidden.shape[:-1]
        logits = self.logits_processor(
            self.lm_head, self.norm(head_hidden.reshape(-1, head_hidden.shape[-1]))
        )
        return logits.view(*lead, logits.shape[-1])

    def markov_embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_head.embed(token_ids)

    def markov_bias(self, markov_embed: torch.Tensor) -> torch.Tensor:
        """``W2 e`` ``[B, V]``: one GEMM on the Markov head's weight.

        The head is built unquantized and replicated (as upstream), its weight a plain
        ``[V, r]`` matrix (rows past V pad the vocabulary). Upstream sends it through the
        logits processor, which adds nothing here but a slice; this runs four times per
        block, so it is the GEMM alone.
        """
        weight = self.markov_head.markov_w2.weight
        vocab = self.shape.vocab_size
        if weight.shape[0] != vocab:
            weight = weight[:vocab]
        return torch.nn.functional.linear(markov_embed, weight)

    def compute_confidence(
        self, head_hidden: torch.Tensor, markov_embed: torch.Tensor
    ) -> torch.Tensor | None:
        """``sigmoid(w . [h_k ; e_k])`` per slot, or None without a confidence head."""
        if self.confidence_head is None:
            return None
        lead = head_hidden.shape[:-1]
        logit = self.confidence_head(
            head_hidden.reshape(-1, head_hidden.shape[-1]),
            markov_embed.reshape(-1, markov_embed.shape[-1]).to(head_hidden.dtype),
        )
        return torch.sigmoid(logit).view(*lead)

    # --- weights -------------------------------------------------------------

    def _map_name(self, name: str) -> str | None:
        """Checkpoint ``mtp.{j}.*`` name -> parameter name here (None: not the draft's)."""
        m = _STAGE.match(name)
        if m is None:
            return None
        stage, rest = int(m.group(1)), m.group(2)
        if stage >= len(self.layers):
            return None
        if rest.startswith(("main_proj.", "main_norm.", "confidence_head.")) or rest.startswith(
            _HEAD_PARAMS
        ):
            if rest.startswith("confidence_head.") and self.confidence_head is None:
                return None
            return rest
        rest = rest.replace(".shared_experts.w2.", ".shared_experts.down_proj.")
        if rest == "ffn.gate.bias":
            rest = "ffn.gate.e_score_correction_bias"
        if rest.endswith(".scale") and not rest.startswith("hc_"):
            expert = re.search(r"\.experts\.\d+\.w[123]\.scale$", rest)
            fp4 = getattr(self.config, "expert_dtype", "fp4") == "fp4"
            suffix = ".weight_scale" if expert and fp4 else ".weight_scale_inv"
            rest = rest.removesuffix(".scale") + suffix
        return f"layers.{stage}.{rest}"

    def _pad_shared_expert(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Pad a shared-expert tensor's intermediate axis to the parameter's TP shards."""
        down = ".shared_experts.down_proj." in name
        module_name = (
            name.split(".shared_experts.")[0]
            + (".shared_experts.down_proj" if down else ".shared_experts.gate_up_proj")
        )
        module = self.get_submodule(module_name)
        param_name = name.rsplit(".", 1)[-1]
        param = getattr(module, param_name, None)
        if param is None or param.dim() < 2 or tensor.dim() < 2:
            return tensor
        tp_size = int(getattr(module, "tp_size", 1))
        if down:  # [H, I]: intermediate on dim 1
            return pad_to_tp_shards(tensor, 1, param.shape[1], tp_size)
        return pad_to_tp_shards(tensor, 0, param.shape[0] // 2, tp_size)  # [2 * I, H] merged

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from vllm.model_executor.layers.fused_moe import fused_moe_make_expert_params_mapping

        expert_mapping = fused_moe_make_expert_params_mapping(
            self,
            ckpt_gate_proj_name="w1",
            ckpt_down_proj_name="w2",
            ckpt_up_proj_name="w3",
            num_experts=self.config.n_routed_experts,
        )
        # (checkpoint needle, merged parameter, shard) of the weights loaded as shards.
        stacked = (
            (".shared_experts.w1.", ".shared_experts.gate_up_proj.", 0),
            (".shared_experts.w3.", ".shared_experts.gate_up_proj.", 1),
            (".attn.wq_a.", ".attn.fused_wqa_wkv.", 0),
            (".attn.wkv.", ".attn.fused_wqa_wkv.", 1),
        )
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        saw_confidence = False
        for ckpt_name, tensor in weights:
            name = self._map_name(ckpt_name)
            if name is None:
                continue
            saw_confidence |= name.startswith("confidence_head.")
            if ".ffn.experts." in name:
                if "weight_scale" in name and tensor.dtype == torch.float8_e8m0fnu:
                    tensor = tensor.view(torch.uint8)
                for param_name, weight_name, expert_id, shard_id in expert_mapping:
                    if weight_name not in name:
                        continue
                    target = name.replace(weight_name, param_name)
                    param = params[target]
                    if param.weight_loader(
                        param,
                        tensor,
                        target,
                        shard_id=shard_id,
                        expert_id=expert_id,
                        return_success=True,
                    ):
                        loaded.add(target)
                        break
                else:
                    raise ValueError(f"no expert parameter for checkpoint weight {ckpt_name!r}")
                continue
            if ".shared_experts." in name:
                tensor = self._pad_shared_expert(name, tensor)
            for needle, merged, shard in stacked:
                if needle in name:
                    targets = [(name.replace(needle, merged), shard)]
                    if needle == ".attn.wkv.":  # also layer j's shard of the context GEMM
                        layer = int(name.split(".")[1])
                        targets.append((f"context_wkv_proj.{name.rsplit('.', 1)[1]}", layer))
                    for target, target_shard in targets:
                        param = params[target]
                        param.weight_loader(param, tensor, target_shard)
                        loaded.add(target)
                    break
            else:
                if name not in params:
                    raise ValueError(
                        f"checkpoint weight {ckpt_name!r} maps to {name!r}, which the DSpark "
                        "draft does not have"
                    )
                param = params[name]
                if name.endswith("attn.attn_sink"):
                    heads = param.numel()
                    param.data.copy_(tensor[:heads].to(param.dtype).view(param.shape))
                else:
                    getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(name)
        if self.confidence_head is not None and not saw_confidence:
            logger.warning("DSpark checkpoint has no confidence head weights; confidence disabled")
            self.confidence_head = None
            loaded = {n for n in loaded if not n.startswith("confidence_head.")}
        return loaded


def load_dspark_draft(vllm_config: VllmConfig) -> DSparkDeepseekV4Draft:
    """Build and load this overlay's draft with vLLM's model loader, on every platform.

    The registry entry ``DSparkDraftModel`` resolves per platform: on CUDA to upstream's
    ``nvidia/dspark.py`` class, which has no private rings (``context_kv``, ``shape``,
    ``share_target_heads``) and serves only vLLM's V2 runner. The overlay's V1 proposer
    therefore names its class explicitly instead of asking the registry; the loader still
    does the rest (device, dtype, weight iteration, ``process_weights_after_loading``).
    """
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model

    spec = vllm_config.speculative_config
    if spec is None or spec.draft_model_config is None:
        raise ValueError("load_dspark_draft needs vllm_config.speculative_config.draft_model_config")
    loader = get_model_loader(vllm_config.load_config)

    def create_overlay_draft(vllm_config, model_config, prefix=""):
        return initialize_model(
            vllm_config=vllm_config,
            model_config=model_config,
            prefix=prefix,
            model_class=DSparkDeepseekV4Draft,
        )

    loader.create_model = create_overlay_draft
    return loader.load_model(vllm_config=vllm_config, model_config=spec.draft_model_config)
