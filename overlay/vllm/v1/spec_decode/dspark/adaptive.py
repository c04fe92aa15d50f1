"""Confidence-scheduled (adaptive) verification: how many of each request's drafts to verify.

The draft's confidence head gives, per request and slot ``j``, the probability ``c_j`` that
the target accepts draft ``j`` given that the drafts before it were accepted; the survival
``S_j = c_1 * ... * c_j`` is the chance that draft ``j`` is emitted. Verifying a draft costs
one more target row. Per step, the drafts of the whole batch are ranked by survival and the
best ``b`` are verified, with ``b`` chosen to maximise the expected tokens per second of
measured step time:

    (requests + S_(1) + ... + S_(b)) / T(requests, requests + b)

where ``S_(i)`` is the i-th largest survival and ``T`` the step time this engine measured at
start-up (``cost_table.StepCostTable``). A cut is made only when it promises at least
``min_gain`` (4%) more than verifying every draft, and, once cutting, keeps cutting while it
promises half that (hysteresis: a table's noise must not flip the width step to step). With a
row budget the step never carries more rows: the lowest-survival drafts go first, whatever
the gain. Seeded sampled requests verify all k drafts (a cut decides how many random draws a
request makes, and a batch-wide cut would make a seeded request's output depend on its
neighbours): they rank ahead of every other draft, so only a row budget can cut them.
Survival never grows along a request, so the verified drafts of each request are a prefix.
The rule runs on the device with static shapes and no device-to-host read; how the cut
reaches the scheduler depends on the scheduling:

- synchronous: drafts past the prefix are replaced by ``CUT`` in the draft-token tensor,
  which the runner copies to the host anyway to hand the drafts to the scheduler; the host
  trims them there (``trim_cut``), so the next step verifies exactly the admitted drafts;
- async: the scheduler has already reserved the next step's draft slots when the drafts
  are made, so each request's admitted count (``draft_budgets``) travels back with the
  step's sampled tokens (their own copy to the host) and becomes the request's draft
  budget for the step after next: one step late, as upstream's V2 budget is.
"""

from __future__ import annotations

import torch

__all__ = [
    "CUT",
    "NO_BUDGET",
    "apply_cut",
    "draft_budget_mask",
    "draft_budgets",
    "fit_row_budget",
    "hold_row_budget",
    "trim_cut",
]

CUT = -1  # a draft slot past the cut (never a token id)
NO_BUDGET = -1  # a request the rule did not rank (async scheduling: keep k drafts)
# A whole row's slots rank above every competing one (survivals are in [0, 1]).
_WHOLE_FIRST = 2.0


def draft_budget_mask(
    confidence: torch.Tensor,
    eligible: torch.Tensor,
    *,
    num_ranked: int,
    num_whole_drafts: int,
    max_drafts: int,
    step_ms: torch.Tensor,
    min_gain: float,
    whole: torch.Tensor | None = None,
    cutting: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, k]`` bool: the draft slots worth verifying next step.

    ``confidence [B, k]`` per-slot acceptance probabilities (device; NaN counts as 0);
    ``eligible [B]`` (device bool) rows whose drafts compete (not pad rows, not requests in
    chunked prefill, not ``whole`` rows); ``whole [B]`` (device bool, or None) rows that
    verify all k drafts unless the budget forbids it. Host ints from the plan:
    ``num_ranked`` eligible plus whole rows (each emits one token whatever is cut),
    ``num_whole_drafts`` whole rows x k, ``max_drafts`` the most drafts the step may admit
    (all ranked drafts, or fewer under a row budget). ``step_ms [>= max_drafts + 1]``
    (device) the measured step time with ``b`` drafts admitted. ``cutting`` (device bool
    scalar or None): the hysteresis state, read and updated in place. Ties keep the
    smaller budget; an ineligible row keeps nothing.
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
    out = []
    for drafts in draft_lists:
        try:
            out.append(drafts[: drafts.index(CUT)])
        except ValueError:
            out.append(drafts)
    return out


def fit_row_budget(counts: list[int], budget: int) -> list[int]:
    """Host side (async scheduler): drafts per request trimmed so that one step's verify
    rows, one per request plus its drafts, fit ``budget``. The longest lists lose first, so
    the requests keep as even a share as the budget allows; nothing grows."""
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
    """Scheduler side, after the next step's drafts (or async placeholders) are set: trim
    the running requests' ``spec_token_ids`` in place so that step never carries more
    verify rows than ``budget``. A backstop for what the cut cannot see: a request skipped
    for a step keeps drafts from an earlier cut, and async placeholders precede any cut."""
    decoding = [r for r in running if not r.is_prefill_chunk]
    counts = [len(r.spec_token_ids) for r in decoding]
    for request, n, fit in zip(decoding, counts, fit_row_budget(counts, budget), strict=True):
        if fit < n:
            request.spec_token_ids = request.spec_token_ids[:fit]
