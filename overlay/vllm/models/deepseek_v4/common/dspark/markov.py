"""DSpark sequential stage: Markov-head sampling over one drafted block.

The draft backbone produces base logits ``U [R, N, V]`` for a whole block in one pass.
The Markov head then walks the block left to right; slot ``k`` gets a transition bias
from the token chosen at slot ``k - 1`` (the anchor for ``k = 0``)::

    prev = anchor
    for k in 0..N-1:
        e_k = W1[prev]                # [R, r]
        z_k = U[:, k] + W2 e_k        # [R, V]
        x_k = argmax(z_k)             # greedy rows
            | sample(softmax(z_k / T))  # rows with temperature T > 0
        prev = x_k

``q_k = softmax(z_k / T)`` is what the rejection sampler needs for probabilistic
drafting (one-hot of ``x_k`` for greedy rows). ``e_k`` is kept because the confidence
head reads ``[h_k ; e_k]``.

Pure torch, no vLLM import: the same code runs on CPU and GPU and is unit-tested alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["MarkovDraft", "markov_block_sample"]


@dataclass
class MarkovDraft:
    """Result of one Markov pass over a block."""

    tokens: torch.Tensor  # [R, N] int64, x_0..x_{N-1}
    embeds: torch.Tensor  # [R, N, r], e_k = W1[token conditioning slot k]
    probs: torch.Tensor | None  # [R, N, V] float32 draft distribution q_k, if asked


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as ``dtype``; no op at all when it already is (a step counts its ops)."""
    return t if t.dtype == dtype else t.to(dtype)


def markov_block_sample(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    embed: Callable[[torch.Tensor], torch.Tensor],
    bias: Callable[[torch.Tensor], torch.Tensor],
    *,
    temperature: torch.Tensor | None = None,
    race_noise: torch.Tensor | None = None,
    return_probs: bool = False,
) -> MarkovDraft:
    """Sample one block left to right with the Markov transition bias.

    Args:
        base_logits: ``[R, N, V]`` backbone logits for the N block slots.
        anchor: ``[R]`` token that conditions slot 0 (the bonus / anchor token).
        embed: ``ids [R] -> e [R, r]`` (the Markov ``W1`` lookup).
        bias: ``e [R, r] -> [R, V]`` (the Markov ``W2`` projection).
        temperature: ``[R]`` per-request temperature; rows with ``T <= 0`` (or
            ``temperature=None`` for all rows) are greedy.
        race_noise: ``[R, N, V]`` float32 ``Exp(1)`` draws, required with ``temperature``.
            Sampling uses the exponential race ``argmax(q / E)``, ``E ~ Exp(1)``, which
            draws exactly from ``q``. The noise is an input, not drawn here, so the block
            holds no RNG state and a graph-captured block gets fresh noise every step (the
            proposer keys it per request seed and position, ``noise``).
        return_probs: also return ``q_k`` (float32 ``[R, N, V]``).
    """
    # fp32 once for the whole block, one view per slot; the loop keeps only the work slot k
    # depends on (``base[k] + bias`` adds in fp32: the bias is promoted exactly).
    base = base_logits.float().unbind(1)
    if temperature is None:
        random_rows = None
    else:
        temperature = _as(temperature, torch.float32)
        random_rows = temperature > 0
        # Greedy rows keep T=1 so the division is harmless; their draw is the argmax.
        safe_t = torch.where(random_rows, temperature, torch.ones_like(temperature))

    prev = _as(anchor, torch.int64)
    embeds, tokens, probs = [], [], []
    for k, base_k in enumerate(base):
        e_k = embed(prev)
        embeds.append(e_k)
        z_k = base_k + bias(e_k)
        greedy_tok = z_k.argmax(dim=-1)
        if random_rows is None:
            x_k = greedy_tok
            if return_probs:
                q_k = torch.zeros_like(z_k).scatter_(1, x_k[:, None], 1.0)
        else:
            q_k = torch.softmax(z_k / safe_t[:, None], dim=-1)
            sampled = (q_k / race_noise[:, k]).argmax(dim=-1)
            x_k = torch.where(random_rows, sampled, greedy_tok)
            if return_probs:
                one_hot = torch.zeros_like(q_k).scatter_(1, x_k[:, None], 1.0)
                q_k = torch.where(random_rows[:, None], q_k, one_hot)
        tokens.append(x_k)
        if return_probs:
            probs.append(q_k)
        prev = x_k
    return MarkovDraft(
        tokens=torch.stack(tokens, dim=1),
        embeds=torch.stack(embeds, dim=1),
        probs=torch.stack(probs, dim=1) if return_probs else None,
    )
