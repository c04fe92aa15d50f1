"""Measured step costs for adaptive verification: T(requests, verify rows), on the host.

A verify row's cost is not linear (kernel tiles and the experts extra rows route to on a GPU,
the cache on a CPU), so the cut rule (``adaptive.draft_budget_mask``) assumes no cost model and
reads a table measured on the engine itself; its grid, passes, interpolation, TP broadcast and
JSON cache are described in overlay/README.md ("Adaptive verification").
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["BUDGET_ENV", "DEFAULT_MIN_GAIN", "MODE_ENV", "StepCostTable", "cache_path", "table_key"]

# How the cut runs once vLLM's enable_adaptive_verification is on: "on" (every step) or "auto"
# (when the table predicts a gain or a row budget binds); rendered from `speculative.adaptive`.
MODE_ENV = "DSPARK_ADAPTIVE"
MODES = ("on", "auto")
# The most verify rows (one per request plus its drafts) one step may carry, e.g. the
# decode-row limit of the attention backend. Rendered by the recipe; unset: no limit.
BUDGET_ENV = "DSPARK_VERIFY_ROW_BUDGET"
CACHE_DIR_ENV = "DSPARK_COST_TABLE_DIR"  # where tables are kept (default: vLLM's cache root)
# A cut must promise at least this much more throughput than full-width verification (the
# field's default: a table's error should not make the cut cost more than it returns).
DEFAULT_MIN_GAIN = 0.04
TABLE_VERSION = 2  # 2: measured in 3-16 passes (1: two passes, which overstated rows)
# Passes over the grid: at least MIN_PASSES, more while they fit in MEASURE_SECONDS, at most
# MAX_PASSES. Two passes were not enough on a 2-core CPU: the faster of two still overstated
# 8 requests' full-width step by 23% (27.8 ms where 20 passes' fastest was 22.6), so the rule
# cut drafts whose rows cost nothing like that.
MIN_PASSES, MAX_PASSES = 3, 16
MEASURE_SECONDS = 3.0
# A table whose passes disagree by more than this (median over points of the median pass
# over the fastest) was measured on a busy machine: it is used, but not kept for the next
# start, which measures again.
MAX_CACHED_SPREAD = 0.2
CONTEXT_TOKENS = 256  # context per request in the timed forwards, read by every verify row


@dataclass(frozen=True)
class StepCostTable:
    """Step time in ms, ``ms[i][w]``, for ``requests[i]`` requests verifying ``w`` drafts
    each (``requests[i] x (w + 1)`` rows); NaN where the point was not measured (over a
    budget). ``row_budget``: rows a step may not exceed (None: no limit)."""

    requests: tuple[int, ...]
    ms: tuple[tuple[float, ...], ...]
    row_budget: int | None = None
    measure_seconds: float = 0.0
    spread: float = 0.0  # median over points of (median pass / fastest - 1): how busy it was
    passes: int = 0  # passes over the grid it was measured in

    def __post_init__(self) -> None:
        table = np.asarray(self.ms, dtype=np.float64)
        if not self.requests or list(self.requests) != sorted(set(self.requests)):
            raise ValueError(f"requests must be ascending and distinct, got {self.requests}")
        if self.requests[0] < 1 or table.ndim != 2 or table.shape[0] != len(self.requests):
            raise ValueError("ms must hold one row of widths per request count (counts >= 1)")
        if table.shape[1] < 1 or np.isnan(table[:, 0]).any() or (table[~np.isnan(table)] <= 0).any():
            raise ValueError("every request count needs a positive time at width 0")

    @property
    def num_spec_tokens(self) -> int:
        return len(self.ms[0]) - 1

    def step_ms(self, requests: int, rows: float) -> float:
        """Interpolated step time; ``inf`` over the row budget."""
        if self.row_budget is not None and rows > self.row_budget:
            return float("inf")
        grid, width = self.requests, rows / requests - 1.0  # drafts per request
        requests = min(max(requests, grid[0]), grid[-1])  # outside the grid: the nearest
        hi = int(np.searchsorted(grid, requests))
        if grid[hi] == requests:
            return self._at(hi, width)
        lo = hi - 1
        frac = (requests - grid[lo]) / (grid[hi] - grid[lo])
        return (1.0 - frac) * self._at(lo, width) + frac * self._at(hi, width)

    def _at(self, i: int, width: float) -> float:
        """Row ``i`` at a fractional width, linear between measured widths (extrapolated
        past the last measured one with its last slope)."""
        times = np.asarray(self.ms[i], dtype=np.float64)
        measured = np.flatnonzero(~np.isnan(times))
        if measured.size == 1:
            return float(times[measured[0]])
        x, y = measured.astype(np.float64), times[measured]
        if width <= x[-1]:
            return float(np.interp(max(width, 0.0), x, y))
        slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
        return float(y[-1] + slope * (width - x[-1]))

    def matrix(self, max_requests: int, max_rows: int) -> np.ndarray:
        """``[max_requests + 1, max_rows + 1]`` float32: step time by (requests, rows), what
        the device rule indexes (row 0 and rows below the request count are never read)."""
        out = np.ones((max_requests + 1, max_rows + 1), dtype=np.float64)
        for r in range(1, max_requests + 1):
            for rows in range(r, max_rows + 1):
                out[r, rows] = self.step_ms(r, rows)
        return out.astype(np.float32)

    def max_gain(self, num_requests: int | None = None) -> float:
        """The most any cut could gain: full-width time (capped by the budget) over no drafts',
        less one, at the worst request count up to ``num_requests``. Drafts never accepted are
        the best case for cutting, so below a threshold here no step can gain from a cut."""
        best = 0.0
        for r in self.requests:
            if num_requests is not None and r > num_requests:
                break
            full = r * (self.num_spec_tokens + 1)
            if self.row_budget is not None:
                full = min(full, self.row_budget)
            best = max(best, self.step_ms(r, full) / self.step_ms(r, r) - 1.0)
        return best

    def affine(self, offset: float, scale: float) -> StepCostTable:
        """This table with every time ``offset + scale * ms`` (served steps' correction)."""
        ms = tuple(tuple(offset + scale * t for t in row) for row in self.ms)
        return StepCostTable(self.requests, ms, self.row_budget, self.measure_seconds, self.spread,
                              self.passes)

    def describe(self) -> str:
        """A few lines for the log: ms by requests (rows) and width."""
        head = "requests | " + " ".join(f"w={w:<6d}" for w in range(self.num_spec_tokens + 1))
        lines = [head]
        for r, times in zip(self.requests, self.ms, strict=True):
            cells = " ".join("   -   " if np.isnan(t) else f"{t:7.2f}" for t in times)
            lines.append(f"{r:8d} | {cells}")
        return "\n".join(lines)

    def to_json(self) -> str:
        ms = [[None if np.isnan(t) else round(float(t), 4) for t in row] for row in self.ms]
        return json.dumps({"version": TABLE_VERSION, "requests": list(self.requests), "ms": ms,
                           "row_budget": self.row_budget,
                           "measure_seconds": round(self.measure_seconds, 3),
                           "spread": round(self.spread, 4), "passes": self.passes})

    @classmethod
    def from_json(cls, text: str) -> StepCostTable:
        data = json.loads(text)
        if data.get("version") != TABLE_VERSION:
            raise ValueError(f"cost table version {data.get('version')} != {TABLE_VERSION}")
        ms = tuple(tuple(float("nan") if t is None else float(t) for t in row)
                   for row in data["ms"])
        return cls(tuple(data["requests"]), ms, data["row_budget"],
                   float(data.get("measure_seconds", 0.0)), float(data.get("spread", 0.0)),
                   int(data.get("passes", 0)))


def monotone_in_rows(times: Sequence[float]) -> list[float]:
    """Each time replaced by the smallest at its width or any wider one: more rows never
    cost less, so a faster wider point bounds a narrower one (a stall on a shared machine
    inflates single points; it never deflates them)."""
    out, low = list(times), float("inf")
    for w in range(len(out) - 1, -1, -1):
        if not np.isnan(out[w]):
            low = min(low, out[w])
            out[w] = low
    return out


def measure(
    run_point: Callable[[int, int], float],
    requests: Sequence[int],
    num_spec_tokens: int,
    *,
    row_budget: int | None,
    max_rows: int,
    min_passes: int = MIN_PASSES,
    max_passes: int = MAX_PASSES,
    seconds: float = MEASURE_SECONDS,
    clock: Callable[[], float] = time.perf_counter,
    agree: Callable[[bool], bool] = bool,
) -> StepCostTable:
    """Time ``run_point(requests, width)`` (ms) over the grid in round-robin passes (a slow
    spell spreads over all points): ``min_passes``, then more while another pass of the
    last one's length fits in ``seconds``, ``max_passes`` at most. Per point the fastest
    pass is kept (one-time costs and a busy machine only add time). The passes are collective
    under TP: ``agree`` turns rank 0's decision to stop into every rank's."""
    start = clock()
    limit = max_rows if row_budget is None else min(max_rows, row_budget)
    requests = [r for r in requests if r <= limit]  # at least one row per request
    points = [(i, r, w) for i, r in enumerate(requests) for w in range(num_spec_tokens + 1)
              if r * (w + 1) <= limit]
    times = np.full((max_passes, len(requests), num_spec_tokens + 1), np.nan)
    passes, pass_start = 0, start
    while passes < max_passes:
        for i, r, w in points:
            times[passes, i, w] = run_point(r, w)
        passes += 1
        now = clock()
        if agree(passes >= min_passes and now - start + (now - pass_start) > seconds):
            break
        pass_start = now
    times = times[:passes]
    timed = ~np.isnan(times[0])  # the points within the row limit
    best = np.full(times.shape[1:], np.nan)
    best[timed] = times[:, timed].min(axis=0)
    spread = float(np.median(np.median(times[:, timed], axis=0) / best[timed] - 1.0)) if points else 0.0
    ms = tuple(tuple(monotone_in_rows(row)) for row in best.tolist())
    return StepCostTable(tuple(requests), ms, row_budget, clock() - start, spread, passes)


def device_name(device_type: str) -> str:
    if device_type == "cuda":
        return torch.cuda.get_device_name()
    info = Path("/proc/cpuinfo")
    found = re.search(r"^model name\s*:\s*(.+)$", info.read_text(), re.M) if info.exists() else None
    name = found.group(1) if found else platform.processor() or platform.machine()
    return f"{name} x{torch.get_num_threads()} threads"


def table_key(settings: dict) -> str:
    """A stable short hash of everything that changes the table."""
    blob = json.dumps({**settings, "table_version": TABLE_VERSION}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def cache_path(key: str) -> Path:
    root = os.environ.get(CACHE_DIR_ENV)
    if not root:
        import vllm.envs as envs

        root = os.path.join(envs.VLLM_CACHE_ROOT, "dspark", "cost_tables")
    return Path(root) / f"{key}.json"


def read_cached(path: Path) -> StepCostTable | None:
    try:
        return StepCostTable.from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_cached(path: Path, table: StepCostTable) -> None:
    """Atomically (a reader never sees half a file); a failure only costs the next start."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(table.to_json())
        os.replace(tmp, path)
    except OSError:
        pass


def env_mode() -> str:
    mode = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{MODE_ENV}: expected one of {MODES}, got {mode!r}")
    return mode


def env_row_budget() -> int | None:
    raw = os.environ.get(BUDGET_ENV, "").strip()
    if not raw:
        return None
    try:
        budget = int(raw)
    except ValueError:
        budget = 0
    if budget < 1:
        raise ValueError(f"{BUDGET_ENV}: expected a positive integer (rows), got {raw!r}")
    return budget
