"""CUDA graphs of the DSpark draft block: one per draft size, through vLLM's wrapper.

The draft block (``DSparkProposer.draft_block``: backbone + Markov head) has static shapes
per padded draft size, reads no device data back and returns a flat tuple of tensors,
nothing kept on the side. So vLLM's ``CUDAGraphWrapper`` (FULL mode) can capture it once
per size and replay it every step, as it does the target model:

- inputs live in static buffers sized for the largest draft size; a step copies its
  ``[B]`` rows in and calls the wrapper on views of the first B rows, the same addresses
  every time (what a replay reads);
- capture happens in vLLM's capture phase (the runner's ``dummy_run`` with
  ``is_graph_capturing``), largest size first, each after one eager warm-up pass;
- a replay hands back the captured output tensors, overwritten in place: the proposer
  reads them before the next step.

Only on CUDA with graphs on (``enforce_eager`` off, a cudagraph mode other than NONE) and
``DSPARK_DRAFT_CUDAGRAPH`` not ``0``; CPU runs the block eagerly.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

__all__ = ["DraftBlockGraphs", "draft_graphs_wanted"]


def draft_graphs_wanted(vllm_config, device: torch.device) -> bool:
    """Whether the draft block should run as CUDA graphs in this engine."""
    from vllm.config import CUDAGraphMode

    if device.type != "cuda" or os.environ.get("DSPARK_DRAFT_CUDAGRAPH", "1") == "0":
        return False
    spec = vllm_config.speculative_config
    eager = getattr(spec, "enforce_eager", None)
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
    """Static inputs and one captured graph per draft size for ``block``."""

    def __init__(
        self,
        block: Callable[..., tuple[torch.Tensor, ...]],
        vllm_config,
        sizes: Sequence[int],
        *,
        num_spec_tokens: int,
        vocab_size: int,
        sampled: bool,
        device: torch.device,
        wrap: Callable[[Callable, object], Callable] = full_cuda_graph,
    ) -> None:
        """``wrap(block, vllm_config)`` makes the capturing callable (vLLM's wrapper)."""
        self.vllm_config = vllm_config
        self.sizes = sorted(sizes)
        rows = self.sizes[-1]
        self.slots = torch.zeros(rows, dtype=torch.int64, device=device)
        self.anchors = torch.zeros(rows, dtype=torch.int64, device=device)
        self.anchor_pos = torch.zeros(rows, dtype=torch.int64, device=device)
        # Sampled drafting runs every step through the sampled graph: greedy rows are
        # temperature 0 there (their draw is the argmax), so one graph per size serves both.
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
            None,
            self.vllm_config,
            cudagraph_runtime_mode=CUDAGraphMode.FULL,
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
        self,
        slots: torch.Tensor,
        anchors: torch.Tensor,
        anchor_pos: torch.Tensor,
        temperature: torch.Tensor | None,
        race_noise: torch.Tensor | None,
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
