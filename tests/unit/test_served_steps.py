"""The served-step correction of the cost table: a least-squares fit checked against the
line that generated the observations, and the rules for what counts as an observation."""

from __future__ import annotations

import random

import pytest

from tests.support.overlay import load_overlay_module

ServedStepFit = load_overlay_module("vllm/v1/spec_decode/dspark/served_steps.py").ServedStepFit


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _serve(fit, clock, shapes, served_ms, ids=("a", "b")):
    """One proposal per (table_ms) in ``shapes``; the step before it took ``served_ms(x)``."""
    for x in shapes:
        clock.now += served_ms(x) / 1e3
        fit.step(list(ids), True, x)


@pytest.mark.parametrize("a,b", [(30.0, 0.5), (0.0, 1.0), (5.0, 0.8)])
def test_fit_recovers_the_line_the_steps_follow(a, b):
    rng = random.Random(0)
    clock = Clock()
    fit = ServedStepFit(clock=clock)
    xs = [rng.uniform(10.0, 40.0) for _ in range(200)]
    _serve(fit, clock, xs, lambda x: a + b * x * rng.uniform(0.99, 1.01))
    got_a, got_b = fit.fit()
    assert got_b == pytest.approx(b, rel=0.05)
    assert got_a == pytest.approx(a, abs=0.05 * (a + b * 25.0))
    assert fit.predict(20.0) == pytest.approx(a + b * 20.0, rel=0.03)


def test_no_fit_without_enough_steps_and_only_the_offset_without_spread():
    clock = Clock()
    fit = ServedStepFit(clock=clock, min_steps=32)
    _serve(fit, clock, [10.0, 30.0] * 10, lambda x: 2 * x)  # 19 observations
    assert fit.steps == 19 and fit.fit() is None and fit.fitted is None
    fit = ServedStepFit(clock=clock, min_steps=32)
    _serve(fit, clock, [20.0] * 100, lambda x: 35.0)  # one width only: a and b inseparable
    # The slope unknown: a served row costs the table's (the most it may), plus the 15 ms
    # every served step paid over the table.
    assert not fit.slope_known() and fit.fit() == pytest.approx((15.0, 1.0))


def test_only_consecutive_decode_steps_of_the_same_requests_are_observed():
    clock = Clock()
    fit = ServedStepFit(clock=clock)
    fit.step(["a", "b"], True, 10.0)
    clock.now += 0.05
    fit.step(["a", "b", "c"], True, 12.0)  # a request joined: not a step of one shape
    clock.now += 0.05
    fit.step(["a", "b", "c"], False, 0.0)  # someone in prefill
    clock.now += 0.05
    fit.step(["a", "b", "c"], True, 12.0)  # after a prefill step
    assert fit.steps == 0
    clock.now += 0.02
    fit.step(["a", "b", "c"], True, 12.0)
    assert fit.steps == 1
    assert fit.sums[1] == pytest.approx(12.0) and fit.sums[2] == pytest.approx(20.0)


def test_a_stall_is_not_a_step_once_fitted():
    clock = Clock()
    fit = ServedStepFit(clock=clock)
    _serve(fit, clock, [10.0, 30.0] * 20, lambda x: 100.0 + x)  # the table misses 100 ms
    assert fit.steps == 39 and fit.fit() == pytest.approx((100.0, 1.0))
    clock.now += 5.0  # 5000 ms where the fit says 110
    fit.step(["a", "b"], True, 10.0)
    assert fit.steps == 39


def test_rows_never_get_cheaper_and_times_stay_positive():
    clock = Clock()
    fit = ServedStepFit(clock=clock)
    # Served time falls as the table's rises (noise around a flat cost).
    _serve(fit, clock, [10.0, 20.0, 30.0] * 20, lambda x: 60.0 - 0.1 * x)
    a, b = fit.fit()
    assert b == ServedStepFit.MIN_SCALE and a > 0


def test_rows_never_cost_more_than_the_table_says():
    # Served rows 1.5x the table's: the scale stops at 1 and the intercept is the least
    # squares one for that scale (the mean served time minus the mean table time).
    rng = random.Random(2)
    clock = Clock()
    fit = ServedStepFit(clock=clock)
    xs = [rng.uniform(10.0, 40.0) for _ in range(200)]
    _serve(fit, clock, xs, lambda x: 5.0 + 1.5 * x)
    a, b = fit.fit()
    observed = xs[1:]  # the first proposal has no step before it
    mean_x = sum(observed) / len(observed)
    assert b == ServedStepFit.MAX_SCALE == 1.0
    assert a == pytest.approx(5.0 + 0.5 * mean_x, rel=0.05)


def test_old_steps_fade():
    """After a change (a heavier load) the fit follows the new steps."""
    rng = random.Random(1)
    clock = Clock()
    fit = ServedStepFit(clock=clock, half_life=64)
    _serve(fit, clock, [rng.uniform(10, 40) for _ in range(300)], lambda x: x)
    _serve(fit, clock, [rng.uniform(10, 40) for _ in range(600)], lambda x: 50.0 + x)
    a, b = fit.fit()
    assert a == pytest.approx(50.0, abs=3.0) and b == pytest.approx(1.0, abs=0.1)


def test_exploration_is_dense_until_the_times_spread_then_sparse_wide_and_narrow_in_turn():
    clock = Clock()
    fit = ServedStepFit(clock=clock)
    _serve(fit, clock, [20.0] * 10, lambda x: 30.0)  # one width: no spread
    early = [fit.explore() for _ in range(64)]
    explored = [e for e in early if e is not None]
    assert len(explored) == 64 // ServedStepFit.EXPLORE_DENSE and early[0] is None
    # Wide and narrow in turn: the rule's own width alone may never spread the times.
    assert explored == [ServedStepFit.WIDE, ServedStepFit.NARROW] * (len(explored) // 2)
    _serve(fit, clock, [10.0, 30.0] * 5, lambda x: 30.0)
    assert fit.slope_known() and not fit.pinned  # exploration reads the last fit's
    fit.fit()
    assert fit.pinned
    late = [fit.explore() for _ in range(256)]
    assert sum(e is not None for e in late) == 256 // ServedStepFit.EXPLORE_SPARSE


def _one_width_and_rare_narrow_steps(n, noise_ms, seed=0):
    """The twin at c=1: the rule keeps full width (table 50.9 ms), one step in 16 explores
    narrow (42.2 ms); served = 10 + 1.2 x table, plus uniform noise."""
    rng = random.Random(seed)
    clock = Clock()
    fit = ServedStepFit(clock=clock)
    xs = [42.2 if i % 16 == 15 else 50.9 for i in range(n)]
    _serve(fit, clock, xs, lambda x: 10.0 + 1.2 * x + rng.uniform(-noise_ms, noise_ms))
    return fit


def test_narrowly_spread_times_fit_once_enough_steps_pin_the_slope():
    # Table times spread by about 4% of their mean; 200 steps at +-2 ms settle b anyway.
    fit = _one_width_and_rare_narrow_steps(200, noise_ms=2.0)
    assert fit.slope_known()
    a, b = fit.fit()
    assert b == pytest.approx(1.2, abs=0.3)
    assert fit.predict(50.9) == pytest.approx(10.0 + 1.2 * 50.9, rel=0.02)
    assert fit.predict(42.2) == pytest.approx(10.0 + 1.2 * 42.2, rel=0.03)


def test_noisy_steps_with_little_spread_fit_only_the_offset():
    # 40 steps, two of them narrow, +-20 ms of noise: the slope could be anything, so it is
    # the table's (1) and the offset the mean excess (10 + 0.2 x table, about 20 ms).
    fit = _one_width_and_rare_narrow_steps(40, noise_ms=20.0)
    assert fit.steps >= fit.min_steps and not fit.slope_known()
    a, b = fit.fit()
    assert b == ServedStepFit.MAX_SCALE and a == pytest.approx(10.0 + 0.2 * 50.4, abs=6.0)


def test_dense_exploration_ends_even_when_the_slope_stays_unknown():
    # One table time only: the slope is never known. Dense for the first DENSE_PROPOSALS
    # proposals, sparse after, so an unattainable fit stops costing tokens.
    clock = Clock()
    fit = ServedStepFit(clock=clock)
    _serve(fit, clock, [20.0] * 10, lambda x: 30.0)
    limit, dense, sparse = (ServedStepFit.DENSE_PROPOSALS, ServedStepFit.EXPLORE_DENSE,
                            ServedStepFit.EXPLORE_SPARSE)
    calls = [fit.explore() is not None for _ in range(limit + 4 * sparse)]
    assert not fit.slope_known()
    assert sum(calls[:limit]) == limit // dense
    assert sum(calls[limit:]) == 4
