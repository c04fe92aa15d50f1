"""vLLM's ``fp8_ds_mla`` KV token layout and its quantisation rule, written once.

A token record is 448 FP8-e4m3 "nope" dims followed by 64 bf16 RoPE dims (576 bytes); its 8
scale bytes hold one UE8M0 exponent (+127) per 64 FP8 dims (see
``vllm/models/deepseek_v4/common/ops/cache_utils.py``). The scale rule is the native CPU
kernels' (``csrc/cpu/sgl-kernels/store_cache.cpp`` and ``compressor.cpp`` of vLLM 0.32.0):
``scale = 2^ceil(log2(max(amax / 448, 1e-4)))``, so the scale, not the max, is floored.
(The indexer's K cache is another layout with another rule, in torch_compressor_ops.py.)
Pure torch: the CPU kernels and the device-agnostic DSpark draft both import it.
"""

from __future__ import annotations

import torch

NOPE_DIM = 448
ROPE_DIM = 64
QUANT_BLOCK = 64  # FP8 dims per scale
TOKEN_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576
SCALE_BYTES = 8
FP8_MAX = 448.0
SCALE_FLOOR = 1e-4


def _scale_exponent(blocks: torch.Tensor) -> torch.Tensor:
    """The rule: ``ceil(log2(max(amax / 448, 1e-4)))`` per block, ``[..., 1]``."""
    scale = (blocks.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=SCALE_FLOOR)
    return torch.ceil(torch.log2(scale))


def _to_fp8(blocks: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quantize_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``[..., QUANT_BLOCK]`` -> (FP8 e4m3 values, power-of-two exponent ``[..., 1]``)."""
    exponent = _scale_exponent(blocks)
    return _to_fp8(blocks, torch.exp2(exponent)), exponent


def roundtrip_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """fp32 ``[..., QUANT_BLOCK]`` -> what the cache gives back: ``dequant(quant(blocks))``.

    Same values as ``quantize_blocks`` then ``q * 2^exponent``, with the scale computed once.
    """
    scale = torch.exp2(_scale_exponent(blocks))
    return _to_fp8(blocks, scale).float() * scale
