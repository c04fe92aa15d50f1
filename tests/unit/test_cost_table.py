"""Adaptive verification's step-time table: grid, interpolation, budget, cache file."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.support.overlay import load_overlay_module

# Loaded by path: the table is host code, no vLLM import (unit tier).
cost_table = load_overlay_module("vllm/v1/spec_decode/dspark/cost_table.py")
StepCostTable, measure = cost_table.StepCostTable, cost_table.measure
monotone_in_rows = cost_table.monotone_in_rows
adaptive = load_overlay_module("vllm/v1/spec_decode/dspark/adaptive.py")
fit_row_budget, hold_row_budget = adaptive.fit_row_budget, adaptive.hold_row_budget


def test_interpolation_is_linear_in_width_and_in_requests():
    # 2 and 4 requests, k = 2: times at 2x1, 2x2, 2x3 and 4x1, 4x2, 4x3 rows.
    table = StepCostTable((2, 4), ((10.0, 12.0, 16.0), (20.0, 30.0, 34.0)))
    assert table.step_ms(2, 2) == 10.0 and table.step_ms(4, 12) == 34.0
    assert table.step_ms(2, 3) == pytest.approx(11.0)  # width 0.5: halfway 10 -> 12
    assert table.step_ms(4, 10) == pytest.approx(32.0)  # width 1.5: halfway 30 -> 34
    # 3 requests: halfway between the two rows at the same width (3 rows = width 0).
    assert table.step_ms(3, 3) == pytest.approx(15.0)
    assert table.step_ms(3, 6) == pytest.approx((12.0 + 30.0) / 2)
    # Outside the grid of request counts: the nearest one.
    assert table.step_ms(1, 1) == 10.0 and table.step_ms(8, 8) == 20.0


def test_budget_makes_wider_steps_infinite_and_unmeasured_widths_extrapolate():
    nan = float("nan")
    table = StepCostTable((1, 4), ((5.0, 6.0, 7.0), (8.0, 10.0, nan)), row_budget=10)
    assert table.step_ms(4, 11) == math.inf
    assert table.step_ms(4, 10) == pytest.approx(11.0)  # width 1.5, past the last measured
    matrix = table.matrix(4, 12)
    assert matrix.shape == (5, 13) and np.isinf(matrix[4, 11:]).all()
    assert matrix[1, 3] == pytest.approx(7.0)


def test_max_gain_is_full_width_over_no_drafts():
    table = StepCostTable((1, 2), ((10.0, 10.5, 11.0), (10.0, 11.0, 13.0)))
    assert table.max_gain() == pytest.approx(0.3)
    assert table.max_gain(num_requests=1) == pytest.approx(0.1)
    flat = StepCostTable((1, 2), ((10.0, 10.0, 10.0), (10.0, 10.0, 10.0)))
    assert flat.max_gain() == 0.0


def test_monotone_in_rows_keeps_the_lower_envelope():
    assert monotone_in_rows([5.0, 9.0, 6.0, 7.0]) == [5.0, 6.0, 6.0, 7.0]
    nan = float("nan")
    out = monotone_in_rows([5.0, 4.0, nan])
    assert out[:2] == [4.0, 4.0] and math.isnan(out[2])


class PassClock:
    """A host clock that advances ``ms_per_point`` per timed point (tests set the pace)."""

    def __init__(self, ms_per_point: float):
        self.now, self.ms_per_point = 0.0, ms_per_point

    def __call__(self) -> float:
        return self.now

    def point(self, ms: float) -> float:
        self.now += self.ms_per_point / 1e3
        return ms


def test_measure_times_every_point_within_the_budget_and_keeps_the_fastest():
    calls = []
    noise = iter([3.0, 0.0, 2.0, 1.0] * 100)

    def run_point(requests, width):
        calls.append((requests, width))
        return 10.0 + requests * (width + 1) + next(noise)

    table = measure(run_point, [1, 2, 4], 2, row_budget=8, max_rows=12, min_passes=3,
                    max_passes=3)
    points = {(r, w) for r in (1, 2, 4) for w in range(3) if r * (w + 1) <= 8}
    assert set(calls) == points and len(calls) == 3 * len(points) and table.passes == 3
    assert math.isnan(table.ms[2][2])  # 12 rows: over the budget, never run
    for i, r in enumerate((1, 2, 4)):
        for w in range(3):
            if (r, w) in points:
                assert table.ms[i][w] >= 10.0 + r * (w + 1)  # the noise only adds
    assert table.row_budget == 8


@pytest.mark.parametrize("ms_per_point,passes", [(10.0, 16), (90.0, 6), (1000.0, 3)])
def test_passes_fill_the_time_budget_between_the_least_and_the_most(ms_per_point, passes):
    # 5 points a pass: 50 ms, 0.45 s or 5 s per pass in a 3 s budget. A pass is started only
    # while one as long as the last still fits (the sixth 0.45 s pass ends at 2.7 s).
    clock = PassClock(ms_per_point)
    table = measure(lambda r, w: clock.point(1.0 + w), [1], 4, row_budget=None, max_rows=5,
                    min_passes=3, max_passes=16, seconds=3.0, clock=clock)
    assert table.passes == passes
    assert table.measure_seconds == pytest.approx(passes * 5 * ms_per_point / 1e3)


def test_more_passes_find_the_floor_a_busy_machine_hides():
    # Every point costs 10 ms plus a stall drawn anew each time (a shared CPU): with two
    # passes the table keeps stalls, with the time budget's passes it comes near 10 ms.
    rng = np.random.default_rng(0)
    clock = PassClock(10.0)

    def run_point(requests, width):
        return clock.point(10.0 + rng.exponential(3.0))

    two = measure(run_point, [1, 2, 4], 4, row_budget=None, max_rows=20, min_passes=2,
                  max_passes=2, clock=clock)
    many = measure(run_point, [1, 2, 4], 4, row_budget=None, max_rows=20, clock=clock)
    error = lambda t: np.nanmax(np.asarray(t.ms) - 10.0)  # noqa: E731
    assert many.passes > 2 * two.passes and error(many) < 0.5 * error(two)


def test_every_tp_rank_stops_where_rank_0_does():
    # Rank 0 wants to stop after 3 passes; another rank, whose clock says 1, follows it.
    decisions = []

    def rank0_says(stop):
        decisions.append(stop)
        return len(decisions) >= 3

    clock = PassClock(0.0)  # this rank's clock: never out of time
    table = measure(lambda r, w: 1.0, [1], 2, row_budget=None, max_rows=3, min_passes=1,
                    max_passes=16, clock=clock, agree=rank0_says)
    assert table.passes == 3 and decisions == [False, False, False]


def test_spread_says_how_far_above_their_fastest_the_passes_ran():
    table = measure(lambda r, w: 1.0 + r * (w + 1), [1, 2], 2, row_budget=None, max_rows=6)
    assert table.spread == 0.0
    passes = iter([1.0] * 3 + [2.0] * 6)  # 3 passes of 3 points: every point 1, 2, 2 ms
    busy = measure(lambda r, w: next(passes), [1], 2, row_budget=None, max_rows=3,
                   min_passes=3, max_passes=3)
    assert busy.spread == pytest.approx(1.0) and busy.ms[0] == (1.0,) * 3
    back = StepCostTable.from_json(busy.to_json())
    assert back.spread == pytest.approx(1.0) and back.passes == 3


def test_json_round_trip_and_version_check():
    nan = float("nan")
    table = StepCostTable((1, 2), ((1.0, 2.0), (3.0, nan)), row_budget=3, measure_seconds=1.5)
    back = StepCostTable.from_json(table.to_json())
    assert back.requests == (1, 2) and back.row_budget == 3 and back.ms[0] == (1.0, 2.0)
    assert math.isnan(back.ms[1][1]) and back.measure_seconds == 1.5
    with pytest.raises(ValueError, match="version"):
        StepCostTable.from_json(table.to_json().replace(
            f'"version": {cost_table.TABLE_VERSION}', '"version": 0'))


@pytest.mark.parametrize(
    "requests,ms",
    [((), ()), ((2, 1), ((1.0,), (1.0,))), ((1,), ((float("nan"), 1.0),)), ((1,), ((0.0,),))],
    ids=["empty", "unsorted", "no width 0", "zero time"],
)
def test_bad_tables_are_refused(requests, ms):
    with pytest.raises(ValueError):
        StepCostTable(requests, ms)


def test_cache_file_is_keyed_and_written_whole(tmp_path, monkeypatch):
    monkeypatch.setenv(cost_table.CACHE_DIR_ENV, str(tmp_path))
    key = cost_table.table_key({"model": "m", "k": 4})
    assert key == cost_table.table_key({"k": 4, "model": "m"})
    assert key != cost_table.table_key({"model": "m", "k": 5})
    path = cost_table.cache_path(key)
    assert path.parent == tmp_path and cost_table.read_cached(path) is None
    table = StepCostTable((1,), ((2.0, 3.0),))
    cost_table.write_cached(path, table)
    assert cost_table.read_cached(path) == table
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    path.write_text("{not json")
    assert cost_table.read_cached(path) is None  # a broken file means: measure again


def test_mode_and_budget_from_the_environment(monkeypatch):
    monkeypatch.delenv(cost_table.MODE_ENV, raising=False)
    monkeypatch.delenv(cost_table.BUDGET_ENV, raising=False)
    assert cost_table.env_mode() == "auto" and cost_table.env_row_budget() is None
    monkeypatch.setenv(cost_table.MODE_ENV, "ON")
    monkeypatch.setenv(cost_table.BUDGET_ENV, "64")
    assert cost_table.env_mode() == "on" and cost_table.env_row_budget() == 64
    for name, bad in ((cost_table.MODE_ENV, "maybe"), (cost_table.BUDGET_ENV, "0"),
                      (cost_table.BUDGET_ENV, "x")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            cost_table.env_mode() if name == cost_table.MODE_ENV else cost_table.env_row_budget()
        monkeypatch.delenv(name)


def test_fit_row_budget_trims_the_longest_first_and_never_grows():
    assert fit_row_budget([4, 4, 4], 20) == [4, 4, 4]  # 15 rows fit
    assert fit_row_budget([4, 1, 4], 9) == [3, 1, 2]  # 6 drafts: cap 2, one spare
    assert fit_row_budget([4, 4], 2) == [0, 0]
    assert fit_row_budget([2, 2], 6) == [2, 2]  # exactly the budget: kept whole
    assert fit_row_budget([3, 3, 3], 2) == [0, 0, 0]  # more requests than rows: no drafts
    for counts, budget in (([5, 0, 2, 5], 10), ([1, 2, 3, 4, 5], 12), ([5] * 16, 64)):
        fit = fit_row_budget(counts, budget)
        assert len(counts) + sum(fit) <= budget
        assert all(0 <= f <= c for f, c in zip(fit, counts, strict=True))
        # As even as possible: no request keeps 2 more than another that was trimmed.
        trimmed = [f for f, c in zip(fit, counts, strict=True) if f < c]
        assert not trimmed or max(fit) <= min(trimmed) + 1


def test_hold_row_budget_trims_running_requests_in_place():
    from types import SimpleNamespace

    shared = [-1, -1, -1, -1]  # the async scheduler shares one placeholder list
    running = [SimpleNamespace(is_prefill_chunk=False, spec_token_ids=shared) for _ in range(3)]
    running.append(SimpleNamespace(is_prefill_chunk=True, spec_token_ids=[]))
    hold_row_budget(running, 9)  # 3 decoding requests: 6 drafts
    assert [len(r.spec_token_ids) for r in running] == [2, 2, 2, 0]
    assert shared == [-1, -1, -1, -1]  # trimmed by copy, the shared list untouched


def test_request_counts_over_the_budget_are_not_measured():
    table = measure(lambda r, w: 1.0 + r * (w + 1), [1, 2, 4, 8, 16], 4, row_budget=10,
                    max_rows=80)
    assert table.requests == (1, 2, 4, 8)  # 16 requests cannot fit 10 rows even undrafted
    assert table.step_ms(16, 16) == math.inf
