"""The real thing over HTTP: `scripts/serve.py` (cpu-tiny profile, DSpark on) answers the
smoke check and a two-level serving sweep whose JSON validates."""

from __future__ import annotations

import subprocess
import sys

import bench_serving
import pytest
from conftest import REPO

pytestmark = pytest.mark.e2e


@pytest.fixture
def server(cpu_tiny_server):
    return cpu_tiny_server.base_url


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
    # serve.py exports the drafter's series; smoke reads them (steps moved, slots listed).
    assert "dspark: " in result.stdout and "ring slots" in result.stdout, result.stdout


def test_two_level_sweep_validates(server):
    result = bench_serving.run_sweep(
        server, concurrency=(1, 2), prompt_lens=(64,), output_len=8, rounds=1, warmup=1
    )
    bench_serving.validate_result(result)
    assert [run["concurrency"] for run in result["runs"]] == [1, 2]
    for run in result["runs"]:
        assert run["num_ok"] == run["num_requests"] > 0, run["errors"]
        assert run["spec_decode"]["num_drafts"] > 0  # DSpark drafted for these requests
