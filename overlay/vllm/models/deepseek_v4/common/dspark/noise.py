"""Keyed noise for probabilistic DSpark drafting, seeded per request and position.

vLLM's V2 DSpark draws each draft token by a Gumbel / exponential race whose noise is a
pure function of ``(request seed, position, token id)``: the draw for the token predicted at
position ``P`` is keyed by ``P - 1`` plus a salt that keeps draft noise apart from the
target's. No RNG state advances, so a request with ``seed=`` drafts the same tokens whatever
batch it shares, whichever batch row it sits in, and however its steps were chunked.
Requests without a seed get a random one when first seen (as upstream's sampler states do).

Pure torch (a 32-bit MurmurHash3-style mix evaluated in int64 lanes), no vLLM import.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

__all__ = ["DRAFT_NOISE_SALT", "RequestSeeds", "keyed_race_noise", "keyed_uniform"]

# Offsets draft positions so draft noise never reuses a target draw's key.
DRAFT_NOISE_SALT = 1 << 30

_U32 = 0xFFFFFFFF


def _rotl(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _U32


def _mix(h: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    key = (key * 0xCC9E2D51) & _U32
    key = _rotl(key, 15)
    key = (key * 0x1B873593) & _U32
    h = _rotl(h ^ key, 13)
    return (h * 5 + 0xE6546B64) & _U32


def _finalise(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _U32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _U32
    return h ^ (h >> 16)


def keyed_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms in (0, 1), ``[R, V]`` float64, a pure function of (seed, position, token).

    Args:
        seeds: ``[R]`` int64 per-request seeds (any 64-bit value).
        positions: ``[R]`` int64 key positions (the position before the predicted token,
            plus ``DRAFT_NOISE_SALT`` when drafting).
        vocab_size: V, the number of tokens drawn over.
    """
    if seeds.shape != positions.shape or seeds.dim() != 1:
        raise ValueError(
            f"seeds and positions must both be [R]; got {tuple(seeds.shape)} and "
            f"{tuple(positions.shape)}"
        )
    seeds = seeds.to(torch.int64)
    positions = positions.to(torch.int64)
    # Products of two values below 2**32 wrap in int64; masking keeps the exact low 32 bits.
    h = torch.zeros_like(seeds)
    h = _mix(h, seeds & _U32)
    h = _mix(h, (seeds >> 32) & _U32)
    h = _mix(h, positions & _U32)
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    h = _finalise(_mix(h[:, None], tokens[None, :]) ^ 16)
    return (h.to(torch.float64) + 0.5) * 2.0**-32


def keyed_race_noise(
    seeds: torch.Tensor, anchor_positions: torch.Tensor, block_len: int, vocab_size: int
) -> torch.Tensor:
    """``Exp(1)`` race noise ``[R, N, V]`` float32 for drafting one block per request.

    Slot k predicts position ``p + k + 1`` and its draw is keyed by ``(seed, p + k)`` plus
    ``DRAFT_NOISE_SALT`` (upstream's scheme); ``E = -log u`` turns the uniforms into the
    exponential race ``argmax(q / E)`` that the Markov sampler runs.
    """
    keys = anchor_positions.to(torch.int64) + DRAFT_NOISE_SALT
    uniforms = [keyed_uniform(seeds, keys + k, vocab_size) for k in range(block_len)]
    return (-torch.log(torch.stack(uniforms, dim=1))).to(torch.float32)


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
