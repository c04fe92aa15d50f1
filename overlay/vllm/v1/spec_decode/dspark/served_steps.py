"""The steps the engine serves correct its start-up cost table (host only).

The table (``cost_table``) times only dummy forwards; a served step also pays the scheduler,
the sampler, output processing and the host plan, on real continuations (on the CPU twin the
table priced a verify row at about twice what served steps paid). So the engine fits
``served_ms = a + b * table_ms(requests, rows)`` by exponentially weighted least squares over
consecutive decode steps of the same requests (the interval between their proposals is one
step of that shape) and the rule reads ``a + b * table``, keeping the table's tiles and cliffs.
How it explores until ``b`` is pinned down: overlay/README.md ("Served steps correct the table").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

__all__ = ["ServedStepFit"]


class ServedStepFit:
    """Weighted least squares of served step time on table step time, one step at a time.
    ``half_life`` in observations lets the fit follow a change of load or of the requests'
    lengths; ``min_steps``: observations before a fit; ``clock``: seconds (tests stub it)."""

    # Once fitted, a step over this many times the prediction is a stall (a host pause), not
    # observed; before, the table may be off by any factor, so every step counts.
    OUTLIER = 4.0
    MIN_SCALE = 0.02  # the fitted scale's floor: a step with more rows never costs less
    # Its ceiling: a served row costs at most the table's (random ids route each table row to
    # its own experts; real continuations share them), so the correction only makes the rule
    # cut less. On the CPU twin at c=8 the fit's noise gave scales of 0.6-1.6 where steps
    # followed 12 ms + 1.02 x table; at 1.32 the rule cut to where full width was 12% faster.
    MAX_SCALE = 1.0
    # Explore one step in EXPLORE_DENSE until a fit finds the slope known (``pinned``: under TP
    # rank 0's, broadcast at each refit), one in EXPLORE_SPARSE after
    # (one in 4 cost the CPU twin 4-5% of its tokens/s); dense for DENSE_PROPOSALS at most:
    # where steps are too short for the host clock to pin the slope, exploring stops costing.
    EXPLORE_DENSE = 8
    EXPLORE_SPARSE = 64
    DENSE_PROPOSALS = 256
    # The fit's scale ``b`` is used once its standard error is at most this (with a bar
    # on the spread alone it never formed on the CPU twin at c=1: exploring cost 3% for good).
    MAX_SLOPE_ERROR = 0.15
    WIDE, NARROW = "wide", "narrow"

    def __init__(
        self, half_life: float = 256.0, min_steps: int = 32,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.decay = 0.5 ** (1.0 / half_life)
        self.min_steps, self.clock = min_steps, clock
        self.steps = 0  # observations so far
        # weight, x, y, xx, xy, yy (x: table ms, y: served ms), and the squared weights
        self.sums = [0.0] * 7
        self.last: tuple[float, tuple[str, ...] | None] | None = None
        self.fitted: tuple[float, float] | None = None
        self.proposals = 0
        self.explored = 0  # exploring proposals so far
        # Whether the slope was known at the last fit: what exploration reads, so that under
        # TP every rank (each with its own clock) explores alike once rank 0's is broadcast.
        self.pinned = False

    def explore(self) -> str | None:
        """Once per proposal (the same sequence on every TP rank): ``WIDE`` (every draft) or
        ``NARROW`` (about one per request), alternately, when this one explores, else None."""
        self.proposals += 1
        dense = self.proposals <= self.DENSE_PROPOSALS and not self.pinned
        every = self.EXPLORE_DENSE if dense else self.EXPLORE_SPARSE
        if self.proposals % every:
            return None
        self.explored += 1
        return self.WIDE if self.explored % 2 else self.NARROW

    def _moments(self) -> tuple[float, float, float, float, float] | None:
        """Weighted (mean x, mean y, var x, cov xy, var y), None before any observation."""
        w, x, y, xx, xy, yy, _ = self.sums
        if w <= 0.0:
            return None
        mx, my = x / w, y / w
        return mx, my, xx / w - mx * mx, xy / w - mx * my, yy / w - my * my

    def slope_known(self) -> bool:
        """Whether the standard error of the scale ``b`` is at most ``MAX_SLOPE_ERROR``; one
        table time only (one shape served) never pins it down."""
        moments = self._moments()
        if moments is None:
            return False
        _, _, var_x, cov, var_y = moments
        # Relative floor: table times within rounding of each other are one shape.
        if var_x <= 1e-9 * (self.sums[1] / self.sums[0]) ** 2:
            return False
        residual = max(var_y - cov * cov / var_x, 0.0)
        effective = self.sums[0] * self.sums[0] / self.sums[6]
        return residual / (effective * var_x) <= self.MAX_SLOPE_ERROR**2

    def step(self, req_ids: Sequence[str], decode_only: bool, table_ms: float) -> None:
        """At each proposal: observe the interval since the last one when both steps were
        decode steps (``decode_only``) of the same ``req_ids``, at the table's ``table_ms``."""
        now = self.clock()
        key = tuple(req_ids) if decode_only else None
        if self.last is not None and key is not None and self.last[1] == key:
            self.observe(table_ms, (now - self.last[0]) * 1e3)
        self.last = (now, key)

    def observe(self, table_ms: float, served_ms: float) -> None:
        if served_ms <= 0.0:
            return
        if self.fitted is not None and served_ms > self.OUTLIER * self.predict(table_ms):
            return
        d, s = self.decay, self.sums
        for i, v in enumerate((1.0, table_ms, served_ms, table_ms * table_ms,
                               table_ms * served_ms, served_ms * served_ms)):
            s[i] = s[i] * d + v
        s[6] = s[6] * d * d + 1.0
        self.steps += 1

    def predict(self, table_ms: float) -> float:
        a, b = self.fitted or (0.0, 1.0)
        return a + b * table_ms

    def fit(self) -> tuple[float, float] | None:
        """``(a, b)`` once ``min_steps`` steps were observed, else None; kept as ``fitted``.
        Until the observations pin the slope down, ``b`` is ``MAX_SCALE`` (the most a served
        row may cost) and ``a`` the served steps' mean excess over the table: a constant the
        table misses dilutes what rows cost, so the raw table would make the rule cut more."""
        self.pinned = self.slope_known()
        if self.steps < self.min_steps:
            return None
        mean_x, mean_y, var_x, cov, _ = self._moments()
        if self.pinned:
            b = min(max(cov / var_x, self.MIN_SCALE), self.MAX_SCALE)
        else:
            b = self.MAX_SCALE
        # Keep every fitted time positive down to half the mean table time.
        a = max(mean_y - b * mean_x, -0.5 * b * mean_x)
        self.fitted = (a, b)
        return self.fitted
