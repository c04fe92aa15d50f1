"""DSpark draft model for DeepSeek-V4 (the checkpoint's ``mtp.{j}.*`` weights), CPU and GPU.

Built from vLLM's layers so FP8 checkpoints load with its quant config; the attention is plain
torch over a private ring keyed by request id (the CPU sparse-MLA kernel reads only the paged
layout). The step it serves (ingest, block pass, Markov head) is in overlay/README.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial

import regex as re
import torch
import torch.nn as nn
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.qwen3_dspark import DSparkConfidenceHead, DSparkMarkovHead
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
    """Zero-pad ``tensor`` along ``dim`` to ``local_size * tp_size`` rows (upstream's
    ``_pad_shared_expert_weight``): block-FP8 shared experts split in whole 128-blocks, so TP
    shares round up and the standard loaders slice the padded tensor evenly."""
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
    """What the block attention reads besides the block: layer j's ring ``caches[j] [S, W, D]``,
    request r's ring row ``slots[r]`` and ``mask [R, W]`` (``window_mask``), the cells to attend."""

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
    ``embed_tokens`` and ``lm_head`` are the target's (``share_target_heads``)."""

    has_own_embed_tokens = False
    has_own_lm_head = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        from vllm.model_executor.layers.mhc import HCHeadOp

        self.config = hf = draft_hf_config(vllm_config)
        self.shape = s = DSparkDraftShape.from_hf_config(hf)
        refuse_native_mega_moe(vllm_config)
        self.num_redundant_experts = int(
            vllm_config.parallel_config.eplb_config.num_redundant_experts
        )
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
        # Plain RoPE (pure sliding-window layers: no YaRN), the same for every layer.
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
        # Every layer's wkv as one GEMM over the context rows (loaded from each ``attn.wkv``).
        sizes = [s.head_dim] * s.num_draft_layers
        self.context_wkv_proj = stacked_projection(
            s.hidden_size, sizes, quant_config, f"{base}.context_wkv_proj"
        )
        self.norm = DraftRMSNorm(s.hidden_size, eps=s.rms_eps)
        width = s.hc_mult * s.hidden_size
        for name, size in (("fn", (s.hc_mult, width)), ("base", (s.hc_mult,)), ("scale", (1,))):
            param = nn.Parameter(torch.empty(size, dtype=torch.float32), requires_grad=False)
            self.register_parameter(f"hc_head_{name}", param)
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

    def share_target_heads(self, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        """Alias the target's token embedding and LM head (frozen, shared)."""
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head

    def combine_hidden_states(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """``[T, m*H]`` concatenated target aux hidden states -> ``main_x [T, H]``."""
        return self.main_norm(self.main_proj(aux_hidden_states))

    def context_kv(self, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Context KV of every draft layer for rows ``main_x [T, H]``: ``[T, K, D]``."""
        s = self.shape
        if main_x.shape[0] == 0:
            return main_x.new_empty((0, len(self.layers), s.head_dim))
        per_layer = self.context_wkv_proj(main_x).view(-1, len(self.layers), s.head_dim)
        layer_kv = zip(self.layers, per_layer.unbind(1), strict=True)
        kv = torch.stack([layer.attn.kv_norm(kv) for layer, kv in layer_kv], dim=1)
        kv = self.rope.at(positions).rotate(kv, out_dtype=torch.float32)
        return fp8_nope_roundtrip(kv, s.rope_dim, out_dtype=main_x.dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, context: DraftContext
    ) -> torch.Tensor:
        """Block pass: ``input_ids``/``positions`` ``[R, N]`` -> the pre-norm ``hc_head`` output
        ``[R, N, H]`` the confidence head reads (``compute_logits`` applies ``norm``)."""
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
        x = self.embed_tokens(flat_ids).unsqueeze(1).repeat(1, s.hc_mult, 1)
        slots = context.slots if context.slots.dtype == torch.int64 else context.slots.long()
        for layer, cache in zip(self.layers, context.caches, strict=True):
            x = layer(x, rope, flat_ids, cache.index_select(0, slots), key_bias)
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
        """``W2 e`` ``[B, V]`` as one GEMM on the head's plain ``[V (+pad), r]`` weight: upstream's
        route through the logits processor only adds a slice, and this runs once per slot."""
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

    def _map_name(self, name: str) -> str | None:
        """Checkpoint ``mtp.{j}.*`` name -> parameter name here (None: not the draft's); as
        upstream, ``.scale`` -> ``.weight_scale_inv`` (``.weight_scale``: MXFP4 routed experts)."""
        m = _STAGE.match(name)
        if m is None or int(m.group(1)) >= len(self.layers):
            return None
        stage, rest = int(m.group(1)), m.group(2)
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
        proj = "down_proj" if down else "gate_up_proj"
        module = self.get_submodule(f"{name.split('.shared_experts.')[0]}.shared_experts.{proj}")
        param = getattr(module, name.rsplit(".", 1)[-1], None)
        if param is None or param.dim() < 2 or tensor.dim() < 2:
            return tensor
        tp_size = int(getattr(module, "tp_size", 1))
        if down:  # [H, I]: intermediate on dim 1
            return pad_to_tp_shards(tensor, 1, param.shape[1], tp_size)
        return pad_to_tp_shards(tensor, 0, param.shape[0] // 2, tp_size)  # [2 * I, H] merged

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the ``mtp.*`` tensors and name any parameter never written (vLLM checks that
        only for unquantised models: a missing FP8/MXFP4 tensor would stay ``torch.empty``)."""
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
                    param.data.copy_(tensor[: param.numel()].to(param.dtype).view(param.shape))
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
        """Mapped names of every routed expert's tensors, local to this rank or not: any one
        expert writes a fused parameter, so each expert is checked on its own."""
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
        """One routed expert's tensor into its fused parameter; returns what was written (a
        non-local expert under EP is skipped, as upstream; only an unmatched name raises)."""
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
    """Refuse DeepGEMM MegaMoE before any weight is read: upstream loads its experts with a
    mapping and finalize step this draft (vLLM's fused MoE) does not have."""
    from vllm.config.kernel import NATIVE_MEGA_MOE_BACKENDS

    backend = getattr(getattr(vllm_config, "kernel_config", None), "moe_backend", None)
    if backend in NATIVE_MEGA_MOE_BACKENDS:
        raise ValueError(
            f"moe_backend={backend!r} is not supported with the overlay's DSpark draft "
            f"(speculative.runner=overlay); use another MoE backend (not one of "
            f"{sorted(NATIVE_MEGA_MOE_BACKENDS)}) or speculative.runner=upstream"
        )


def load_dspark_draft(vllm_config: VllmConfig) -> DSparkDeepseekV4Draft:
    """Build and load this overlay's draft with vLLM's model loader, on every platform.
    The class is named, not the registry's ``DSparkDraftModel`` (on CUDA upstream's V2-only
    class, without rings); the loader does the rest (device, dtype, weights, post-processing)."""
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model

    spec = vllm_config.speculative_config
    if spec is None or spec.draft_model_config is None:
        raise ValueError("load_dspark_draft needs vllm_config.speculative_config.draft_model_config")
    loader = get_model_loader(vllm_config.load_config)
    loader.create_model = partial(initialize_model, model_class=DSparkDeepseekV4Draft)
    return loader.load_model(vllm_config=vllm_config, model_config=spec.draft_model_config)
