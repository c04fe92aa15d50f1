"""Confidence-scheduled (adaptive) verification: how many of each request's drafts to verify.

With ``c_j`` the confidence head's chance that draft ``j`` is accepted once those before it
were, its survival ``S_j = c_1 * ... * c_j`` (never growing, so each request keeps a prefix)
is the chance it is emitted. The batch's drafts are ranked by survival and the best ``b``
verified, ``b`` maximising ``(requests + S_(1) + ... + S_(b)) / T(requests, requests + b)``
with ``T`` the measured ``cost_table.StepCostTable``. Hysteresis, the row budget and why
seeded sampled requests keep all k: overlay/README.md. On the device, static shapes, no
device-to-host read. The cut reaches a synchronous scheduler as ``CUT`` marks the host trims
from the drafts it copies anyway (``trim_cut``); an async one, whose next draft slots are
already reserved, as admitted counts (``draft_budgets``) that budget the step after next.
"""

from __future__ import annotations

import torch

__all__ = ["CUT", "NO_BUDGET", "apply_cut", "draft_budget_mask", "draft_budgets",
           "fit_row_budget", "hold_row_budget", "trim_cut"]

CUT = -1  # a draft slot past the cut (never a token id)
NO_BUDGET = -1  # a request the rule did not rank (async scheduling: keep k drafts)
# A whole row's slots rank above every competing one (survivals are in [0, 1]).
_WHOLE_FIRST = 2.0


def draft_budget_mask(
    confidence: torch.Tensor, eligible: torch.Tensor, *, num_ranked: int, num_whole_drafts: int,
    max_drafts: int, step_ms: torch.Tensor, min_gain: float,
    whole: torch.Tensor | None = None, cutting: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, k]`` bool: the draft slots worth verifying next step.

    Device: ``confidence [B, k]`` (NaN counts as 0); ``eligible [B]`` rows whose drafts compete
    (not pads, prefills or ``whole`` rows); ``whole [B]`` (or None) rows that keep all k unless
    the budget forbids; ``step_ms [>= max_drafts + 1]`` step time with ``b`` drafts admitted;
    ``cutting`` (bool scalar or None) the hysteresis state, updated in place. Host ints:
    ``num_ranked`` eligible plus whole rows (each emits a token whatever is cut),
    ``num_whole_drafts`` whole rows x k, ``max_drafts`` the most drafts the step may admit.
    Ties keep the smaller budget; a row neither eligible nor whole keeps nothing.
    """
    rows, k = confidence.shape
    conf = torch.nan_to_num(confidence.float(), nan=0.0).clamp(0.0, 1.0)
    survival = conf.cumprod(dim=1)
    ranked_rows = eligible if whole is None else eligible | whole
    score = torch.where(ranked_rows[:, None], survival, -1.0)
    if whole is not None:
        score = score + whole[:, None] * _WHOLE_FIRST
    ranked, order = torch.sort(score.flatten(), descending=True, stable=True)
    gains = torch.cumsum(survival.flatten()[order[:max_drafts]], dim=0)
    expected = torch.cat([gains.new_zeros(1), gains]) + float(num_ranked)
    throughput = expected / step_ms[: max_drafts + 1]
    lo = min(num_whole_drafts, max_drafts)  # whole rows first: no smaller budget
    best = torch.argmax(throughput[lo:]) + lo  # the first maximum: smallest budget on ties
    full = throughput[max_drafts]
    if cutting is None:
        threshold = 1.0 + min_gain
    else:
        threshold = torch.where(cutting, 1.0 + min_gain / 2, 1.0 + min_gain)
    worth = throughput[best] >= threshold * full
    budget = torch.where(worth, best, max_drafts)
    if cutting is not None:
        cutting.copy_(worth & (best < max_drafts))
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(rows * k, device=order.device))
    return (rank < budget).view(rows, k)


def draft_budgets(keep: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """``[R]`` int32: admitted drafts per request, ``NO_BUDGET`` for an ineligible row (a
    request in prefill: the rule had nothing to rank, so the scheduler keeps its k)."""
    counts = keep.sum(dim=1, dtype=torch.int32)
    return torch.where(eligible, counts, torch.full_like(counts, NO_BUDGET))


def apply_cut(drafts: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``drafts [R, k]`` with ``CUT`` in every slot ``keep [R, k]`` does not admit."""
    return torch.where(keep, drafts, torch.full_like(drafts, CUT))


def trim_cut(draft_lists: list[list[int]]) -> list[list[int]]:
    """Host side, after the drafts' own copy: each request's drafts up to its first ``CUT``."""
    return [drafts[: drafts.index(CUT)] if CUT in drafts else drafts for drafts in draft_lists]


def fit_row_budget(counts: list[int], budget: int) -> list[int]:
    """Host side (async scheduler): drafts per request trimmed so one step's verify rows (one
    per request plus its drafts) fit ``budget``, the longest first (even shares); none grows."""
    room = max(budget - len(counts), 0)
    if sum(counts) <= room:
        return list(counts)
    cap = 0
    while sum(min(n, cap + 1) for n in counts) <= room:
        cap += 1
    out = [min(n, cap) for n in counts]
    spare = room - sum(out)
    for i, n in enumerate(counts):  # what is left: one more each, in batch order
        if spare == 0:
            break
        if n > out[i]:
            out[i] += 1
            spare -= 1
    return out


def hold_row_budget(running, budget: int) -> None:
    """Scheduler side, once the next step's drafts (or async placeholders) are set: trim the
    running requests' ``spec_token_ids`` in place to ``budget`` verify rows. A backstop: a
    request skipped for a step keeps an earlier cut's drafts; placeholders precede any cut."""
    decoding = [r for r in running if not r.is_prefill_chunk]
    counts = [len(r.spec_token_ids) for r in decoding]
    for request, n, fit in zip(decoding, counts, fit_row_budget(counts, budget), strict=True):
        if fit < n:
            request.spec_token_ids = request.spec_token_ids[:fit]
