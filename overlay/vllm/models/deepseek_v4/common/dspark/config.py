"""What the DSpark draft reads from the checkpoint config, validated once, and upstream's block
semantics that depend only on it; apart from ``model.py`` so a shape is read without modules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["DSparkDraftShape", "draft_block_positions", "draft_hf_config", "draft_noise_token_id"]


@dataclass(frozen=True)
class DSparkDraftShape:
    """The config fields the draft reads, validated once."""

    hidden_size: int
    vocab_size: int
    num_target_layers: int
    num_draft_layers: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    markov_rank: int
    noise_token_id: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    window: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_eps: float
    max_position: int
    confidence_head: bool

    @classmethod
    def from_hf_config(cls, cfg) -> DSparkDraftShape:
        def need(name: str):
            value = getattr(cfg, name, None)
            if value is None:
                raise ValueError(
                    f"DeepSeek-V4 DSpark draft needs config field {name!r}; the checkpoint "
                    "config has none (is this a DSpark checkpoint?)"
                )
            return value

        ids = tuple(int(i) for i in need("dspark_target_layer_ids"))
        num_layers = int(need("num_hidden_layers"))
        if not ids or any(not 0 <= i < num_layers for i in ids):
            raise ValueError(
                f"dspark_target_layer_ids must be non-empty ids in [0, {num_layers}), got {ids}"
            )
        shape = cls(
            hidden_size=int(need("hidden_size")),
            vocab_size=int(need("vocab_size")),
            num_target_layers=num_layers,
            num_draft_layers=int(getattr(cfg, "n_mtp_layers", None) or 3),
            target_layer_ids=ids,
            block_size=int(need("dspark_block_size")),
            markov_rank=int(need("dspark_markov_rank")),
            noise_token_id=draft_noise_token_id(cfg),
            num_heads=int(need("num_attention_heads")),
            head_dim=int(need("head_dim")),
            rope_dim=int(need("qk_rope_head_dim")),
            q_lora_rank=int(need("q_lora_rank")),
            o_lora_rank=int(need("o_lora_rank")),
            o_groups=int(need("o_groups")),
            window=int(need("sliding_window")),
            hc_mult=int(need("hc_mult")),
            hc_sinkhorn_iters=int(need("hc_sinkhorn_iters")),
            hc_eps=float(need("hc_eps")),
            rms_eps=float(need("rms_norm_eps")),
            max_position=int(need("max_position_embeddings")),
            confidence_head=bool(getattr(cfg, "enable_confidence_head", True)),
        )
        if shape.num_heads % shape.o_groups:
            raise ValueError(
                f"num_attention_heads={shape.num_heads} must be a multiple of "
                f"o_groups={shape.o_groups}"
            )
        if not 0 < shape.rope_dim < shape.head_dim:
            raise ValueError(f"qk_rope_head_dim must be in (0, head_dim={shape.head_dim})")
        return shape


def draft_noise_token_id(cfg) -> int:
    """The token that fills block slots 1..N-1, looked up in vLLM V2 DSpark's order
    (``v1/worker/gpu/spec_decode/utils.py``)."""
    nested = getattr(cfg, "dflash_config", None) or {}
    candidates = (
        ("dflash_config.mask_token_id", nested.get("mask_token_id")),
        ("mask_token_id", getattr(cfg, "mask_token_id", None)),
        ("dspark_noise_token_id", getattr(cfg, "dspark_noise_token_id", None)),
    )
    for field, value in candidates:
        if value is None:
            continue
        vocab = getattr(cfg, "vocab_size", None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (
            vocab is not None and value >= vocab
        ):
            raise ValueError(f"{field} must be a token id in [0, vocab_size={vocab}), got {value!r}")
        return value
    raise ValueError(
        "DeepSeek-V4 DSpark draft needs a noise token: the checkpoint config has none of "
        "dflash_config.mask_token_id, mask_token_id, dspark_noise_token_id"
    )


def draft_block_positions(
    anchor_positions: torch.Tensor, block_len: int, max_model_len: int, offsets: torch.Tensor
) -> torch.Tensor:
    """Positions ``[R, N]`` of each block ``p .. p+N-1`` (``offsets``: ``arange(block_len)``),
    clamped as upstream: slots past ``max_model_len - 1`` are rejected anyway, and the clamp
    keeps their RoPE in range."""
    return (anchor_positions[:, None] + offsets).clamp(max=max_model_len - 1)


def draft_hf_config(vllm_config: VllmConfig):
    """The draft's hf config: the speculative draft config, else the model's own."""
    spec = vllm_config.speculative_config
    if spec is not None and spec.draft_model_config is not None:
        return spec.draft_model_config.hf_config
    return vllm_config.model_config.hf_config
