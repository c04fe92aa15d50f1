"""The published DeepSeek-V4-Flash(-DSpark) weight formats, applied to bf16 tensors.

``to_real_format`` turns a checkpoint's bf16 weights into the published layout and its
exact bf16 twin:

- FP8 block: ``<module>.weight`` e4m3 ``[out, in]`` and ``<module>.scale`` UE8M0
  ``[ceil(out/128), ceil(in/128)]`` (per block ``scale = 2^ceil(log2(amax / 448))``), for
  attention ``wq_a, wq_b, wkv, wo_a, wo_b``, the indexer's ``wq_b``, the shared experts and
  ``mtp.0.main_proj``;
- MXFP4: routed experts' ``.weight`` int8 ``[out, in/2]`` (two e2m1 codes per byte, the
  even element in the low nibble) and ``.scale`` UE8M0 ``[out, in/32]`` (per 32 values
  ``scale = 2^ceil(log2(amax / 6))``);
- everything else as it is, but the confidence head in bf16 and ``tid2eid`` in int64.

The twin holds ``q * scale`` in bf16, which is exact (an e4m3 or e2m1 value times a power
of two fits bf16), so it is the oracle a loader of the quantised files must reproduce.
Every operation also runs on the meta device: the same code states the names, shapes and
dtypes of a full-size checkpoint without any data.
"""

from __future__ import annotations

import re

import torch

__all__ = [
    "FP8_BLOCK",
    "MXFP4_GROUP",
    "QUANTIZATION_CONFIG",
    "dequantize_fp8_block",
    "quantize_fp8_block",
    "quantize_mxfp4",
    "to_real_format",
]

FP8_BLOCK = 128
MXFP4_GROUP = 32
E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
}

_FP8_WEIGHT = re.compile(
    r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|\.attn\.indexer\.wq_b|\.ffn\.shared_experts\.w[123]"
    r"|^mtp\.0\.main_proj)\.weight$"
)
_MXFP4_WEIGHT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")


def _power_of_two_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """UE8M0 scale exponent ``ceil(log2(amax / top))`` (fp32), within UE8M0's range."""
    tiny = torch.finfo(torch.float32).tiny
    return torch.ceil(torch.log2(amax.clamp(min=tiny) / top)).clamp(-127, 127)


def quantize_fp8_block(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> (e4m3 ``[N, K]``, UE8M0 ``[ceil(N/128), ceil(K/128)]``)."""
    n, k = weight.shape
    bn, bk = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    padded = torch.nn.functional.pad(weight.float(), (0, bk * FP8_BLOCK - k, 0, bn * FP8_BLOCK - n))
    blocks = padded.view(bn, FP8_BLOCK, bk, FP8_BLOCK)
    exponent = _power_of_two_scale(blocks.abs().amax(dim=(1, 3)), E4M3_MAX)
    scaled = blocks / torch.exp2(exponent)[:, None, :, None]
    q = scaled.view(bn * FP8_BLOCK, bk * FP8_BLOCK)[:n, :k].to(torch.float8_e4m3fn)
    return q, torch.exp2(exponent).to(torch.float8_e8m0fnu)


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 ``[N, K]`` times its block scales, in bf16 (exact)."""
    n, k = q.shape
    expanded = scale.float().repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return (q.float() * expanded[:n, :k]).to(torch.bfloat16)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> (int8 ``[N, K/2]`` packed e2m1, UE8M0 ``[N, K/32]``, bf16 twin ``[N, K]``).

    Each value goes to the nearest e2m1 magnitude of ``|w| / scale`` with w's sign. The
    twin is decoded from the codes before packing, so it does not share the packing.
    """
    n, k = weight.shape
    if k % MXFP4_GROUP:
        raise ValueError(f"MXFP4 needs the input dim to be a multiple of {MXFP4_GROUP}, got {k}")
    groups = weight.float().view(n, k // MXFP4_GROUP, MXFP4_GROUP)
    exponent = _power_of_two_scale(groups.abs().amax(dim=-1), E2M1_MAX)
    scale = torch.exp2(exponent)
    scaled = groups / scale[..., None]
    grid = torch.tensor(E2M1_MAGNITUDES, device=weight.device)
    midpoints = (grid[1:] + grid[:-1]) / 2  # a tie goes to the smaller magnitude
    magnitude = torch.bucketize(scaled.abs(), midpoints)
    negative = scaled < 0
    codes = (magnitude | (negative.long() << 3)).view(n, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    values = torch.where(negative, -grid[magnitude], grid[magnitude]) * scale[..., None]
    return packed, scale.to(torch.float8_e8m0fnu), values.view(n, k).to(torch.bfloat16)


def to_real_format(
    tensors: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """bf16 checkpoint tensors -> (published layout, its exact bf16 twin)."""
    real: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if _FP8_WEIGHT.search(name):
            q, scale = quantize_fp8_block(tensor)
            real[name], real[f"{module}.scale"] = q, scale
            twin[name] = dequantize_fp8_block(q, scale)
        elif _MXFP4_WEIGHT.search(name):
            real[name], real[f"{module}.scale"], twin[name] = quantize_mxfp4(tensor)
        else:
            if name.endswith(".confidence_head.proj.weight"):
                tensor = tensor.to(torch.bfloat16)
            elif name.endswith(".gate.tid2eid"):
                tensor = tensor.to(torch.int64)
            real[name] = twin[name] = tensor
    return real, twin
