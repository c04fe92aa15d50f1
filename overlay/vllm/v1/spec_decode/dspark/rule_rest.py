"""The cut rule rests while it admits every draft (host only).

``auto`` runs the rule where the table says some cut could pay, yet where the confidence head
trusts every draft the rule cuts nothing and still pays, every step, the head's pass, its
calibration and the sort (0.44 ms of a 24 ms step on cpu-tiny at 8 requests: 2%). The host
knows what the last cut admitted without a device read: the drafts the scheduler hands back
to verify. After ``rest_after`` rule steps in a row that verify every draft the rule rests
for ``rest_for`` proposals, then runs again to look. Every TP rank sees the same scheduler
output and explores alike (rank 0's fit says how often), so all rest alike.
"""

from __future__ import annotations

__all__ = ["RuleRest"]


class RuleRest:
    """When the rule rests: a count of uncut rule steps and the rest's countdown."""

    REST, WAKE = "rest", "wake"

    def __init__(self, rest_after: int = 64, rest_for: int = 512) -> None:
        if rest_after < 1 or rest_for < 1:
            raise ValueError(f"rest_after and rest_for must be >= 1, got {rest_after}, {rest_for}")
        self.rest_after, self.rest_for = rest_after, rest_for
        self.uncut = 0  # rule steps in a row that verified every draft
        self.left = 0  # proposals left to rest
        self.rests = 0  # rests so far

    @property
    def resting(self) -> bool:
        return self.left > 0

    def step(self, judged: bool, admitted_all: bool) -> str | None:
        """Once per proposal. ``judged``: this step verifies what the rule's own cut admitted
        (a decode step after a step the rule cut, exploring steps excluded); ``admitted_all``:
        it verifies every draft. ``REST`` when the rule rests from now, ``WAKE`` when the rest
        is over, else None."""
        if self.left:
            self.left -= 1
            return None if self.left else self.WAKE
        if not judged:
            return None
        self.uncut = self.uncut + 1 if admitted_all else 0
        if self.uncut < self.rest_after:
            return None
        self.uncut, self.left = 0, self.rest_for
        self.rests += 1
        return self.REST
