"""`make selftest` on this CPU: the shape-true tiny (CPU sizes) in real vLLM, end to end.

Runs ``python -m scripts.selftest`` as `make selftest` does and reads its record: every
check that can run on a CPU passed (greedy output lossless by teacher forcing against the
plain target, drafts accepted, sampled and seeded requests), the CUDA-only checks are
SKIPPED and never PASS, and the last line is the documented summary.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from scripts.verify.plain_target import ENGINE_ENV_DEFAULTS
from tests.support.paths import REPO

pytestmark = pytest.mark.e2e

SUMMARY = re.compile(r"^selftest: PASS acceptance length (\d+\.\d\d), worst deficit "
                     r"(\d+\.\d\d\d) nats, (\d+) checks passed, (\d+) skipped \(record: (.+)\)$")
CUDA_ONLY = {"cuda_graph_replay", "no_host_read_sync_debug", "nccl_tp2"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    records = tmp_path_factory.mktemp("selftest")
    env = {**os.environ, **ENGINE_ENV_DEFAULTS}
    proc = subprocess.run([sys.executable, "-m", "scripts.selftest", "--record-dir", str(records)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    match = SUMMARY.match(last)
    assert match, last
    return match, json.loads(open(match.group(5)).read()), proc.stdout


def test_every_cpu_check_passed_and_the_cuda_ones_are_skipped(run):
    match, record, stdout = run
    status = {c["name"]: c["status"] for c in record["checks"]}
    assert record["result"] == "PASS" and record["device"]["kind"] == "cpu"
    assert record["image_id"] == "none"
    assert {n for n, s in status.items() if s == "SKIPPED"} == CUDA_ONLY
    assert {"load", "greedy_lossless", "acceptance", "sampled_seeded", "step_times"} <= {
        n for n, s in status.items() if s == "PASS"}
    assert int(match.group(3)) == sum(s == "PASS" for s in status.values())
    assert int(match.group(4)) == len(CUDA_ONLY)
    for step in range(1, 9):
        assert f"[{step}/8]" in stdout


def test_lossless_with_accepted_and_rejected_drafts(run):
    match, record, _ = run
    assert record["worst_deficit"] <= record["epsilon"]
    assert float(match.group(1)) > 1.5 and record["acceptance_length"] > 1.5
    counters = record["counters"]
    assert counters["accepted_tokens"] > 0 and counters["rejected_rows"] > 0
    assert counters["ragged_steps"] > 0
