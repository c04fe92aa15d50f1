"""The self-test's draft-block graph check tells a faithful replay from a wrong one.

No GPU here: ``support.fake_cuda_graph`` stands in for vLLM's CUDAGraphWrapper with a
graph's replay semantics. A faithful stand-in must PASS; a replay whose outputs drift, or a
rank that captured nothing (the proposer's eager fallback), must FAIL with the rank named.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from scripts.selftest import cuda_checks
from tests.support.fake_cuda_graph import FakeCUDAGraph
from tests.support.tiny import build_draft, ensure_tiny_model, make_proposer


class DriftingGraph(FakeCUDAGraph):
    """Replays like a graph, then shifts the head hidden state: a replay gone wrong."""

    def __call__(self, *args):
        outputs = super().__call__(*args)
        if self.replays:
            outputs[1].add_(1.0)
        return outputs


@pytest.fixture(scope="module")
def env():
    return build_draft(ensure_tiny_model())


def worker(draft, vc, wrap, *, capture=True):
    p = make_proposer(draft, vc, probabilistic=True)
    p.kv_cache.normal_(generator=torch.Generator().manual_seed(1))
    p.kv_pos.copy_(torch.arange(p.window).expand_as(p.kv_pos))
    p.use_draft_graphs(wrap)
    if capture:
        p.dummy_run(1, is_graph_capturing=True)
    return SimpleNamespace(model_runner=SimpleNamespace(drafter=p))


def test_a_faithful_replay_passes(env):
    report = cuda_checks.graph_replay_on_worker(worker(*env, FakeCUDAGraph))
    assert report["captured"] == [1, 2, 4, 8]
    status, detail = cuda_checks.judge_graph_replay([report, report])
    assert status == "PASS", detail
    assert "[1, 2, 4, 8]" in detail and "2 rank(s)" in detail


def test_a_drifting_replay_fails(env):
    good = cuda_checks.graph_replay_on_worker(worker(*env, FakeCUDAGraph))
    bad = cuda_checks.graph_replay_on_worker(worker(*env, DriftingGraph))
    status, detail = cuda_checks.judge_graph_replay([good, bad])
    assert status == "FAIL"
    assert "rank 1 size 1" in detail and "rank 0" not in detail


def test_no_captured_graph_fails(env):
    report = cuda_checks.graph_replay_on_worker(worker(*env, FakeCUDAGraph, capture=False))
    status, detail = cuda_checks.judge_graph_replay([report])
    assert status == "FAIL" and "no draft-block graph captured" in detail
