"""DSpark at TP=4 inside real vLLM on CPU: four ranks over gloo, the cpu-4x profile's engine.

``tests/e2e/runners/dspark_tp.py`` runs six concurrent greedy requests (3..266 prompt tokens,
16 new tokens) with a 75-row prefill chunk, so chunks of N rows, mostly not a multiple of 4,
are packed and split over the four ranks while other requests verify drafts. Half the requests
draft the TP=4 plain target's own continuation, corrupted at an index cycling through 0..k (so
drafts are accepted and rejected at every position); the others draft with the checkpoint's
draft. The oracle is the plain target at TP=4 (teacher forcing). The checkpoint is the tiny one
with 4 output groups (vLLM splits o_groups over the ranks; the default tiny checkpoint has 2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.runners import dspark_tp as runner
from tests.support.greedy_oracle import EPSILON_NATS
from tests.support.paths import REPO
from tests.support.tiny import generate_tiny_model

pytestmark = pytest.mark.e2e

TP4_MODEL = REPO / "models" / "tiny-dsv4-dspark-tp4"
BUDGET = 75


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    if not (TP4_MODEL / "config.json").exists():
        generate_tiny_model(TP4_MODEL, "--dspark", "--o-groups", "4", "--force")
    out = tmp_path_factory.mktemp("tp4") / "tp4.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           # four ranks on this machine's cores, one OpenMP thread each
           "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(r % (os.cpu_count() or 1)) for r in range(4))}
    proc = subprocess.run([sys.executable, "-m", runner.__name__, "--model", str(TP4_MODEL),
                           "--out", str(out), "--tp", "4", "--batched-tokens", str(BUDGET)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        pytest.fail(f"TP=4 run failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def test_tp4_dspark_is_lossless_against_the_tp4_plain_target(report):
    assert report["tp"] == 4 and sorted(report["ranks"]) == [0, 1, 2, 3]
    assert sorted(report["outputs"]) == [f"P{i}" for i in range(len(runner.PROMPTS))]
    assert all(len(t) == runner.MAX_TOKENS for t in report["outputs"].values())
    oracle = report["oracle"]
    assert oracle["epsilon"] == EPSILON_NATS
    assert oracle["violations"] == [] and oracle["ok"], oracle


def test_every_rank_verified_accepted_and_rejected_drafts(report):
    for rank in report["per_rank"]:
        c = rank["counters"]
        assert c["drafted_tokens"] > 0 and c["verified_tokens"] > 0, c
        assert 0 < c["accepted_tokens"] < c["verified_tokens"], c  # scripted drafts accepted
        assert c["rejected_rows"] > 0 and c["ragged_steps"] > 0, c
    # The ranks run the same proposer over the same batch: identical counters.
    first = report["per_rank"][0]["counters"]
    assert all(r["counters"] == first for r in report["per_rank"])


def test_packed_prefill_split_every_chunk_over_the_four_ranks(report):
    logs = {r["rank"]: r["packed"] for r in report["per_rank"]}
    assert sorted(logs) == [0, 1, 2, 3]
    geometry = [entry[:4] for entry in logs[0]]
    assert geometry, "no step went through packed prefill"
    for rank, log in logs.items():
        assert [e[:4] for e in log] == geometry, f"rank {rank} split other chunks"
        for n, padded, rows, tp, own_rank, real in log:
            # by hand: L = ceil(N / 4), P = 4 L, this rank's real rows
            assert (tp, own_rank) == (4, rank)
            assert rows == -(-n // 4) and padded == 4 * rows
            assert real == max(0, min(n - rank * rows, rows))
    assert any(n % 4 for n, *_ in geometry), "no chunk needed pad rows"
    assert max(n for n, *_ in geometry) > 4 * 8, "no chunk large enough to split"


def test_draft_rings_are_identical_on_every_rank(report):
    """Each rank projects its quarter of a packed chunk and all-gathers the rest: the rings
    must come out bit-identical everywhere (a rank storing only its own rows would differ)."""
    rings = {r["rings"] for r in report["per_rank"]}
    assert len(rings) == 1, rings
