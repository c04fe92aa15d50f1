"""DSpark sequential stage: Markov-head sampling over one drafted block (pure torch, no vLLM).

Left to right over the backbone's block logits ``U [R, N, V]``, from ``x_{-1}`` = the anchor:
``e_k = W1[x_{k-1}]``, ``z_k = U[:, k] + W2 e_k``, ``x_k = argmax(z_k)``, or for rows with
``T > 0`` a draw from ``q_k = softmax(z_k / T)``. The rejection sampler reads ``q_k`` (one-hot
for greedy rows), the confidence head ``[h_k ; e_k]``.
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
    """Sample one block left to right (``embed``: the ``W1`` lookup, ``bias``: the ``W2`` GEMM).
    Rows with ``temperature <= 0`` (all, when None) are greedy; the others take the exact race
    ``argmax(q / E)`` over ``race_noise`` (float32 ``Exp(1)``, required with ``temperature``), an
    input, so the block holds no RNG state and a captured graph gets fresh noise each step."""
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
