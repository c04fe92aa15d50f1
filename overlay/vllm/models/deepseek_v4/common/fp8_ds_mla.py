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

import math

import torch

NOPE_DIM = 448
ROPE_DIM = 64
QUANT_BLOCK = 64  # FP8 dims per scale
TOKEN_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576
SCALE_BYTES = 8
FP8_MAX = 448.0
SCALE_FLOOR = 1e-4


def _scale_exponent(blocks: torch.Tensor) -> torch.Tensor:
    """The rule: ``ceil(log2(max(amax / 448, 1e-4)))`` per block, fp32 ``[..., 1]``.

    ``amax`` is the fp32 max-abs of the block (one op; exact for any input dtype).
    """
    amax = torch.linalg.vector_norm(
        blocks, ord=math.inf, dim=-1, keepdim=True, dtype=torch.float32
    )
    return torch.ceil(torch.log2((amax / FP8_MAX).clamp(min=SCALE_FLOOR)))


def _to_fp8(blocks: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``blocks / scale`` (computed in fp32) as FP8 e4m3.

    No clamp to +-448 is needed: the scale is a power of two >= amax / 448 up to the
    last-bit error of fp32 ``log2`` (< 1e-5 relative), so every quotient stays below
    448.01 and rounds to at most 448; e4m3 overflows (NaN) only from 464.
    """
    return (blocks / scale).to(torch.float8_e4m3fn)


def quantize_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., QUANT_BLOCK]`` -> (FP8 e4m3 values, power-of-two exponent ``[..., 1]``)."""
    exponent = _scale_exponent(blocks)
    return _to_fp8(blocks, torch.exp2(exponent)), exponent


def roundtrip_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """``[..., QUANT_BLOCK]`` -> what the cache gives back, fp32: ``dequant(quant(blocks))``.

    Same values as ``quantize_blocks`` then ``q * 2^exponent``, with the scale computed once.
    """
    scale = torch.exp2(_scale_exponent(blocks))
    return _to_fp8(blocks, scale).float() * scale
