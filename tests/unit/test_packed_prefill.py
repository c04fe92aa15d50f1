"""Packed multi-request DSpark prefill: the TP row split, padding, TP ingestion.

Every result is checked against a reference written here, independently of the module:
row arithmetic for the split and padding, and a per-request Python loop for the ring
store (the store plan comes from the product's ``plan_step``). The TP=2 tests run real torch.distributed (gloo) in two spawned processes on
127.0.0.1, once for the whole module.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from scripts.dev.gpu_check import reference_store
from tests.support.gloo_ranks import run_rank, spawn_ranks
from tests.support.overlay import load_overlay_module
from tests.support.step_plans import plan_for_store

pp = load_overlay_module("vllm/v1/spec_decode/dspark/packed_prefill.py")
dr = load_overlay_module("vllm/v1/spec_decode/dspark/context_store.py")

# The TP=2 fixture joins its processes with a timeout too; this is the outer guard.
pytestmark = pytest.mark.timeout(300)


# ---------------------------------------------------------------------------
# Independent references
# ---------------------------------------------------------------------------


def random_qsl(rng: random.Random, num_requests: int, num_tokens: int) -> list[int]:
    cuts = sorted(rng.sample(range(1, num_tokens), num_requests - 1))
    return [0, *cuts, num_tokens]


# ---------------------------------------------------------------------------
# Test projection and scenarios (shared by the parent and the spawned ranks)
# ---------------------------------------------------------------------------


def make_project(num_layers: int, dim: int, dtype: torch.dtype, seed: int = 7):
    """Row-local projection made of IEEE + and * only, so any batching is bitwise equal.

    Returns ``[L, num_layers * dim]``: the draft layers stacked in one ring row, as the
    proposer stores them. The bias term makes a zero pad row project to a nonzero value:
    pad rows are zero only because ingestion forces them to zero.
    """
    gen = torch.Generator().manual_seed(seed)
    a, b, freq, bias = (torch.randn(num_layers, dim, generator=gen) for _ in range(4))

    def project(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = x.float()
        p = pos.float()[:, None, None]
        out = x[:, None, :dim] * a + x[:, None, dim:] * b + p * freq + bias
        return out.to(dtype).reshape(x.shape[0], -1)

    return project


def build_scenario(name: str) -> dict:
    """Deterministic inputs of one ingestion case (features, positions, caches, slots)."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    rejected = None
    if name == "straddle":
        # Request 1 straddles the rank boundary (rows 3..6 of P=8, L=4), row 7 is the pad.
        # Ring rows interleave: request 0 -> row 3, request 1 -> row 1, rows 0 and 2 hold
        # other requests' live context. Both requests hit the same ring columns.
        qsl, starts, slots, num_slots, window, layers, dim = (
            [0, 3, 7],
            [126, 30],
            [3, 1],
            4,
            4,
            2,
            4,
        )
        dtype = torch.float32
    elif name == "random_bf16":
        rng = random.Random(11)
        qsl = random_qsl(rng, 9, 1201)
        starts = [rng.randrange(0, 500) for _ in range(9)]
        slots = rng.sample(range(16), 9)
        num_slots, window, layers, dim, dtype = 16, 16, 3, 8, torch.bfloat16
    elif name == "single_token":
        # N=1 < tp_size: rank 1 holds only a pad row.
        qsl, starts, slots, num_slots, window, layers, dim = [0, 1], [5], [0], 2, 4, 1, 4
        dtype = torch.float32
    elif name == "rejected":
        # Prefill chunks mixed with verify rows whose tails were rejected.
        qsl, starts, slots = [0, 40, 44, 47, 48, 53], [0, 90, 17, 3, 200], [4, 0, 2, 1, 3]
        rejected = [0, 2, 2, 0, 1]  # request 2 keeps only its anchor row
        num_slots, window, layers, dim, dtype = 5, 8, 2, 4, torch.float32
    elif name == "full_chunk":
        rng = random.Random(5)
        qsl = random_qsl(rng, 64, 8191)
        starts = [rng.randrange(0, 4000) for _ in range(64)]
        slots = rng.sample(range(64), 64)
        num_slots, window, layers, dim, dtype = 64, 128, 1, 4, torch.float32
    else:
        raise KeyError(name)
    num = qsl[-1]
    positions = torch.empty(num, dtype=torch.int64)
    for r, start in enumerate(starts):
        positions[qsl[r] : qsl[r + 1]] = torch.arange(start, start + qsl[r + 1] - qsl[r])
    # num_slots live ring rows plus the scratch row the store drops rejected rows into.
    cache = torch.randn(num_slots + 1, window, layers * dim, generator=gen).to(dtype)
    # Older context in every ring row, some cells empty: must survive where not written.
    cache_pos = torch.randint(0, 50, (num_slots + 1, window), generator=gen)
    cache_pos[torch.rand(num_slots + 1, window, generator=gen) < 0.3] = -1
    return {
        "qsl": qsl,
        "positions": positions,
        "features": torch.randn(num, 2 * dim, generator=gen).to(dtype),
        "slots": slots,
        "num_slots": num_slots,
        "rejected": rejected,
        "ring": (cache, cache_pos),
        "window": window,
        "layers": layers,
        "dim": dim,
        "dtype": dtype,
        "max_model_len": 1 << 16,
    }


SCENARIOS = ["straddle", "random_bf16", "single_token", "rejected", "full_chunk"]


def run_ingest(sc: dict, tp: int, rank: int, group, request: int | None = None) -> tuple:
    """Ingest a scenario, or only one of its requests, into a fresh copy of its ring."""
    qsl, rows = sc["qsl"], slice(None)
    slots, rejected = sc["slots"], sc["rejected"] or [0] * (len(qsl) - 1)
    if request is not None:
        rows = slice(qsl[request], qsl[request + 1])
        qsl = [0, rows.stop - rows.start]
        slots, rejected = slots[request : request + 1], rejected[request : request + 1]
    ring = tuple(t.clone() for t in sc["ring"])
    store = plan_for_store(qsl, slots, rejected, window=sc["window"], num_slots=sc["num_slots"]).store
    positions = sc["positions"][rows]
    accepted = dr.last_accepted(store, positions, torch.tensor(rejected))
    project = make_project(sc["layers"], sc["dim"], sc["dtype"])
    calls = []

    def spy(x, pos):
        calls.append((x.clone(), pos.clone()))
        return project(x, pos)

    full = pp.ingest_packed_prefill(
        pp.plan_packed_prefill(qsl[-1], tp, rank, group),
        store,
        sc["features"][rows],
        positions,
        spy,
        ring,
        max_model_len=sc["max_model_len"],
        accepted=accepted,
    )
    return full, ring, calls


def reference_ring(sc: dict) -> tuple[torch.Tensor, torch.Tensor]:
    project = make_project(sc["layers"], sc["dim"], sc["dtype"])
    kv = project(sc["features"], sc["positions"])  # row-local, so batching is irrelevant
    rejected = sc["rejected"] or [0] * (len(sc["qsl"]) - 1)
    cache, cache_pos = (t.clone() for t in sc["ring"])
    reference_store(
        cache, cache_pos, kv, sc["positions"].tolist(), sc["qsl"], sc["slots"], rejected,
        sc["window"],
    )
    return cache, cache_pos


def assert_rings_equal(got, want, what: str) -> None:
    """Live ring rows equal bitwise; the last row is scratch (dropped rows land there)."""
    (c, p), (wc, wp) = got, want
    c, p, wc, wp = c[:-1], p[:-1], wc[:-1], wp[:-1]
    assert torch.equal(p, wp), f"{what}: cache_pos differs"
    assert torch.equal(c.view(torch.uint8), wc.view(torch.uint8)), f"{what}: cache differs"


# ---------------------------------------------------------------------------
# The row split and padding
# ---------------------------------------------------------------------------


def test_plan_fields_and_frozen():
    plan = pp.plan_packed_prefill(7, 2, 0)
    assert (plan.num_tokens, plan.num_padded) == (7, 8)
    assert (plan.rows_per_rank, plan.tp_size, plan.num_pad_rows) == (4, 2, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.num_tokens = 3
    assert pp.MAX_PACKED_TOKENS == 8192
    assert pp.plan_packed_prefill(8192, 4, 0).rows_per_rank == 2048


def _random_plans(count: int):
    rng = random.Random(20260901)
    for i in range(count):
        tp = rng.randint(1, 4)
        num_tokens = rng.randint(1, 8192 if rng.random() < 0.3 else 600)
        if i % 7 == 0:  # N < tp_size or N barely above it
            num_tokens = rng.randint(1, tp)
        yield num_tokens, tp, rng.randint(1, 1 << 17)


def test_random_plans_against_row_arithmetic():
    """Split and pad positions on 150 random chunks (N to 8192, tp 1..4), row by row."""
    for n, tp, seed in _random_plans(150):
        padded = -(-n // tp) * tp
        rows = padded // tp
        for rank in range(tp):
            plan = pp.plan_packed_prefill(n, tp, rank)
            assert (plan.num_padded, plan.rows_per_rank) == (padded, rows), (n, tp)
            real = sum(1 for row in range(rank * rows, (rank + 1) * rows) if row < n)
            assert plan.rank_rows() == (rank * rows, real), (n, tp, rank)

        gen = torch.Generator().manual_seed(seed)
        max_len = n + int(torch.randint(1, 8, (1,), generator=gen))  # pads may hit the cap
        pos = torch.randint(0, max_len, (n,), generator=gen)
        top = max(pos.tolist())
        pad_pos = [min(top + 1 + i, max_len - 1) for i in range(padded - n)]
        assert pp._pad_positions(plan, pos, max_len).tolist() == pos.tolist() + pad_pos


def test_pad_positions_continue_after_largest_live_position():
    plan = pp.plan_packed_prefill(5, 4, 0)  # P=8: three pads
    pos = torch.tensor([40, 41, 7, 8, 9])
    assert pp._pad_positions(plan, pos, 100).tolist() == [40, 41, 7, 8, 9, 42, 43, 44]
    assert pp._pad_positions(plan, pos, 43).tolist() == [40, 41, 7, 8, 9, 42, 42, 42]
    assert pp._pad_positions(plan, pos.int(), 100).dtype == torch.int32
    no_pads = pp.plan_packed_prefill(8, 4, 0)
    assert pp._pad_positions(no_pads, pos, 8) is pos  # no copy when nothing is padded


def test_step_plan_routes_prefill_chunks_up_to_the_cap_through_packed_prefill():
    """The planner takes the packed path exactly for chunks with more rows than a verify
    step could have (R * (k+1)) and at most 8192 rows, split over its TP size."""
    def packed(qsl, k=1):
        return plan_for_store(qsl, list(range(len(qsl) - 1)), [k] * (len(qsl) - 1),
                              window=4, num_slots=len(qsl) - 1).packed

    assert packed([0, 2, 4]) is None  # two verify rows each: a plain verify step
    assert packed([0, 2, 5]).num_tokens == 5
    assert packed([0, 8192]).num_tokens == 8192
    assert packed([0, 8193]) is None  # past the cap: the plain store (never in the product)
    split = plan_for_store([0, 3, 7], [0, 1], window=4, num_slots=2, tp_size=3).packed
    assert (split.num_padded, split.rows_per_rank, split.num_pad_rows) == (9, 3, 2)


# ---------------------------------------------------------------------------
# TP=1 ingestion against the per-request reference
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCENARIOS)
def test_tp1_ingest_matches_reference_and_requests_alone(name):
    sc = build_scenario(name)
    want = reference_ring(sc)
    full, ring, calls = run_ingest(sc, 1, 0, None)
    assert_rings_equal(ring, want, f"{name} TP=1")
    assert full.shape == (sc["qsl"][-1], sc["layers"] * sc["dim"])
    assert len(calls) == 1 and calls[0][0].shape[0] == sc["qsl"][-1]

    # Each request ingested alone, one after the other, into the same caches gives the
    # same result: no cross-request coupling through the packing.
    alone = dict(sc)
    qsl = sc["qsl"]
    for r in range(len(qsl) - 1):
        kv, alone["ring"], _ = run_ingest(alone, 1, 0, None, request=r)
        assert torch.equal(kv, full[qsl[r] : qsl[r + 1]]), f"{name}: request {r} rows differ"
    assert_rings_equal(alone["ring"], want, f"{name} requests alone")


def test_zero_pad_row_would_project_nonzero():
    """Premise of the zero-pad checks: the test projection maps a zero row to nonzero,
    so pad rows come out zero only because ingestion forces them to."""
    sc = build_scenario("straddle")
    project = make_project(sc["layers"], sc["dim"], sc["dtype"])
    raw = project(torch.zeros(1, 2 * sc["dim"]), torch.tensor([129]))
    assert raw.abs().sum() > 0


# ---------------------------------------------------------------------------
# TP=2 with real torch.distributed (gloo, two processes on 127.0.0.1)
# ---------------------------------------------------------------------------


def _ingest_every_scenario(rank: int, group) -> dict:
    """What one of two TP ranks stores for every scenario."""
    results = {}
    for name in SCENARIOS:
        full, ring, calls = run_ingest(build_scenario(name), 2, rank, group)
        results[name] = {"full": full, "ring": ring, "calls": calls}
    return results


def _dist_worker(rank: int, port: int, out_dir: str) -> None:
    """One TP rank: ingest every scenario with TP=2 and save what it stored."""
    run_rank(rank, 2, port, out_dir, lambda group: _ingest_every_scenario(rank, group), 60)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """Results of both ranks; the two processes are spawned once for the module."""
    return spawn_ranks(_dist_worker, 2, tmp_path_factory, join_s=150)


def assert_ranks_match_tp1(sc: dict, results: list[dict], name: str) -> None:
    """Every rank of a TP run of scenario ``name`` against TP=1 and the reference: rings
    bit for bit, gathered rows equal to TP=1's with exactly-zero pads, and each rank's one
    projection over its own L = ceil(N / TP) rows (pads: zero input, positions continuing
    after the largest live one)."""
    tp = len(results)
    want = reference_ring(sc)
    tp1_full, tp1_ring, _ = run_ingest(sc, 1, 0, None)
    assert_rings_equal(tp1_ring, want, f"{name} TP=1")
    n = sc["qsl"][-1]
    rows = -(-n // tp)  # L, by hand
    padded = rows * tp
    real_rows = []
    for rank, res in enumerate(results):
        got = res[name]
        assert_rings_equal(got["ring"], want, f"{name} TP={tp} rank {rank}")
        full = got["full"]
        assert full.shape == (padded, sc["layers"] * sc["dim"])
        assert torch.equal(full[:n], tp1_full), f"{name}: gathered rows differ from TP=1"
        assert not full[n:].any(), f"{name}: pad rows are not exactly zero"
        ((x, pos),) = got["calls"]
        assert x.shape[0] == rows and pos.shape == (rows,)
        first = rank * rows
        real = max(0, min(n - first, rows))
        real_rows.append(real)
        assert torch.equal(x[:real], sc["features"][first : first + real].to(x.dtype))
        assert torch.equal(pos[:real], sc["positions"][first : first + real])
        if real < rows:
            assert not x[real:].any(), f"{name} rank {rank}: pad input rows are not zero"
            top = sc["positions"].max().item()
            want_pos = [top + 1 + i for i in range(first + real - n, first + rows - n)]
            assert pos[real:].tolist() == want_pos, (name, rank)
    assert sum(real_rows) == n and real_rows == sorted(real_rows, reverse=True)
    assert pp.plan_packed_prefill(n, tp, 0).num_pad_rows == padded - n


@pytest.mark.dist
@pytest.mark.parametrize("name", SCENARIOS)
def test_tp2_matches_tp1_reference_and_zero_pads(tp2, name):
    assert_ranks_match_tp1(build_scenario(name), tp2, name)


@pytest.mark.dist
def test_tp2_straddling_request_and_interleaved_rows(tp2):
    """Request 1 spans both ranks; its ring row sits between rows of other requests."""
    sc = build_scenario("straddle")
    project = make_project(sc["layers"], sc["dim"], sc["dtype"])
    c0, p0 = sc["ring"]
    for rank, res in enumerate(tp2):
        cache, cache_pos = res["straddle"]["ring"]
        # Request 0 (positions 126..128) -> ring row 3, columns 2, 3, 0; request 1
        # (30..33) -> ring row 1, columns 2, 3, 0, 1. Same columns, different rows.
        expect = {3: [128, None, 126, 127], 1: [32, 33, 30, 31]}
        for row, cells in expect.items():
            for col, pos in enumerate(cells):
                if pos is None:  # column 1 of row 3 keeps its older context
                    assert cache_pos[row, col] == p0[row, col]
                    assert torch.equal(cache[row, col], c0[row, col])
                    continue
                idx = sc["positions"].tolist().index(pos)
                kv = project(sc["features"][idx : idx + 1], sc["positions"][idx : idx + 1])
                assert cache_pos[row, col] == pos, (rank, row, col)
                assert torch.equal(cache[row, col], kv[0]), (rank, row, col)
        # Rows 0 and 2 belong to other requests and are untouched.
        for row in (0, 2):
            assert torch.equal(cache[row], c0[row]) and torch.equal(cache_pos[row], p0[row])
        # The pad (position 129) was written nowhere, not even in the scratch row.
        assert not (cache_pos == 129).any()
