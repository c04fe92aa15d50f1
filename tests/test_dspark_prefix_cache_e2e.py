"""DSpark with prefix caching in real vLLM on CPU (V1 runner, overlay applied).

``spark-2x`` serves with prefix caching on. ``dspark_prefix_cache_runner.py`` runs waves of
greedy requests sharing long prefixes, a second wave hitting the cache mixed with fresh
prompts, and a window-sensitive oracle-draft wave measuring what the draft's masked window
holes cost after a hit. Losslessness is judged by teacher forcing with the plain target
(``tests/support/greedy_oracle.py``); cache hits are read from vLLM's per-request
``num_cached_tokens`` and checked against the first position the proposer saw.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import vllm.v1.spec_decode.dspark_proposer  # noqa: F401  (fails if the overlay is not applied)

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dspark_prefix_cache_runner as runner  # noqa: E402
from dspark_support import ensure_tiny_model  # noqa: E402
from support.greedy_oracle import EPSILON_NATS  # noqa: E402

pytestmark = pytest.mark.e2e

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("prefix-cache") / "report.json"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "PYTHONPATH": os.pathsep.join([str(TESTS.parent / "scripts"), str(TESTS)]),
    }
    # vLLM aligns prefix-cache hits to the largest KV group block span: 64 compressed
    # states x the compress ratio. The default tiny checkpoint's C128A layer spans 8192
    # tokens (past its 512-token context), so this test uses a variant with sliding-window
    # and C4A layers only (256-token alignment).
    model = ensure_tiny_model(TESTS.parent / "models" / "tiny-dsv4-dspark-c4", "0,4,0")
    cmd = [sys.executable, runner.__file__, "--model", str(model), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500)
    if proc.returncode != 0:
        pytest.fail(f"prefix-cache run failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
    result = json.loads(out.read_text())
    print(json.dumps({k: result[k] for k in ("hit_alignment", "window")}))
    return result


def _lossless(oracle: dict, what: str) -> None:
    assert oracle["epsilon"] == EPSILON_NATS
    assert oracle["violations"] == [] and oracle["ok"], (what, oracle)
    print(f"{what}: worst deficit {oracle['worst_deficit']:.4f}, "
          f"token-identical {oracle['token_identical']}/{len(oracle['ids'])}")


def _shared_prefix_blocks(rid: str, block: int) -> int:
    """Tokens of ``rid``'s shared prefix that whole cache blocks can hold (0 if fresh)."""
    prefix = {"A": runner.PREFIX_A, "B": runner.PREFIX_B}.get(rid.lstrip("H")[0], 0)
    return prefix // block * block


def test_prefix_caching_is_on_and_the_second_wave_hits(report):
    assert report["prefix_caching"]
    block = report["hit_alignment"]
    warm, hits = report["warm"], report["hits"]
    assert sorted(warm["outputs"]) == sorted(runner.WAVES["warm"])
    assert sorted(hits["outputs"]) == sorted(runner.WAVES["hits"])
    assert all(n == 0 for n in warm["num_cached_tokens"].values()), warm["num_cached_tokens"]
    for rid, cached in hits["num_cached_tokens"].items():
        if rid.startswith("F"):
            assert cached == 0, (rid, cached)
        else:  # at least the whole blocks of the shared prefix came from the cache
            assert cached >= _shared_prefix_blocks(rid, block) > 0, (rid, cached, block)
        # The proposer's first rows for the request start right after the cached tokens.
        assert hits["first_position"][rid] == cached, (rid, hits["first_position"], cached)


def test_dspark_with_prefix_cache_hits_is_lossless(report):
    for wave in ("warm", "hits", "holes"):
        outputs = report[wave]["outputs"]
        want = runner.HOLES_MAX_TOKENS if wave == "holes" else runner.MAX_TOKENS
        assert all(len(t) == want for t in outputs.values()), wave
        _lossless(report[wave]["oracle"], wave)
    c = report["hits"]["counters"]
    assert c["ragged_steps"] > 0 and c["drafted_tokens"] > 0 and c["verified_tokens"] > 0, c


def test_window_holes_follow_the_cache_hits(report):
    """Holes exist exactly for requests that hit the cache with a window not yet refilled."""
    hits = report["hits"]
    for rid, holey in hits["holey_steps"].items():
        assert hits["num_cached_tokens"][rid] > 0, (rid, holey)  # fresh requests: none
    assert any(hits["holey_steps"].get(r, 0) > 0 for r in ("A1", "A2", "B1"))


def test_hole_cost_with_window_sensitive_oracle_drafts(report):
    """The worst-case acceptance cost of the holes, measured and bounded by structure."""
    holes, w = report["holes"], report["window"]
    acc = holes["acceptance"]
    for n in runner.HOLE_SUFFIXES:
        hit, fresh = f"HA{n}", f"HF{n}"
        assert holes["num_cached_tokens"][hit] > 0 and holes["num_cached_tokens"][fresh] == 0
        # A fresh request never drafts with holes: oracle drafts all the way.
        assert holes["holey_steps"].get(fresh, 0) == 0
        assert acc[fresh]["accepted_tokens"] == acc[fresh]["verified_tokens"] > 0, (fresh, acc)
        # A hit whose uncached tail can never refill the window drafts with holes throughout.
        tail = len(runner.prompts()[hit]) - holes["num_cached_tokens"][hit]
        if tail + runner.HOLES_MAX_TOKENS < w:
            assert holes["holey_steps"].get(hit, 0) == holes["draft_steps"][hit], hit
        if tail >= w:  # a tail of W or more refills the window before decoding: no cost
            assert holes["holey_steps"].get(hit, 0) == 0, hit
            assert acc[hit]["accepted_tokens"] == acc[hit]["verified_tokens"] > 0, (hit, acc)
    print("hole cost (accepted/verified, holey/draft steps):", {
        r: (acc[r]["accepted_tokens"], acc[r]["verified_tokens"],
            holes["holey_steps"].get(r, 0), holes["draft_steps"][r]) for r in acc})
