"""The steps the engine serves correct its start-up cost table (host only).

The start-up table (``cost_table``) times the target forward, the logits and the draft
block on dummy inputs. A served step also pays the scheduler, the sampler, output
processing and the host plan, and its rows are real continuations (an MoE routes them to
fewer distinct experts than random ids; its contexts are the requests' own). The cut rule
compares tokens per ms, so a constant the table misses moves the cut as much as a wrong
row price: on the memory-bound CPU twin the table priced a verify row at about twice what
served steps paid, and the rule cut deeper than the best fixed width. So the engine fits,
on the steps it serves,

    served_ms = a + b * table_ms(requests, rows)

by exponentially weighted least squares, and the rule reads ``a + b * table``: the table
keeps its shape (tiles, cliffs), the served steps set its offset and scale. An observation
is the time from one proposal to the next when both steps are decode steps of the same
requests (none in prefill): that interval holds exactly one step of that shape (scheduling,
the target forward over its verify rows, sampling, the draft block). Until the observations
pin ``b`` down (its standard error at most ``MAX_SLOPE_ERROR``: few steps of widely spread
table times, or many of narrowly spread ones), the table is used as measured. A few steps
explore (one in 8 until then, one in 64 after), alternately wide (every draft verified: the
wide end is seen even when the rule cuts deep) and narrow (about one draft per request: the
narrow end is seen even when the rule keeps full width, which alone would never spread the
times); densely for the first 256 proposals at most.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

__all__ = ["ServedStepFit"]


class ServedStepFit:
    """Weighted least squares of served step time on table step time, one step at a time.

    ``half_life``: observations after which one's weight halves (the fit follows a change
    of load or of the requests' lengths). ``min_steps``: observations before a fit.
    ``clock``: seconds (a stand-in in tests).
    """

    # Once fitted, a step slower than this many times the prediction is a stall (a pause of
    # the host, not a step of this shape): not observed. Before, the table may be off by
    # any factor, so every step counts.
    OUTLIER = 4.0
    # The fitted scale never falls below this: a step with more rows never costs less.
    MIN_SCALE = 0.02
    # Nor rises above this: a served row costs at most the table's (random ids route each
    # table row to its own experts; real continuations share them). So the correction can
    # only make the rule cut less than the measured table says, never more. On the CPU twin
    # at c=8 the fit's noise (2 cores, ~10 ms per ~150 ms step) gave scales from 0.6 to 1.6
    # where the steps measured one by one followed 12 ms + 1.02 x table; at 1.32 the rule
    # cut to an acceptance length of 3.5 where full width (5.1) was 12% faster.
    MAX_SCALE = 1.0
    # Explore on one step in EXPLORE_DENSE until the fit's slope is known, one in
    # EXPLORE_SPARSE after (measured on the CPU twin: exploring one step in 4 cost auto 4-5%
    # of its tokens/s where full width is the slowest mode). Dense for DENSE_PROPOSALS at
    # most: where steps are too short for the host clock to pin the slope (the tiny model's
    # few-ms steps), the table is used as measured and exploring stops costing tokens.
    EXPLORE_DENSE = 8
    EXPLORE_SPARSE = 64
    DENSE_PROPOSALS = 256
    # The fit is used once the standard error of its scale ``b`` is at most this. A spread
    # threshold alone failed on the CPU twin at c=1: the rule kept full width, one step in
    # 16 was narrow, the times spread by 4% (under a 5% bar) and the fit never formed, so
    # the dense exploration's narrow steps cost 3% of the tokens for good.
    MAX_SLOPE_ERROR = 0.15
    WIDE, NARROW = "wide", "narrow"

    def __init__(
        self,
        half_life: float = 256.0,
        min_steps: int = 32,
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

    def explore(self) -> str | None:
        """How this proposal verifies when it explores: ``WIDE`` (every draft) or ``NARROW``
        (about one draft per request), alternately; None when it does not. Called once per
        proposal, the same sequence on every TP rank."""
        self.proposals += 1
        dense = self.proposals <= self.DENSE_PROPOSALS and not self.slope_known()
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
        """Whether the observations pin the scale ``b`` down: its standard error (residual
        variance over effective observations times the table times' variance) is at most
        ``MAX_SLOPE_ERROR``. One table time only (one shape served) never does."""
        moments = self._moments()
        if moments is None:
            return False
        _, _, var_x, cov, var_y = moments
        # Relative floor: table times within rounding of each other are one shape.
        if var_x <= 1e-9 * (self.sums[1] / self.sums[0]) ** 2:
            return False
        residual = max(var_y - cov * cov / var_x, 0.0)
        w, ww = self.sums[0], self.sums[6]
        effective = w * w / ww
        return residual / (effective * var_x) <= self.MAX_SLOPE_ERROR**2

    def step(self, req_ids: Sequence[str], decode_only: bool, table_ms: float) -> None:
        """At each proposal: ``req_ids`` of this step, whether none of them was in prefill,
        and the table's time for its shape. Observes the interval since the last proposal
        when both steps were decode steps of the same requests."""
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
        d = self.decay
        s = self.sums
        for i, v in enumerate((1.0, table_ms, served_ms, table_ms * table_ms,
                               table_ms * served_ms, served_ms * served_ms)):
            s[i] = s[i] * d + v
        s[6] = s[6] * d * d + 1.0
        self.steps += 1

    def predict(self, table_ms: float) -> float:
        a, b = self.fitted or (0.0, 1.0)
        return a + b * table_ms

    def fit(self) -> tuple[float, float] | None:
        """``(a, b)`` once the observations allow it, else None; kept as ``fitted``."""
        if self.steps < self.min_steps or not self.slope_known():
            return None
        mean_x, mean_y, var_x, cov, _ = self._moments()
        b = min(max(cov / var_x, self.MIN_SCALE), self.MAX_SCALE)
        # Keep every fitted time positive down to half the mean table time.
        a = max(mean_y - b * mean_x, -0.5 * b * mean_x)
        self.fitted = (a, b)
        return self.fitted
