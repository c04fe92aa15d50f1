"""The real thing over HTTP: `scripts/serve.py` (`vllm serve`, cpu-tiny profile, DSpark on,
started with an API key as the Spark head is) refuses requests without the key but answers
/health, and with the key answers the smoke check and the serving sweep (on vLLM's own
`vllm bench serve`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from tests.support.cpu_server import CPU_TINY_API_KEY
from tests.support.paths import REPO

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
        [sys.executable, "-m", "scripts.smoke", "--profile", "cpu-tiny",
         "--base-url", server, "--max-tokens", "16"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=WITH_KEY,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "spec decode:" in result.stdout and "smoke: OK" in result.stdout
    # serve.py exports the drafter's series; smoke reads them (steps moved, slots listed).
    assert "dspark: " in result.stdout and "ring slots" in result.stdout, result.stdout


def test_sweep_on_vllm_bench_serve_counts_what_the_server_counted(server, tmp_path):
    """`python -m scripts.bench` (vLLM's `vllm bench serve` as the load engine) against the
    key-guarded server, two content types. Oracles: the load it was given (requests, exact
    prompt and output lengths with EOS ignored) and the server's own token counters, which
    must have moved by exactly what vLLM's client received."""
    argv = [sys.executable, "-m", "scripts.bench", "--base-url", server, "--profile",
            "cpu-tiny", "--content", "code", "prose", "--concurrency", "2", "--prompt-lens", "64",
            "--output-len", "8", "--rounds", "1", "--warmup", "1", "--out-dir", str(tmp_path),
            "--name", "sweep"]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=WITH_KEY)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "sweep.json").read_text())
    assert [(lv["content"], lv["concurrency"]) for lv in result["levels"]] == [
        ("code", 2), ("prose", 2)]
    for lv in result["levels"]:
        theirs = lv["vllm_bench"]
        assert (theirs["completed"], theirs["failed"]) == (2, 0)
        assert theirs["total_input_tokens"] == 2 * 64
        assert theirs["total_output_tokens"] == 2 * 8
        assert lv["tokens"] == {"generation": 2 * 8, "prompt": 2 * 64}
        spec = lv["spec_decode"]
        assert spec["num_drafts"] > 0 and len(spec["accepted_per_position"]) == 4  # k = 4
        assert sum(lv["dspark"]["steps"].values()) > 0
        assert lv["roofline"]["decode_tok_s"] > 0
    assert result["provenance"]["vllm_server"] == "0.32.0"
    for suffix in (".md", "-acceptance.png", "-decode.png"):
        assert (tmp_path / f"sweep{suffix}").stat().st_size > 0
