"""The adaptive benchmark's statistics: best fixed width, paired ratios, intervals, summary line.

Oracles: ratios worked out by hand from the passes.
"""

from __future__ import annotations

import pytest

from scripts.bench import adaptive as bench

TABLE = {"requests": [1], "ms": [[10.0, 11.0, 12.0]], "row_budget": None, "measure_seconds": 1.0}


def child(rounds):
    return {"k": 2, "rule_on": True, "rule_on_at_end": True, "rule_rests": 0, "served_fit": None,
            "table": TABLE, "max_gain": 0.2,
            "first_step_seconds": 1.5, "rounds": rounds,
            "learning": {"passes": 3, "proposals": 48, "fitted": True}, "calibration": [1.1, 0.9]}


def run(tok_s):
    return {"tok_s": tok_s, "rows_per_token": 1.0, "acceptance_length": 2.0}


def test_best_fixed_width_and_ratios_are_medians_of_paired_rounds():
    rounds = [
        {"auto": run(100.0), "w1": run(90.0), "w2": run(80.0)},
        {"auto": run(60.0), "w1": run(60.0), "w2": run(50.0)},  # a slow round: ratios hold
        {"auto": run(110.0), "w1": run(100.0), "w2": run(100.0)},
    ]
    s = bench.summarize(child(rounds))
    assert bench.mode_names(2) == ["auto", "w1", "w2"]
    assert s["best_fixed"] == "w1"  # median 90 vs 80
    assert s["auto_over_best_fixed"] == pytest.approx(1.1)  # of 1.111, 1.0, 1.1
    assert s["auto_over_full_width"] == pytest.approx(1.2)  # of 1.25, 1.2, 1.1
    assert s["modes"]["auto"]["tok_s"] == 100.0 and s["rounds"] == 3


def test_the_best_fixed_width_is_the_same_rounds_best_which_errs_against_auto():
    # Two widths tied in truth, each 4% up in alternate rounds; auto equals the low one.
    rounds = [
        {"auto": run(100.0), "w1": run(100.0 if i % 2 == 0 else 104.0),
         "w2": run(104.0 if i % 2 == 0 else 100.0)}
        for i in range(5)
    ]
    s = bench.summarize(child(rounds))
    assert s["best_fixed"] == "w2"  # median 104 (3 rounds of 5) against w1's 100
    assert s["auto_over_best_fixed"] == pytest.approx(100 / 104)
    assert s["auto_over_full_width"] == pytest.approx(100 / 104)


def test_one_round_has_an_interval_of_its_own_ratio():
    s = bench.summarize(child([{"auto": run(90.0), "w1": run(100.0), "w2": run(80.0)}]))
    assert s["auto_over_best_fixed"] == pytest.approx(0.9)
    assert s["auto_over_best_fixed_interval"] == pytest.approx((0.9, 0.9))


def test_interval_brackets_the_median_and_widens_with_spread():
    steady = [1.0, 1.01, 0.99, 1.0, 1.0, 1.01, 0.99, 1.0]
    noisy = [1.0, 1.2, 0.8, 1.0, 1.0, 1.2, 0.8, 1.0]
    lo, hi = bench.interval(steady)
    assert 0.99 <= lo <= 1.0 <= hi <= 1.01
    nlo, nhi = bench.interval(noisy)
    assert nlo < lo and nhi > hi and 0.8 <= nlo and nhi <= 1.2
    assert bench.interval([1.05] * 6) == (1.05, 1.05)


def test_summary_line_has_the_documented_shape():
    results = {
        1: {"auto_over_best_fixed": 0.994, "auto_over_full_width": 1.0},
        4: {"auto_over_best_fixed": 1.016, "auto_over_full_width": 1.02},
        8: {"auto_over_best_fixed": 0.985, "auto_over_full_width": 1.064},
    }
    assert bench.summary_line(results) == (
        "adaptive: auto/best-fixed c=1 0.99x, c=4 1.02x, c=8 0.98x; auto/full-width c=8 1.06x"
    )


def test_prompts_are_fixed_and_sized_by_concurrency():
    assert bench.prompts(3) == bench.prompts(3)
    assert [len(p) for p in bench.prompts(3)] == bench.PROMPT_LENS[:3]
