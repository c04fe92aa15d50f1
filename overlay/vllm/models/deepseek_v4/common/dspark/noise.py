"""Keyed noise for probabilistic DSpark drafting, as vLLM's V2 DSpark: a pure function of
``(request seed, position, token id)``, so a seeded request drafts the same tokens whatever its
batch, row or chunking. The key is a 32-bit MurmurHash3-style mix of (seed low, seed high,
position, token), the draw ``E = -log((h + 0.5) / 2**32)`` in float64, rounded to float32, the
whole ``[R, N, V]`` block in one pass: a Numba loop on the host (the row's mix once per row, the
token's once per block of tokens), a Triton kernel on CUDA (tested here by Triton's interpreter).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import torch

__all__ = ["DRAFT_NOISE_SALT", "RequestSeeds", "keyed_race_noise"]

# Offsets draft positions so draft noise never reuses a target draw's key.
DRAFT_NOISE_SALT = 1 << 30

_U32 = 0xFFFFFFFF
# MurmurHash3 (x86, 32-bit) constants.
_C1, _C2, _M, _N = 0xCC9E2D51, 0x1B873593, 5, 0xE6546B64
_F1, _F2 = 0x85EBCA6B, 0xC2B2AE35
# Bytes hashed per key (four 32-bit words), folded in before the finaliser.
_KEY_BYTES = 16


def keyed_race_noise(
    seeds: torch.Tensor, anchor_positions: torch.Tensor, block_len: int, vocab_size: int
) -> torch.Tensor:
    """``Exp(1)`` race noise ``[R, N, V]`` float32 for one block per request: slot k predicts
    ``p + k + 1`` and is keyed by ``(seed, p + k + DRAFT_NOISE_SALT)``, upstream's scheme.
    ``seeds`` (any int64) and ``anchor_positions`` p are ``[R]`` on one device."""
    if seeds.shape != anchor_positions.shape or seeds.dim() != 1:
        raise ValueError(
            f"seeds and anchor_positions must both be [R]; got {tuple(seeds.shape)} and "
            f"{tuple(anchor_positions.shape)}"
        )
    if seeds.device != anchor_positions.device:
        raise ValueError(
            f"seeds and anchor_positions must share a device; got {seeds.device} and "
            f"{anchor_positions.device}"
        )
    if block_len < 1 or vocab_size < 1:
        raise ValueError(f"block_len and vocab_size must be >= 1; got {block_len}, {vocab_size}")
    rows = seeds.shape[0]
    out = torch.empty((rows, block_len, vocab_size), dtype=torch.float32, device=seeds.device)
    if rows == 0:
        return out
    seeds = seeds.to(torch.int64)
    keys = anchor_positions.to(torch.int64) + DRAFT_NOISE_SALT
    device = seeds.device.type
    if device == "cuda":
        _race_noise_triton(seeds, keys, out)
    elif device == "cpu":
        _race_noise_host()(seeds.numpy(), keys.numpy(), out.numpy())
    else:
        raise NotImplementedError(f"keyed_race_noise runs on cpu or cuda, not on {device}")
    return out


# ----------------------------------------------------------------------------- host (Numba)

_CHUNK = 1024  # tokens per block: a block's scratch stays in L1
# -log u = -(k ln2 + ln m) with u = 2**k m, m in [sqrt(1/2), sqrt(2)); -ln m = 2 atanh(g / 2)
# with g = 2 (1 - m) / (1 + m), |g / 2| <= 0.1716: eight odd terms leave a relative error
# below 2**-44 (2**-44.7 measured over 2*10**8 draws and every binade's sqrt(2) boundary).
_LN2_HI, _LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10  # k * _LN2_HI exact
_ATANH_TERMS = tuple(1.0 / ((2 * j + 1) * 4**j) for j in range(1, 8))  # of (g / 2)**2j, in g**2j
# That error is under 2**9 float64 ulps of the value. A draw whose 29 low mantissa bits (those
# float32 rounding drops) lie within this many ulps of one half could round either way, and is
# redone with the float64 log (1 draw in 65,536): every value equals RN32 of -log u.
_TIE_ULPS = 1 << 12
_SQRT_HALF_BITS = 0x3FE6A09E667F3BCD  # float64 bits of sqrt(1/2)
_TWO52_BITS = 0x4330000000000000  # float64 bits of 2**52: (n | these bits) - 2**52 == n


def _hash_intrinsics():
    """The per-token hash in 32-bit lanes (Numba widens uint32 arithmetic to 64 bits, which AVX2
    cannot multiply in vectors): ``mix(h, t) = (rotl(h, 13) ^ token_key(t)) * 5 + n``, so
    ``token_key`` serves every row and ``finish(rotl(h, 13), key)`` adds the rest and finaliser."""
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic

    i32 = ir.IntType(32)

    def c(v):
        return ir.Constant(i32, v - (1 << 32) if v >= 1 << 31 else v)

    def rotl(builder, x, r):
        return builder.or_(builder.shl(x, c(r)), builder.lshr(x, c(32 - r)))

    @intrinsic
    def token_key(typingctx, token):
        def codegen(context, builder, signature, args):
            k = rotl(builder, builder.mul(args[0], c(_C1)), 15)
            return rotl(builder, builder.mul(k, c(_C2)), 13)

        return types.uint32(types.uint32), codegen

    @intrinsic
    def finish(typingctx, row_state, key):
        def codegen(context, builder, signature, args):
            h, k = args
            x = builder.add(builder.mul(builder.xor(h, k), c(_M)), c(_N))
            x = builder.xor(x, c(_KEY_BYTES))
            for shift, mult in ((16, _F1), (13, _F2)):
                x = builder.mul(builder.xor(x, builder.lshr(x, c(shift))), c(mult))
            return builder.xor(x, builder.lshr(x, c(16)))

        return types.uint32(types.uint32, types.uint32), codegen

    @intrinsic
    def bits(typingctx, x):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(64))

        return types.int64(types.float64), codegen

    @intrinsic
    def from_bits(typingctx, b):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.DoubleType())

        return types.float64(types.int64), codegen

    return token_key, finish, bits, from_bits


@functools.cache
def _race_noise_host():
    """The Numba kernel, compiled on first use (Numba ships with vLLM; no C compiler)."""
    import math

    import numba
    import numpy as np

    token_key, finish, bits, from_bits = _hash_intrinsics()
    series = _ATANH_TERMS

    @numba.njit(inline="always")
    def rotl(x, r):
        return ((x << r) | (x >> (32 - r))) & _U32

    @numba.njit(inline="always")
    def mix(h, key):
        key = (rotl((key * _C1) & _U32, 15) * _C2) & _U32
        return (rotl(h ^ key, 13) * _M + _N) & _U32

    @numba.njit(inline="always")
    def uniform(h):
        # int32 -> float64 converts in vectors on AVX2, uint32 -> float64 does not.
        x = np.int32(h ^ np.uint32(0x80000000))
        return (np.float64(x) + 2147483648.5) * 2.0**-32

    @numba.njit(inline="always")
    def neg_log(u):
        """-log u within 2**-44 (relative) for u in (0, 1), in float64 vector lanes."""
        # u = 2**k m, m in [sqrt(1/2), sqrt(2)): k is the exponent of u / sqrt(1/2), read from
        # the bits (biased by 64: AVX2 has no arithmetic 64-bit shift); m is u with k taken out.
        b = bits(u)
        k64 = (b - _SQRT_HALF_BITS + (64 << 52)) >> 52
        m = from_bits(b - (k64 << 52) + (64 << 52))
        k = from_bits(k64 | _TWO52_BITS) - (2.0**52 + 64.0)
        g = (2.0 - 2.0 * m) / (m + 1.0)  # -log m = 2 atanh(g / 2)
        s = g * g
        p = series[-1]
        for c in series[-2::-1]:
            p = p * s + c
        return k * -_LN2_HI + (k * -_LN2_LO + (g + g * (s * p)))

    @numba.njit(inline="always")
    def near_tie(y):
        """Whether y's float32 rounding could differ within the error of ``neg_log``."""
        return ((bits(y) + (_TIE_ULPS - (1 << 28))) & ((1 << 29) - 1)) <= 2 * _TIE_ULPS

    @numba.njit(parallel=True, nogil=True, error_model="numpy", fastmath={"contract"})
    def kernel(seeds, keys, out):
        rows, slots, vocab = out.shape
        states = np.empty(rows * slots, np.uint32)
        for i in range(rows * slots):
            r, k = i // slots, i % slots
            seed = seeds[r]  # int64: its two's complement halves, as the int64 formula
            h = mix(0, seed & _U32)
            h = mix(h, (seed >> 32) & _U32)
            h = mix(h, (keys[r] + k) & _U32)
            states[i] = rotl(h, 13)
        # Threads take blocks of tokens: a block's token keys are hashed once for all rows.
        for c in numba.prange((vocab + _CHUNK - 1) // _CHUNK):
            t0 = c * _CHUNK
            n = min(_CHUNK, vocab - t0)
            key = np.empty(_CHUNK, np.uint32)
            for j in range(n):
                key[j] = token_key(np.uint32(t0 + j))
            h = np.empty(_CHUNK, np.uint32)
            for i in range(rows * slots):
                block = out[i // slots, i % slots, t0:t0 + n]
                for j in range(n):
                    h[j] = finish(states[i], key[j])
                unsure = 0
                for j in range(n):
                    y = neg_log(uniform(h[j]))
                    block[j] = np.float32(y)
                    unsure += near_tie(y)
                if unsure:  # redone with the float64 log, those draws only
                    for j in range(n):
                        if near_tie(neg_log(uniform(h[j]))):
                            block[j] = np.float32(-math.log(uniform(h[j])))

    return kernel


# ---------------------------------------------------------------------------- CUDA (Triton)

try:  # CUDA builds of vLLM ship Triton; the CPU build has none and never takes this path
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_BLOCK_V = 1024


def _race_noise_triton(seeds: torch.Tensor, keys: torch.Tensor, out: torch.Tensor) -> None:
    """One program per (row, slot, 1024 tokens); no host read, capturable in a CUDA graph."""
    if triton is None:
        raise RuntimeError("keyed_race_noise on CUDA needs Triton, which is not installed")
    rows, slots, vocab = out.shape
    grid = (rows * slots, triton.cdiv(vocab, _BLOCK_V))
    _race_noise_kernel[grid](seeds, keys, out, slots, vocab, BLOCK_V=_BLOCK_V)


if triton is not None:
    # Triton resolves a kernel's callees among its module's globals: these stay top level.

    @triton.jit
    def _tl_rotl(x, r: tl.constexpr):
        return (x << r) | (x >> (32 - r))

    @triton.jit
    def _tl_mix(h, key):
        key = _tl_rotl(key * 0xCC9E2D51, 15) * 0x1B873593
        return _tl_rotl(h ^ key, 13) * 5 + 0xE6546B64

    @triton.jit
    def _race_noise_kernel(seeds_ptr, keys_ptr, out_ptr, slots, vocab, BLOCK_V: tl.constexpr):
        row_slot = tl.program_id(0)
        r = row_slot // slots
        k = row_slot % slots
        seed = tl.load(seeds_ptr + r)
        h = _tl_mix(tl.zeros((), tl.uint32), (seed & 0xFFFFFFFF).to(tl.uint32))
        h = _tl_mix(h, ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
        h = _tl_mix(h, ((tl.load(keys_ptr + r) + k) & 0xFFFFFFFF).to(tl.uint32))
        tokens = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        x = _tl_mix(h, tokens.to(tl.uint32)) ^ 16
        x ^= x >> 16
        x *= 0x85EBCA6B
        x ^= x >> 13
        x *= 0xC2B2AE35
        x ^= x >> 16
        u = (x.to(tl.float64) + 0.5) * 2.3283064365386963e-10  # 2**-32
        base = out_ptr + row_slot.to(tl.int64) * vocab
        tl.store(base + tokens, (-tl.log(u)).to(tl.float32), mask=tokens < vocab)


class RequestSeeds:
    """Each live request's sampling seed: its own ``seed=`` or one drawn when first seen."""

    def __init__(self, base_seed: int) -> None:
        # A host generator: drawing a seed never touches the device.
        self.generator = torch.Generator().manual_seed(int(base_seed))
        self._seeds: dict[str, int] = {}

    def lookup(self, req_ids: Sequence[str], explicit: Sequence[int | None]) -> torch.Tensor:
        """``[R]`` int64 seeds for ``req_ids``; ``explicit[r]`` is the request's ``seed=``."""
        if len(explicit) != len(req_ids):
            raise ValueError(
                f"explicit seeds must have one entry per request (R={len(req_ids)}), "
                f"got {len(explicit)}"
            )
        for req_id, seed in zip(req_ids, explicit, strict=True):
            if seed is not None:
                self._seeds[req_id] = int(seed)
            elif req_id not in self._seeds:
                drawn = torch.randint(-(2**63), 2**63 - 1, (), generator=self.generator)
                self._seeds[req_id] = int(drawn)
        return torch.tensor([self._seeds[r] for r in req_ids], dtype=torch.int64)

    def release(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._seeds.pop(req_id, None)
