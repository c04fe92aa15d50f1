"""DSpark draft model for DeepSeek-V4, device-agnostic (CPU and GPU run this code).

The draft weights ship inside the target checkpoint under ``mtp.{j}.*``. Per step:

1. ``combine_hidden_states``: ``main_x = main_norm(main_proj(concat(aux)))`` for every
   target row, ``aux`` = the target's hidden states at ``dspark_target_layer_ids``.
2. ``context_kv``: every draft layer projects the same ``main_x`` into its latent KV,
   ``RoPE_last64(kv_norm(wkv(main_x)))`` at the row's absolute position -> ``[T, K, 512]``.
   The proposer stores the accepted rows in per-request rings (``vllm.v1.spec_decode.dspark.rings``).
3. ``forward``: one backbone pass over the block ``[anchor, noise x (N-1)]`` at positions
   ``p .. p+N-1`` of every request. Each layer is a DeepSeek-V4 layer: hyper-connection
   mixing (mHC) around attention and MoE. Attention queries see the request's valid
   context window (``window_mask``) plus the whole block, non-causally, with a per-head
   attention sink; q has a weightless per-head RMSNorm and RoPE on its last 64 dims; the
   output is de-rotated and projected by the grouped ``wo_a`` then ``wo_b``.
   ``hc_head`` reduces the hc streams -> pre-norm head hidden ``[R, N, H]``.
4. ``compute_logits`` = shared target LM head over ``norm(h)``; the Markov head and the
   confidence head run on top (``markov``).

Built from vLLM's layers (``ReplicatedLinear``, ``RMSNorm``, mHC custom ops, the
platform's DeepSeek-V4 MoE, ``DSparkMarkovHead`` / ``DSparkConfidenceHead``) so the same
code loads bf16 weights on CPU and FP8 checkpoints where vLLM's quant config applies.
The attention itself is plain torch over a private per-request ring, not vLLM's paged
KV cache: the CPU sparse-MLA kernel reads only the paged fp8_ds_mla layout, and the
draft's KV is keyed by request id (see ``vllm/v1/spec_decode/dspark/proposer.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import regex as re
import torch
import torch.nn as nn
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.qwen3_dspark import (
    DSparkConfidenceHead,
    DSparkMarkovHead,
)
from vllm.model_executor.models.utils import maybe_prefix
from vllm.models.deepseek_v4.common.dspark.config import (
    DSparkDraftShape,
    draft_block_positions,
    draft_hf_config,
    draft_noise_token_id,
)
from vllm.models.deepseek_v4.common.dspark.layers import (
    DraftRMSNorm,
    DraftRope,
    DSparkDraftLayer,
    block_key_bias,
    fp8_nope_roundtrip,
    stacked_projection,
)
from vllm.models.deepseek_v4.common.rope import build_deepseek_v4_rope

logger = init_logger(__name__)

__all__ = [
    "DSparkDeepseekV4Draft",
    "DSparkDraftShape",
    "DraftContext",
    "draft_block_positions",
    "draft_hf_config",
    "draft_noise_token_id",
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
    ``slots[r]``; ``mask [R, W]`` (from ``vllm.v1.spec_decode.dspark.context_store.window_mask``) says which cells
    hold context the block may attend.
    """

    caches: Sequence[torch.Tensor]
    slots: torch.Tensor
    mask: torch.Tensor


_STAGE = re.compile(r"^mtp\.(\d+)\.(.+)$")
_HEAD_PARAMS = ("norm.", "hc_head_fn", "hc_head_base", "hc_head_scale", "markov_head.")
_EXPERT_SCALE = re.compile(r"\.experts\.\d+\.w[123]\.scale$")
_FUSED_EXPERT_PARAM = re.compile(
    r"^(layers\.\d+\.ffn)\.experts\..*\b(w13|w2)_(weight(?:_scale(?:_inv)?)?)$"
)


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
        refuse_native_mega_moe(vllm_config)
        self.num_redundant_experts = int(
            vllm_config.parallel_config.eplb_config.num_redundant_experts
        )
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
        self.context_wkv_proj = stacked_projection(
            s.hidden_size,
            [s.head_dim] * s.num_draft_layers,
            quant_config,
            f"{base}.context_wkv_proj",
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
            [layer.attn.kv_norm(kv) for layer, kv in zip(self.layers, per_layer.unbind(1), strict=True)],
            dim=1,
        )
        kv = self.rope.at(positions).rotate(kv, out_dtype=torch.float32)
        return fp8_nope_roundtrip(kv, s.rope_dim, out_dtype=main_x.dtype)

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
        """Checkpoint ``mtp.{j}.*`` name -> parameter name here (None: not the draft's).

        As upstream: the name is mapped first, then every block-FP8 ``.scale`` becomes
        ``.weight_scale_inv`` (``.weight_scale`` for MXFP4 routed experts), head-stack
        weights included (``mtp.0.main_proj.scale`` -> ``main_proj.weight_scale_inv``).
        """
        m = _STAGE.match(name)
        if m is None:
            return None
        stage, rest = int(m.group(1)), m.group(2)
        if stage >= len(self.layers):
            return None
        if rest.startswith("confidence_head.") and self.confidence_head is None:
            return None
        if rest.endswith(".scale"):
            expert = _EXPERT_SCALE.search(rest)
            fp4 = getattr(self.config, "expert_dtype", "fp4") == "fp4"
            suffix = ".weight_scale" if expert and fp4 else ".weight_scale_inv"
            rest = rest.removesuffix(".scale") + suffix
        if rest.startswith(("main_proj.", "main_norm.", "confidence_head.", *_HEAD_PARAMS)):
            return rest
        rest = rest.replace(".shared_experts.w2.", ".shared_experts.down_proj.")
        if rest == "ffn.gate.bias":
            rest = "ffn.gate.e_score_correction_bias"
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
        """Load the ``mtp.*`` tensors; every draft parameter must be written.

        vLLM tracks unwritten parameters only for unquantised models, so for an FP8/MXFP4
        checkpoint a tensor missing from the files would leave a parameter as
        ``torch.empty`` without notice: the check here names what was never written.
        """
        from vllm.model_executor.layers.fused_moe import fused_moe_make_expert_params_mapping

        expert_mapping = fused_moe_make_expert_params_mapping(
            self,
            ckpt_gate_proj_name="w1",
            ckpt_down_proj_name="w2",
            ckpt_up_proj_name="w3",
            num_experts=self.config.n_routed_experts,
            num_redundant_experts=self.num_redundant_experts,
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
        seen_experts: set[str] = set()
        saw_confidence = False
        for ckpt_name, tensor in weights:
            name = self._map_name(ckpt_name)
            if name is None:
                continue
            saw_confidence |= name.startswith("confidence_head.")
            if ".ffn.experts." in name:
                seen_experts.add(name)
                loaded |= self._load_expert(ckpt_name, name, tensor, params, expert_mapping)
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
                        param = self._param(params, ckpt_name, target)
                        param.weight_loader(param, tensor, target_shard)
                        loaded.add(target)
                    break
            else:
                param = self._param(params, ckpt_name, name)
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
        missing = sorted(set(dict(self.named_parameters())) - loaded)
        missing += sorted(self._expected_expert_tensors() - seen_experts)
        if missing:
            more = len(missing) - 8
            shown = ", ".join(missing[:8]) + (f" and {more} more" if more > 0 else "")
            last = len(self.layers) - 1
            raise ValueError(
                f"DSpark draft: the checkpoint wrote nothing to {len(missing)} parameter(s): "
                f"{shown} (a {last + 1}-stage draft expects mtp.0..mtp.{last})"
            )
        return loaded

    def _expected_expert_tensors(self) -> set[str]:
        """Every routed expert's tensors (mapped names), from the fused expert parameters.

        A fused parameter is written by any of its experts, so each expert is checked on
        its own: the checkpoint must hold every expert, local to this rank or not.
        """
        expected = set()
        for name, _ in self.named_parameters():
            m = _FUSED_EXPERT_PARAM.match(name)
            if m is None:
                continue
            ffn, fused, suffix = m.groups()
            for expert in range(self.config.n_routed_experts):
                for proj in ("w1", "w3") if fused == "w13" else ("w2",):
                    expected.add(f"{ffn}.experts.{expert}.{proj}.{suffix}")
        return expected

    @staticmethod
    def _param(params: dict[str, nn.Parameter], ckpt_name: str, name: str) -> nn.Parameter:
        if name not in params:
            raise ValueError(
                f"checkpoint weight {ckpt_name!r} maps to {name!r}, which the DSpark draft "
                "does not have"
            )
        return params[name]

    @staticmethod
    def _load_expert(ckpt_name, name, tensor, params, expert_mapping) -> set[str]:
        """One routed expert's tensor into its fused parameter; set of what was written.

        With expert parallelism the loader of a non-local expert returns False: skipped,
        as upstream. Only a name that no mapping matches is an error.
        """
        if "weight_scale" in name and tensor.dtype == torch.float8_e8m0fnu:
            tensor = tensor.view(torch.uint8)
        matched = False
        for param_name, weight_name, expert_id, shard_id in expert_mapping:
            if weight_name not in name:
                continue
            matched = True
            target = name.replace(weight_name, param_name)
            param = DSparkDeepseekV4Draft._param(params, ckpt_name, target)
            if param.weight_loader(
                param, tensor, target, shard_id=shard_id, expert_id=expert_id, return_success=True
            ):
                return {target}
        if not matched:
            raise ValueError(f"no expert parameter for checkpoint weight {ckpt_name!r}")
        return set()


def refuse_native_mega_moe(vllm_config: VllmConfig) -> None:
    """The draft's MoE is vLLM's fused MoE; DeepGEMM MegaMoE needs other parameters.

    Upstream loads MegaMoE experts with its own mapping and a finalize step that this
    draft does not have, so such a backend is refused before any weight is read.
    """
    from vllm.config.kernel import NATIVE_MEGA_MOE_BACKENDS

    kernel_config = getattr(vllm_config, "kernel_config", None)
    backend = getattr(kernel_config, "moe_backend", None)
    if backend in NATIVE_MEGA_MOE_BACKENDS:
        raise ValueError(
            f"moe_backend={backend!r} is not supported with the overlay's DSpark draft "
            f"(speculative.runner=overlay); use another MoE backend (not one of "
            f"{sorted(NATIVE_MEGA_MOE_BACKENDS)}) or speculative.runner=upstream"
        )


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
