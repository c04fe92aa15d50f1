"""Greedy requests beside sampled ones under speculation, in real vLLM on CPU (issue 19).

One subprocess runs every speculative method in turn, one engine at a time
(``tests/e2e/runners/mixed_sampling.py``): DSpark with greedy and with probabilistic drafting
(also under vLLM's async scheduler, as the Sparks run it), and vLLM's own ngram method; each
method's results are checked as its own case. Rounds mix greedy and
sampled requests in different proportions and prompt lengths under 64-token chunked prefill;
the plain target then scores every greedy output by teacher forcing (``support.greedy_oracle``:
each emitted token must be within epsilon of the target's argmax given its own prefix).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.runners import mixed_sampling as runner
from tests.support.paths import REPO
from tests.support.tiny import ensure_tiny_model

pytestmark = pytest.mark.e2e

ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every method's report, from one runner process (the plain target starts once)."""
    out = tmp_path_factory.mktemp("mixed") / "report.json"
    cmd = [
        sys.executable,
        "-m",
        runner.__name__,
        "--model",
        str(ensure_tiny_model()),
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=2400)
    if proc.returncode != 0:
        pytest.fail(f"mixed-sampling run failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.fixture(params=sorted(runner.SPECULATIVE))
def run(request, runs) -> dict:
    assert runs[request.param]["method"] == request.param
    return runs[request.param]


def test_greedy_requests_are_lossless_beside_sampled_ones(run):
    for name, verdict in run["oracle"].items():
        assert verdict["greedy_requests"] > 0, name
        assert verdict["violations"] == [], (
            f"{run['method']} {name}: greedy tokens off the target's argmax "
            f"(request, token, deficit in nats): {verdict['violations'][:5]}"
        )
        assert verdict["worst_deficit"] <= verdict["epsilon"], name


def test_rounds_mix_greedy_and_sampled_requests_and_finish(run):
    for name, rnd in run["rounds"].items():
        assert True in rnd["greedy"] and False in rnd["greedy"], name
        assert [len(o) for o in rnd["outputs"]] == [runner.OUTPUT_LEN] * len(rnd["prompts"])


def test_speculation_drafted_tokens(run):
    """Rows were verified: drafts reached the rejection sampler (acceptance is not the point)."""
    assert run["counters"]["drafted"] > 0


def test_seeded_sampled_requests_reproduce(run):
    """Also with probabilistic DSpark drafting: its draft noise is keyed by the request's seed
    and position (dspark_seeded_noise), so a rerun sees the same drafts."""
    seeded = run["rounds"]["seeded"]
    assert seeded["rerun"] == seeded["outputs"]


def test_async_scheduling_runs_where_asked(run):
    """The async variant ran vLLM's AsyncScheduler (the CPU platform no longer forces it off);
    the others kept the CPU default, the plain scheduler."""
    expected = "AsyncScheduler" if run["method"] in runner.ASYNC_SCHEDULING else "Scheduler"
    assert run["scheduler"] == expected
