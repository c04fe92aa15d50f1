"""Packed prefill split over four TP ranks (the spark-4x row split), against TP=1.

Four real torch.distributed ranks (gloo on 127.0.0.1, spawned once for the module) ingest
chunks of every size class modulo 4: no pad row (N = 4k), three, two and one pad rows, and
a chunk smaller than the ranks (N = 1: ranks 1..3 hold pads only), with requests straddling
rank boundaries and rejected verify tails. Every rank's rings must equal the per-request
reference store bit for bit, the gathered rows must equal TP=1's, pad rows must be exactly
zero, and each rank must have projected only its own L = ceil(N / 4) rows. Scenarios, the
projection and the reference come from the TP=2 tests' module (``test_packed_prefill.py``).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.support.gloo_ranks import run_rank, spawn_ranks
from tests.unit.test_packed_prefill import (
    assert_ranks_match_tp1,
    build_scenario,
    random_qsl,
    run_ingest,
)

pytestmark = pytest.mark.timeout(300)

TP = 4
SHARED = ["straddle", "random_bf16", "single_token", "rejected", "full_chunk"]  # N % 4: 3 1 1 1 3
OWN = ["aligned", "two_pads"]  # N % 4: 0 and 2
SCENARIOS = SHARED + OWN


def scenario(name: str) -> dict:
    """The TP=2 module's scenarios, and two sizes it lacks (0 and 2 modulo 4)."""
    if name in SHARED:
        return build_scenario(name)
    sc = build_scenario("rejected")  # the shape of a scenario, refilled below
    rng = random.Random(len(name))
    gen = torch.Generator().manual_seed(len(name))
    num = 64 if name == "aligned" else 4 * 37 + 2
    qsl = random_qsl(rng, 6, num)
    starts = [rng.randrange(0, 300) for _ in range(6)]
    positions = torch.cat([torch.arange(s, s + qsl[r + 1] - qsl[r]) for r, s in enumerate(starts)])
    dim, layers = sc["dim"], sc["layers"]
    sc.update(
        qsl=qsl,
        positions=positions,
        features=torch.randn(num, 2 * dim, generator=gen),
        slots=rng.sample(range(8), 6),
        num_slots=8,
        rejected=[0, 1, 0, 2, 1, 0] if name == "two_pads" else None,
        ring=(torch.randn(9, sc["window"], layers * dim, generator=gen),
              torch.randint(0, 50, (9, sc["window"]), generator=gen)),
    )
    return sc


def _ingest_every_scenario(rank: int, group) -> dict:
    """What one of the four ranks stores for every scenario."""
    results = {}
    for name in SCENARIOS:
        full, ring, calls = run_ingest(scenario(name), TP, rank, group)
        results[name] = {"full": full, "ring": ring, "calls": calls}
    return results


def _rank(rank: int, port: int, out_dir: str) -> None:
    """One of the four ranks: ingest every scenario at TP=4, save what it stored."""
    run_rank(rank, TP, port, out_dir, lambda group: _ingest_every_scenario(rank, group))


@pytest.fixture(scope="module")
def tp4(tmp_path_factory):
    return spawn_ranks(_rank, TP, tmp_path_factory, join_s=200)


def test_own_scenarios_cover_the_missing_residues():
    sizes = {name: scenario(name)["qsl"][-1] for name in SCENARIOS}
    assert {n % TP for n in sizes.values()} == {0, 1, 2, 3}
    assert min(sizes.values()) < TP  # some ranks hold pads only


@pytest.mark.dist
@pytest.mark.parametrize("name", SCENARIOS)
def test_tp4_matches_tp1_and_the_reference_with_zero_pads(tp4, name):
    assert_ranks_match_tp1(scenario(name), tp4, name)
