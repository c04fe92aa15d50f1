"""The real thing over HTTP: `scripts/serve.py` (cpu-tiny profile, DSpark on) answers the
smoke check and a two-level serving sweep whose JSON validates."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import REPO
from support.net import free_port

from scripts.bench import schema, sweep

pytestmark = pytest.mark.e2e
STARTUP_S = 600


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                str(REPO / "scripts" / "serve.py"),
                "--profile",
                "cpu-tiny",
                "--",
                "--port",
                str(port),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after {STARTUP_S}s:\n{log.read_text()[-4000:]}")
            time.sleep(2)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def test_smoke_sees_speculative_decoding(server):
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "smoke.py"),
            "--profile",
            "cpu-tiny",
            "--base-url",
            server,
            "--max-tokens",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "spec decode:" in result.stdout and "smoke: OK" in result.stdout


def test_two_level_sweep_validates(server):
    result = sweep.run_sweep(
        server, concurrency=(1, 2), prompt_lens=(64,), output_len=8, rounds=1, warmup=1
    )
    schema.validate_result(result)
    assert [run["concurrency"] for run in result["runs"]] == [1, 2]
    for run in result["runs"]:
        assert run["num_ok"] == run["num_requests"] > 0, run["errors"]
        assert run["spec_decode"]["num_drafts"] > 0  # DSpark drafted for these requests
