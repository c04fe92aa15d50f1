"""Percentiles and summaries of latency / throughput samples (no third-party imports)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

STATS_KEYS = ("n", "mean", "min", "max", "p50", "p90", "p99")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (the same rule as numpy's default), q in [0, 100]."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Iterable[float | None]) -> dict[str, float | int] | None:
    """{n, mean, min, max, p50, p90, p99} of the non-None values, or None if there are none."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return None
    return {
        "n": len(xs),
        "mean": sum(xs) / len(xs),
        "min": min(xs),
        "max": max(xs),
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
    }
