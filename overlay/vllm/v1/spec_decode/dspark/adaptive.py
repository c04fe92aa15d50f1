"""Confidence-scheduled (adaptive) verification: how many of each request's drafts to verify.

The draft's confidence head gives, per request and slot ``j``, the probability ``c_j`` that
the target accepts draft ``j`` given that the drafts before it were accepted; the survival
``S_j = c_1 * ... * c_j`` is the chance that draft ``j`` is emitted. Verifying a draft costs
one more target row. Per step, the drafts of the whole batch are ranked by survival and the
best ``b`` are verified, with ``b`` chosen to maximise the expected tokens per unit of step
cost (throughput):

    (requests + S_(1) + ... + S_(b)) / cost(rows + b)

where ``S_(i)`` is the i-th largest survival and ``cost`` the step's cost by verify rows
(``VerifyCost``). Seeded sampled requests are left out of the ranking and verify all k
drafts: a cut decides how many random draws a request makes, and a batch-wide cut would
make a seeded request's output depend on its neighbours in the step. Survival never grows along a request, so the verified drafts of each
request are a prefix. The rule runs on the device with static shapes and no device-to-host
read; how the cut reaches the scheduler depends on the scheduling:

- synchronous: drafts past the prefix are replaced by ``CUT`` in the draft-token tensor,
  which the runner copies to the host anyway to hand the drafts to the scheduler; the host
  trims them there (``trim_cut``), so the next step verifies exactly the admitted drafts;
- async: the scheduler has already reserved the next step's draft slots when the drafts
  are made, so each request's admitted count (``draft_budgets``) travels back with the
  step's sampled tokens (their own copy to the host) and becomes the request's draft
  budget for the step after next: one step late, as upstream's V2 budget is.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

__all__ = [
    "CUT",
    "NO_BUDGET",
    "ROW_COST_ENV",
    "VerifyCost",
    "apply_cut",
    "draft_budget_mask",
    "draft_budgets",
    "trim_cut",
]

CUT = -1  # a draft slot past the cut (never a token id)
NO_BUDGET = -1  # a request the rule did not rank (async scheduling: keep k drafts)
ROW_COST_ENV = "DSPARK_VERIFY_ROW_COST"
# One more verify row as a fraction of a step's fixed cost. ``python -m scripts.bench.adaptive``
# fits it on the machine at hand: 0.007 to 0.05 for the tiny checkpoint on a shared 2-core
# EPYC Zen 5. A deployment sets its own (DSPARK_VERIFY_ROW_COST in the profile's env).
DEFAULT_ROW_COST = 0.01


@dataclass(frozen=True)
class VerifyCost:
    """A step's cost by verify rows, in units of its fixed cost: ``1 + row_cost * rows``.

    ``row_cost`` comes from the serving profile (``DSPARK_VERIFY_ROW_COST``), not from a
    start-up timing: every TP rank and every run must cut the same drafts, or seeded
    sampling would not reproduce (the cut decides how many random draws a step makes).
    """

    row_cost: float = DEFAULT_ROW_COST

    def __post_init__(self) -> None:
        if not (math.isfinite(self.row_cost) and 0.0 <= self.row_cost <= 100.0):
            raise ValueError(
                f"{ROW_COST_ENV}: expected a number in [0, 100] (a verify row's cost as a "
                f"fraction of a step's fixed cost), got {self.row_cost!r}"
            )

    @classmethod
    def from_env(cls) -> VerifyCost:
        raw = os.environ.get(ROW_COST_ENV)
        if raw is None or not raw.strip():
            return cls()
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(
                f"{ROW_COST_ENV}: expected a number in [0, 100], got {raw!r}"
            ) from None
        return cls(value)

    def table(self, max_rows: int, device: torch.device | str) -> torch.Tensor:
        """``cost[rows]`` for ``rows`` in ``0..max_rows`` (float32, on ``device``)."""
        rows = torch.arange(max_rows + 1, dtype=torch.float64)
        return (1.0 + self.row_cost * rows).to(device=device, dtype=torch.float32)


def draft_budget_mask(
    confidence: torch.Tensor,
    eligible: torch.Tensor,
    num_eligible: int,
    base_rows: int,
    cost_table: torch.Tensor,
    whole: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, k]`` bool: the draft slots worth verifying next step.

    ``confidence [B, k]`` per-slot acceptance probabilities (device; NaN counts as 0);
    ``eligible [B]`` (device bool) rows whose drafts compete for verification (not pad rows,
    not requests in chunked prefill, not ``whole`` rows); ``whole [B]`` (device bool, or
    None) rows that verify all k drafts whatever the rule says (seeded sampled requests):
    they count in the step's expected tokens and rows but do not compete. ``num_eligible``
    is the number of eligible rows and ``base_rows`` the rows the next step has before any
    competing draft (one per request plus k per whole row), both host ints from the plan;
    ``cost_table`` from ``VerifyCost.table`` with at least ``base_rows + num_eligible * k +
    1`` entries. Ties keep the smaller budget; an ineligible row keeps nothing.
    """
    rows, k = confidence.shape
    conf = torch.nan_to_num(confidence.float(), nan=0.0).clamp(0.0, 1.0)
    survival = conf.cumprod(dim=1)
    # Ineligible slots score below every real one, so they sort last and are never admitted.
    score = torch.where(eligible[:, None], survival, -1.0).flatten()
    ranked, order = torch.sort(score, descending=True, stable=True)
    max_budget = num_eligible * k
    gains = torch.cumsum(ranked[:max_budget], dim=0)
    expected = torch.cat([gains.new_zeros(1), gains]) + float(num_eligible)
    if whole is not None:  # each whole row emits 1 token plus its expected accepted drafts
        expected = expected + (whole[:, None] * (1.0 + survival.sum(dim=1, keepdim=True))).sum()
    throughput = expected / cost_table[base_rows : base_rows + max_budget + 1]
    budget = torch.argmax(throughput)  # the first maximum: the smallest budget on ties
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(rows * k, device=order.device))
    keep = (rank < budget).view(rows, k)
    return keep if whole is None else keep | whole[:, None]


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
