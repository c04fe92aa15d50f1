"""A stand-in for vLLM's ``CUDAGraphWrapper`` on machines without a GPU.

Same dispatch as the real wrapper (the forward context's runtime mode and batch
descriptor), and a replay behaves like a CUDA graph's: it reads only the tensors the
capture saw (their addresses must not move) and writes into the captured outputs. A
caller that forgot to copy a step's inputs into the static buffers, or that handed the
graph fresh tensors, gets stale drafts or an error here, as it would on a GPU.
"""

from __future__ import annotations

import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import get_forward_context, is_forward_context_available


def _addresses(args) -> list[int]:
    return [a.data_ptr() for a in args if isinstance(a, torch.Tensor)]


class FakeCUDAGraph:
    def __init__(self, runnable, vllm_config) -> None:
        self.runnable = runnable
        self.entries: dict = {}
        self.replays = 0

    def __call__(self, *args):
        context = get_forward_context() if is_forward_context_available() else None
        if context is None or context.cudagraph_runtime_mode != CUDAGraphMode.FULL:
            return self.runnable(*args)
        key = context.batch_descriptor
        if key not in self.entries:  # capture
            outputs = self.runnable(*args)
            self.entries[key] = (args, outputs)
            return outputs
        captured, outputs = self.entries[key]
        if _addresses(args) != _addresses(captured):
            raise RuntimeError("replay inputs are not the captured buffers")
        for out, fresh in zip(outputs, self.runnable(*captured), strict=True):
            out.copy_(fresh)
        self.replays += 1
        return outputs
