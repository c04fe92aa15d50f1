"""The adaptive benchmark's statistics: the row-cost fit and the paired ratios.

Oracles: step times generated from known coefficients (the fit must recover them), and
ratios worked out by hand from the passes.
"""

from __future__ import annotations

import random

import pytest

from scripts.bench import adaptive as bench


def synthetic_steps(a, c, b, p, noise_ms, seed=0):
    """Steps of fixed-k (rows = 5 x requests) and ragged adaptive passes, ms from a model."""
    rng = random.Random(seed)
    steps = []
    for i in range(400):
        requests = rng.randint(1, 16)
        verify = requests * 5 if i % 2 == 0 else rng.randint(requests, requests * 5)
        prefill = rng.choice([0, 0, 0, rng.randint(1, 64)])
        ms = a + c * requests + b * verify + p * prefill + rng.gauss(0.0, noise_ms)
        steps.append((requests, verify, prefill, ms, i % 2))
    return steps


def test_fit_recovers_the_step_model():
    fit = bench.fit_row_cost(synthetic_steps(13.0, 0.6, 0.25, 0.2, noise_ms=0.05))
    assert fit["fixed_ms"] == pytest.approx(13.0, abs=0.1)
    assert fit["ms_per_request"] == pytest.approx(0.6, abs=0.03)
    assert fit["ms_per_verify_row"] == pytest.approx(0.25, abs=0.01)
    assert fit["ms_per_prefill_row"] == pytest.approx(0.2, abs=0.01)
    mean_requests = fit["mean_requests"]
    assert fit["row_cost"] == pytest.approx(0.25 / (13.0 + 0.6 * mean_requests), rel=0.05)


def test_fit_leaves_out_stalls():
    steps = synthetic_steps(13.0, 0.6, 0.25, 0.2, noise_ms=0.05)
    stalled = steps + [(16, 16, 0, 900.0, 1)] * 10  # a shared machine's stalls
    assert bench.fit_row_cost(stalled)["ms_per_verify_row"] == pytest.approx(0.25, abs=0.01)
    assert bench.fit_row_cost(stalled)["steps"] == len(steps)


def test_fit_row_cost_is_clipped_at_zero():
    # Rows that seem to make a step faster (noise) must not give a negative cost.
    steps = [(r, v, 0, 20.0 - 0.5 * v, 0) for r in range(1, 9) for v in range(r, 5 * r + 1)]
    assert bench.fit_row_cost(steps)["row_cost"] == 0.0


def test_median_interval_brackets_the_median_and_repeats():
    values = [0.95, 0.99, 1.0, 1.01, 1.02, 1.04, 0.97, 1.03, 1.0, 0.98]
    median, low, high = bench.median_interval(values)
    assert median == pytest.approx(1.0)
    assert min(values) <= low <= median <= high <= max(values)
    assert bench.median_interval(values) == (median, low, high)
    assert bench.median_interval([1.2] * 5) == (1.2, 1.2, 1.2)


def run(mode, tok_s, rows):
    return {"mode": mode, "tok_s": tok_s, "rows_per_token": rows, "acceptance_length": 2.0,
            "verified_drafts": 100}


def test_summary_ratios_are_per_pair():
    pairs = [
        {"fixed": run("fixed", 100.0, 2.0), "adaptive": run("adaptive", 110.0, 1.5)},
        {"fixed": run("fixed", 200.0, 2.0), "adaptive": run("adaptive", 180.0, 1.8)},
        {"fixed": run("fixed", 150.0, 2.0), "adaptive": run("adaptive", 150.0, 1.6)},
    ]
    s = bench.summarize(pairs)
    assert s["ratio_tok_s"]["per_pair"] == pytest.approx([1.1, 0.9, 1.0])
    assert s["ratio_tok_s"]["median"] == pytest.approx(1.0)
    assert s["ratio_tok_s"]["adaptive_not_worse"] == 2
    assert s["ratio_rows_per_token"]["per_pair"] == pytest.approx([0.75, 0.9, 0.8])
    assert s["ratio_rows_per_token"]["adaptive_not_worse"] == 3
    assert s["fixed"]["tok_s"] == 150.0 and s["adaptive"]["tok_s"] == 150.0
    assert s["pairs"] == 3
