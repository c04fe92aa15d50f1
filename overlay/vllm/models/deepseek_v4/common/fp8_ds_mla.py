"""vLLM's ``fp8_ds_mla`` KV token layout and quantisation rule, for the torch CPU kernels and
the DSpark draft: a record is 448 FP8-e4m3 "nope" dims then 64 bf16 RoPE dims (576 bytes), and 8
scale bytes hold one UE8M0 exponent (+127) per 64 FP8 dims. The rule is the native CPU kernels':
``scale = 2^ceil(log2(max(amax / 448, 1e-4)))``, so the scale, not the max, is floored.
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
    """The rule per block, fp32 ``[..., 1]``; ``amax`` in one op, exact for any input dtype."""
    amax = torch.linalg.vector_norm(blocks, ord=math.inf, dim=-1, keepdim=True, dtype=torch.float32)
    return torch.ceil(torch.log2((amax / FP8_MAX).clamp(min=SCALE_FLOOR)))


def _to_fp8(blocks: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``blocks / scale`` (in fp32) as FP8 e4m3. No clamp needed: the power-of-two scale is
    >= amax / 448 up to fp32 ``log2``'s last-bit error (< 1e-5 relative), so every quotient
    stays below 448.01 and rounds to at most 448; e4m3 overflows (NaN) only from 464."""
    return (blocks / scale).to(torch.float8_e4m3fn)


def quantize_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., QUANT_BLOCK]`` -> (FP8 e4m3 values, power-of-two exponent ``[..., 1]``)."""
    exponent = _scale_exponent(blocks)
    return _to_fp8(blocks, torch.exp2(exponent)), exponent


def roundtrip_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """``[..., QUANT_BLOCK]`` -> what the cache gives back, fp32 (scale computed once)."""
    scale = torch.exp2(_scale_exponent(blocks))
    return _to_fp8(blocks, scale).float() * scale
