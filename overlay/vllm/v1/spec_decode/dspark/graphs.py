"""CUDA graphs of the DSpark draft block, one per draft size, through vLLM's FULL-mode
``CUDAGraphWrapper`` (overlay/README.md, "Draft block as CUDA graphs"). Inputs live in static
buffers sized for the largest size; a step copies its ``[B]`` rows in and calls the wrapper on
views of the first B rows, the addresses a replay reads. The next replay overwrites outputs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

__all__ = ["DraftBlockGraphs", "draft_graphs_wanted"]


def draft_graphs_wanted(vllm_config, device: torch.device) -> bool:
    """CUDA, ``DSPARK_DRAFT_CUDAGRAPH`` not 0, and graphs on for the draft (not eager)."""
    from vllm.config import CUDAGraphMode

    if device.type != "cuda" or os.environ.get("DSPARK_DRAFT_CUDAGRAPH", "1") == "0":
        return False
    eager = getattr(vllm_config.speculative_config, "enforce_eager", None)
    if eager is None:
        eager = vllm_config.model_config.enforce_eager
    mode = vllm_config.compilation_config.cudagraph_mode
    return not eager and mode is not None and mode != CUDAGraphMode.NONE


def full_cuda_graph(runnable: Callable, vllm_config):
    """vLLM's FULL-mode ``CUDAGraphWrapper`` around ``runnable``."""
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.config import CUDAGraphMode

    return CUDAGraphWrapper(runnable, vllm_config, CUDAGraphMode.FULL)


class DraftBlockGraphs:
    """Static inputs and one graph per draft size of ``block``, made by ``wrap``."""

    def __init__(
        self, block: Callable[..., tuple[torch.Tensor, ...]], vllm_config, sizes: Sequence[int],
        *, num_spec_tokens: int, vocab_size: int, sampled: bool, device: torch.device,
        wrap: Callable[[Callable, object], Callable] = full_cuda_graph,
    ) -> None:
        self.vllm_config = vllm_config
        self.sizes = sorted(sizes)
        rows = self.sizes[-1]
        self.slots = torch.zeros(rows, dtype=torch.int64, device=device)
        self.anchors = torch.zeros(rows, dtype=torch.int64, device=device)
        self.anchor_pos = torch.zeros(rows, dtype=torch.int64, device=device)
        # Sampled drafting always replays the sampled graph (greedy rows at temperature 0).
        self.temperature = self.noise = None
        if sampled:
            self.temperature = torch.zeros(rows, dtype=torch.float32, device=device)
            self.noise = torch.ones(
                rows, num_spec_tokens, vocab_size, dtype=torch.float32, device=device
            )
        self.graph = wrap(block, vllm_config)
        self.captured: set[int] = set()

    def _inputs(self, size: int) -> tuple:
        temperature = None if self.temperature is None else self.temperature[:size]
        noise = None if self.noise is None else self.noise[:size]
        return self.slots[:size], self.anchors[:size], self.anchor_pos[:size], temperature, noise

    def _context(self, size: int | None):
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import BatchDescriptor, set_forward_context

        if size is None:  # eager pass through the wrapper
            return set_forward_context(None, self.vllm_config)
        return set_forward_context(
            None, self.vllm_config, cudagraph_runtime_mode=CUDAGraphMode.FULL,
            batch_descriptor=BatchDescriptor(num_tokens=size, num_reqs=size),
        )

    def capture(self) -> None:
        """Warm up and capture every size, largest first (smaller graphs reuse its pool)."""
        for size in reversed(self.sizes):
            if size in self.captured:
                continue
            with torch.inference_mode():
                with self._context(None):
                    self.graph(*self._inputs(size))
                with self._context(size):
                    self.graph(*self._inputs(size))
            self.captured.add(size)

    def run(
        self, slots: torch.Tensor, anchors: torch.Tensor, anchor_pos: torch.Tensor,
        temperature: torch.Tensor | None, race_noise: torch.Tensor | None,
    ) -> tuple[torch.Tensor, ...]:
        """Replay the graph of size ``len(slots)`` on these inputs (copied into the buffers)."""
        size = slots.shape[0]
        self.slots[:size].copy_(slots)
        self.anchors[:size].copy_(anchors)
        self.anchor_pos[:size].copy_(anchor_pos)
        if self.temperature is not None:
            if temperature is None:
                self.temperature[:size].zero_()
            else:
                self.temperature[:size].copy_(temperature)
                self.noise[:size].copy_(race_noise)
        with self._context(size):
            return self.graph(*self._inputs(size))
