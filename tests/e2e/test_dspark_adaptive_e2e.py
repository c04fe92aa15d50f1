"""Adaptive verification end to end in real vLLM on CPU (V1 runner, trained tiny draft).

The same 8 greedy prompts run with fixed k, with ``enable_adaptive_verification`` (a given
step-time table), with it under async scheduling, and as ``adaptive: auto`` deploys it (the
engine's own measured table) under a row budget smaller than full width, synchronous and
async (``tests/e2e/runners/adaptive.py``, one process, one engine at a time).
Adaptive must stay lossless by the greedy oracle (the plain target by teacher forcing),
really verify a different number of drafts per request within one step (the scheduler's
own draft counts, as the target verified them), verify fewer drafts than fixed k for the
same emitted tokens, and repeat seeded sampled requests token for token; under async
scheduling too, where the cut reaches the scheduler as draft budgets one step late.
Under the budget, no step verifies more rows than the budget, and greedy stays lossless.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import vllm.v1.spec_decode.dspark.adaptive  # noqa: F401  (fails if the overlay is not applied)

from tests.e2e.runners import adaptive as runner
from tests.support.greedy_oracle import EPSILON_NATS
from tests.support.paths import REPO
from tests.support.tiny import ensure_tiny_model

pytestmark = pytest.mark.e2e

ROW_BUDGET = 12  # 8 requests verify 40 rows at full width (k=4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every mode's report, from one runner process (the plain target starts once)."""
    tmp = tmp_path_factory.mktemp("adaptive")
    out = tmp / "report.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    cmd = [sys.executable, "-m", runner.__name__, "--model", str(ensure_tiny_model()),
           "--out", str(out), "--tables", str(tmp / "tables"), "--row-budget", str(ROW_BUDGET)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=2400)
    if proc.returncode != 0:
        pytest.fail(f"adaptive runs failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
    report = json.loads(out.read_text())
    assert sorted(report) == sorted(runner.MODES)
    return report


ADAPTIVE = ("adaptive", "adaptive-async")
BUDGET = ("budget", "budget-async")


def _verify_steps(run: dict, phase: str = "greedy") -> list[list[int]]:
    """Per step, the draft counts of the requests past their prefill."""
    steps = run["greedy"]["steps"] if phase == "greedy" else run["sampled_steps"]
    return [
        [d for d, pre in zip(s["drafts"], s["prefilling"], strict=True) if not pre]
        for s in steps
    ]


def test_both_runs_emit_every_token(runs):
    assert runs["fixed"]["adaptive"] is False
    assert all(runs[mode]["adaptive"] is True for mode in ADAPTIVE + BUDGET)
    assert runs["adaptive-async"]["scheduler"] == runs["budget-async"]["scheduler"]
    assert runs["budget-async"]["scheduler"] == "AsyncScheduler"
    assert runs["adaptive"]["scheduler"] == runs["fixed"]["scheduler"] == "Scheduler"
    for run in runs.values():
        outputs = run["greedy"]["outputs"]
        assert sorted(outputs) == sorted(runner.GREEDY)
        assert all(len(t) == runner.GREEDY_TOKENS for t in outputs.values())


@pytest.mark.parametrize("mode", ADAPTIVE + BUDGET)
def test_adaptive_greedy_is_lossless_by_teacher_forcing(runs, mode):
    oracle = runs[mode]["oracle"]
    assert oracle["epsilon"] == EPSILON_NATS
    assert oracle["violations"] == [] and oracle["ok"], oracle
    assert sorted(oracle["ids"]) == sorted(runner.GREEDY)


@pytest.mark.parametrize("mode", ADAPTIVE)
def test_adaptive_steps_are_ragged_and_fixed_steps_are_not(runs, mode):
    k = max(max(counts, default=0) for counts in _verify_steps(runs["fixed"]))
    assert k >= 2
    # Fixed k: every decoding request verifies k drafts, once its first drafts exist.
    fixed = [set(c) - {0} for c in _verify_steps(runs["fixed"])]
    assert all(s <= {k} for s in fixed)
    ragged = [c for c in _verify_steps(runs[mode]) if len(set(c)) > 1]
    assert len(ragged) >= 3, _verify_steps(runs[mode])
    assert any(0 < d < k for c in ragged for d in c)


@pytest.mark.parametrize("mode", ADAPTIVE)
def test_adaptive_verifies_fewer_drafts_for_the_same_tokens(runs, mode):
    fixed = runs["fixed"]["greedy"]["counters"]["verified_tokens"]
    adaptive = runs[mode]["greedy"]["counters"]["verified_tokens"]
    scheduled = sum(sum(c) for c in _verify_steps(runs[mode]))
    assert scheduled == adaptive  # the counters count what the scheduler verified
    assert 0 < adaptive < fixed, (adaptive, fixed)


@pytest.mark.parametrize("mode", ADAPTIVE)
def test_adaptive_seeded_sampling_repeats(runs, mode):
    """Seeded sampled requests are never cut (k drafts whenever they draft), so their output
    cannot depend on their neighbours in a step; here the same batch twice repeats."""
    k = max(max(counts, default=0) for counts in _verify_steps(runs["fixed"]))
    verified = [set(c) - {0} for c in _verify_steps(runs[mode], "sampled")]
    assert any(verified) and all(s <= {k} for s in verified), verified
    first, second = runs[mode]["sampled"]
    assert sorted(first) == sorted(runner.SAMPLED)
    assert all(len(t) == runner.SAMPLED_TOKENS for t in first.values())
    assert first == second


def _verify_rows(step: dict) -> int:
    """Rows of the requests verifying drafts or decoding (one row plus their drafts)."""
    return sum(n for n, d, pre in zip(step["rows"], step["drafts"], step["prefilling"],
                                      strict=True) if not pre and n == d + 1)


@pytest.mark.parametrize("mode", BUDGET)
def test_no_step_verifies_more_rows_than_the_budget(runs, mode):
    """8 requests at k=4 would verify 40 rows a step; the budget is 12, in every step."""
    run = runs[mode]
    assert run["row_budget"] == ROW_BUDGET and run["rule_on"]  # a budget that binds: on
    k = max(max(counts, default=0) for counts in _verify_steps(runs["fixed"]))
    steps = run["greedy"]["steps"] + run["sampled_steps"]
    decoding = [sum(1 for n, d, pre in zip(s["rows"], s["drafts"], s["prefilling"],
                                            strict=True) if not pre and n == d + 1)
                for s in steps]
    assert max(decoding) * (k + 1) > ROW_BUDGET  # full width would not fit
    rows = [_verify_rows(s) for s in steps]
    assert max(rows) <= ROW_BUDGET, rows
    assert run["table_ms"] is not None  # the engine measured its own table


def test_tp2_auto_under_a_row_budget_is_lossless(tmp_path):
    """TP=2 (the cpu-4x profile's engine at two ranks: async scheduling, prefix caching):
    ``adaptive: auto`` measures its table on both ranks, rank 0's is broadcast, and a row
    budget of 18 (six requests verify 30 rows at full width) makes it cut. Greedy output
    matches the TP=2 plain target by teacher forcing; both ranks count the same drafts."""
    from tests.e2e.runners import dspark_tp

    out = tmp_path / "tp2.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "0|1",
           "DSPARK_ADAPTIVE": "auto", "DSPARK_VERIFY_ROW_BUDGET": "18",
           "DSPARK_COST_TABLE_DIR": str(tmp_path / "tables")}
    proc = subprocess.run([sys.executable, "-m", dspark_tp.__name__, "--model",
                           str(ensure_tiny_model()), "--out", str(out), "--tp", "2"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        pytest.fail(f"TP=2 run failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
    report = json.loads(out.read_text())
    assert report["tp"] == 2 and all(len(t) == dspark_tp.MAX_TOKENS
                                     for t in report["outputs"].values())
    oracle = report["oracle"]
    assert oracle["violations"] == [] and oracle["ok"], oracle
    first = report["per_rank"][0]["counters"]
    assert all(r["counters"] == first for r in report["per_rank"])
    assert 0 < first["verified_tokens"] < first["drafted_tokens"]  # the budget cut drafts
    # Rank 0 alone writes the table, and only a steady one (its median timing pass within
    # 20% of the fastest); on a busy machine the table is used but not cached, and the log
    # says so. Rank 0 also decides when the passes stop (they are collective).
    # The served-step correction is fitted on rank 0 and broadcast: every rank cuts alike.
    from tests.support.tp_workers import REFIT_A, REFIT_B

    refit = report["refit"]
    assert refit[0]["fitted"] == pytest.approx([REFIT_A, REFIT_B], rel=1e-3)
    assert all(r == refit[0] for r in refit), "the ranks' tables differ after a refit"
    tables = list((tmp_path / "tables").glob("*.json"))
    log = proc.stdout + proc.stderr  # vLLM's logger writes to stdout
    assert len(tables) == 1 or (not tables and "not cached" in log), tables
