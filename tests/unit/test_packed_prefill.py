"""Packed multi-request DSpark prefill (issue 5): plan, ownership, padding, TP ingestion.

Every result is checked against a reference written here, independently of the module:
plain Python lists for ownership and padding, and a per-request Python loop for the ring
store. The TP=2 tests run real torch.distributed (gloo) in two spawned processes on
127.0.0.1, once for the whole module.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import random
import traceback
from pathlib import Path

import pytest
import torch

from scripts.dev.gpu_check import reference_store
from tests.support.net import free_port
from tests.support.overlay import load_overlay_module

pp = load_overlay_module("vllm/v1/spec_decode/dspark/packed_prefill.py")
dr = load_overlay_module("vllm/v1/spec_decode/dspark/context_store.py")

# The TP=2 fixture joins its processes with a timeout too; this is the outer guard.
pytestmark = pytest.mark.timeout(300)


# ---------------------------------------------------------------------------
# Independent references
# ---------------------------------------------------------------------------


def ref_owner(qsl: list[int], tp: int) -> list[list[int]]:
    """Per-rank request ids by walking the requests in Python."""
    n = qsl[-1]
    padded = -(-n // tp) * tp
    owner: list[int] = []
    for r in range(len(qsl) - 1):
        owner += [r] * (qsl[r + 1] - qsl[r])
    owner += [-1] * (padded - n)
    rows = padded // tp
    return [owner[k * rows : (k + 1) * rows] for k in range(tp)]


def random_qsl(rng: random.Random, num_requests: int, num_tokens: int) -> list[int]:
    cuts = sorted(rng.sample(range(1, num_tokens), num_requests - 1))
    return [0, *cuts, num_tokens]


# ---------------------------------------------------------------------------
# Test projection and scenarios (shared by the parent and the spawned ranks)
# ---------------------------------------------------------------------------


def make_project(num_layers: int, dim: int, dtype: torch.dtype, seed: int = 7):
    """Row-local projection made of IEEE + and * only, so any batching is bitwise equal.

    The bias term makes a zero pad row project to a nonzero value: pad rows are zero only
    because ingestion forces them to zero.
    """
    gen = torch.Generator().manual_seed(seed)
    a, b, freq, bias = (torch.randn(num_layers, dim, generator=gen) for _ in range(4))

    def project(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = x.float()
        p = pos.float()[:, None, None]
        out = x[:, None, :dim] * a + x[:, None, dim:] * b + p * freq + bias
        return out.to(dtype)

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
        rejected = [0, 2, 3, 0, 1]
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
    caches = []
    for _ in range(layers):
        # num_slots live ring rows plus the scratch row the store drops rejected rows into.
        cache = torch.randn(num_slots + 1, window, dim, generator=gen).to(dtype)
        # Older context in every ring row, some cells empty: must survive where not written.
        cache_pos = torch.randint(0, 50, (num_slots + 1, window), generator=gen)
        cache_pos[torch.rand(num_slots + 1, window, generator=gen) < 0.3] = -1
        caches.append((cache, cache_pos))
    return {
        "qsl": qsl,
        "positions": positions,
        "features": torch.randn(num, 2 * dim, generator=gen).to(dtype),
        "slots": slots,
        "num_slots": num_slots,
        "rejected": rejected,
        "caches": caches,
        "window": window,
        "layers": layers,
        "dim": dim,
        "dtype": dtype,
        "max_model_len": 1 << 16,
    }


SCENARIOS = ["straddle", "random_bf16", "single_token", "rejected", "full_chunk"]


def run_ingest(sc: dict, tp: int, rank: int, group, request: int | None = None) -> tuple:
    """Ingest a scenario, or only one of its requests, into fresh copies of its caches."""
    qsl, rows = sc["qsl"], slice(None)
    slots = torch.tensor(sc["slots"])
    rejected = None if sc["rejected"] is None else torch.tensor(sc["rejected"])
    if request is not None:
        rows = slice(qsl[request], qsl[request + 1])
        qsl = [0, rows.stop - rows.start]
        slots = slots[request : request + 1]
        rejected = None if rejected is None else rejected[request : request + 1]
    caches = [(c.clone(), p.clone()) for c, p in sc["caches"]]
    qsl = torch.tensor(qsl, dtype=torch.int32)
    plan = pp.plan_packed_prefill(qsl, tp, rank=rank, group=group)
    store = dr.plan_store(qsl, slots, rejected, window=sc["window"], num_slots=sc["num_slots"])
    project = make_project(sc["layers"], sc["dim"], sc["dtype"])
    calls = []

    def spy(x, pos):
        calls.append((x.clone(), pos.clone()))
        return project(x, pos)

    full = pp.ingest_packed_prefill(
        plan,
        store,
        sc["features"][rows],
        sc["positions"][rows],
        spy,
        caches,
        max_model_len=sc["max_model_len"],
        num_rejected=rejected,
    )
    return full, caches, calls


def reference_caches(sc: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    project = make_project(sc["layers"], sc["dim"], sc["dtype"])
    kv = project(sc["features"], sc["positions"])  # row-local, so batching is irrelevant
    rejected = sc["rejected"] or [0] * (len(sc["qsl"]) - 1)
    out = []
    for k, (cache, cache_pos) in enumerate(sc["caches"]):
        cache, cache_pos = cache.clone(), cache_pos.clone()
        reference_store(
            cache,
            cache_pos,
            kv[:, k],
            sc["positions"].tolist(),
            sc["qsl"],
            sc["slots"],
            rejected,
            sc["window"],
        )
        out.append((cache, cache_pos))
    return out


def assert_caches_equal(got, want, what: str) -> None:
    """Live ring rows equal bitwise; the last row is scratch (dropped rows land there)."""
    for k, ((c, p), (wc, wp)) in enumerate(zip(got, want, strict=True)):
        c, p, wc, wp = c[:-1], p[:-1], wc[:-1], wp[:-1]
        assert torch.equal(p, wp), f"{what}: cache_pos of layer {k} differs"
        assert torch.equal(c.view(torch.uint8), wc.view(torch.uint8)), (
            f"{what}: cache of layer {k} differs"
        )


# ---------------------------------------------------------------------------
# Plan, ownership, padding, logit rows
# ---------------------------------------------------------------------------


def test_plan_fields_and_frozen_copy():
    qsl = torch.tensor([0, 3, 7], dtype=torch.int32)
    plan = pp.plan_packed_prefill(qsl, 2)
    assert (plan.num_requests, plan.num_tokens, plan.num_padded) == (2, 7, 8)
    assert (plan.rows_per_rank, plan.tp_size, plan.num_pad_rows) == (4, 2, 1)
    assert plan.query_start_loc.dtype == torch.int32
    qsl[1] = 1  # the plan keeps its own copy
    assert plan.query_start_loc.tolist() == [0, 3, 7]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.num_tokens = 3
    assert pp.MAX_PACKED_TOKENS == 8192
    assert pp.plan_packed_prefill(torch.tensor([0, 8192]), 4).rows_per_rank == 2048


EDGE_PLANS = [
    ([0, 3, 7], 2),  # request 1 straddles the ranks, row 7 is the pad
    ([0, 4, 6, 7], 2),  # request 2 lies wholly in the rank that holds the pad
    ([0, 1], 4),  # N < tp_size: ranks 1..3 hold only pad rows
    ([0, 1, 2], 4),
    ([0, 5], 3),
    ([0, 2, 4, 9, 10], 4),  # a request spans three ranks, last rank two pads
    ([0, 8192], 1),
    ([0, 8192], 3),
    (list(range(8193)), 4),  # every request one row
    ([0, 1, 8191], 2),
]


@pytest.mark.parametrize(("qsl", "tp"), EDGE_PLANS)
def test_local_request_ids_edge_plans(qsl, tp):
    plan = pp.plan_packed_prefill(torch.tensor(qsl), tp)
    want = ref_owner(qsl, tp)
    for rank in range(tp):
        got = pp.local_request_ids(plan, rank)
        assert got.dtype == torch.int32 and got.shape == (plan.rows_per_rank,)
        assert got.tolist() == want[rank]


def test_local_request_ids_known_fixture():
    plan = pp.plan_packed_prefill(torch.tensor([0, 3, 7], dtype=torch.int32), 2)
    assert pp.local_request_ids(plan, 0).tolist() == [0, 0, 0, 1]
    assert pp.local_request_ids(plan, 1).tolist() == [1, 1, 1, -1]


def _random_plans(count: int):
    rng = random.Random(20260901)
    for i in range(count):
        tp = rng.randint(1, 4)
        num_requests = rng.choice([1, 2, 3, rng.randint(1, 64), rng.randint(1, 512)])
        big = rng.random() < 0.3
        num_tokens = rng.randint(num_requests, 8192 if big else max(num_requests, 600))
        if i % 7 == 0:  # N < tp_size or N barely above it
            num_requests, num_tokens = 1, rng.randint(1, tp)
        yield random_qsl(rng, num_requests, num_tokens), tp, rng.randint(1, 1 << 17)


def test_random_plans_against_reference():
    """Ownership, padding and logit rows on 150 random plans (R 1..512, N to 8192, tp 1..4)."""
    for qsl, tp, seed in _random_plans(150):
        plan = pp.plan_packed_prefill(torch.tensor(qsl, dtype=torch.int32), tp)
        n = qsl[-1]
        padded = -(-n // tp) * tp
        assert (plan.num_padded, plan.rows_per_rank) == (padded, padded // tp), qsl
        want = ref_owner(qsl, tp)
        for rank in range(tp):
            assert pp.local_request_ids(plan, rank).tolist() == want[rank], (qsl, tp, rank)
        assert pp.logit_row_indices(plan).tolist() == [q - 1 for q in qsl[1:]]

        gen = torch.Generator().manual_seed(seed)
        max_len = n + int(torch.randint(1, 8, (1,), generator=gen))  # pads may hit the cap
        pos = torch.randint(0, max_len, (n,), generator=gen)
        top = max(pos.tolist())
        pad_pos = [min(top + 1 + i, max_len - 1) for i in range(padded - n)]
        assert pp.pad_positions(plan, pos, max_len).tolist() == pos.tolist() + pad_pos

        slots = torch.randint(-1, 1000, (n,), generator=gen)
        got = pp.pad_slot_mapping(plan, slots)
        assert got.tolist() == slots.tolist() + [-1] * (padded - n)

        hidden = torch.randn(n, 3, generator=gen)
        got = pp.pad_rows(plan, hidden)
        assert got.shape == (padded, 3)
        assert torch.equal(got[:n], hidden) and not got[n:].any()


def test_pad_positions_continue_after_largest_live_position():
    plan = pp.plan_packed_prefill(torch.tensor([0, 2, 5]), 4)  # P=8: three pads
    pos = torch.tensor([40, 41, 7, 8, 9])
    assert pp.pad_positions(plan, pos, 100).tolist() == [40, 41, 7, 8, 9, 42, 43, 44]
    assert pp.pad_positions(plan, pos, 43).tolist() == [40, 41, 7, 8, 9, 42, 42, 42]
    assert pp.pad_positions(plan, pos.int(), 100).dtype == torch.int32


def test_no_padding_returns_inputs_uncopied():
    plan = pp.plan_packed_prefill(torch.tensor([0, 3, 8]), 4)
    hidden, pos, slots = torch.randn(8, 2), torch.arange(8), torch.arange(8)
    assert pp.pad_rows(plan, hidden) is hidden
    assert pp.pad_positions(plan, pos, 8) is pos
    assert pp.pad_slot_mapping(plan, slots) is slots


def test_validate_request_tables_accepts_matching_tables():
    plan = pp.plan_packed_prefill(torch.tensor([0, 3, 7]), 2)
    pp.validate_request_tables(
        plan,
        block_table=torch.zeros(2, 16, dtype=torch.int32),
        slots=torch.tensor([4, 1]),
        state=torch.zeros(2, 3, 5),
        optional=None,
    )


# ---------------------------------------------------------------------------
# Validation: every error has its own message; nothing computed or written
# ---------------------------------------------------------------------------

PLAN_ERRORS = [
    ("list", lambda: pp.plan_packed_prefill([0, 3], 1), r"query_start_loc must be a torch\.Tensor"),
    ("2d", lambda: pp.plan_packed_prefill(torch.tensor([[0, 3]]), 1), r"must be 1-D \[R\+1\], got shape \(1, 2\)"),
    ("float", lambda: pp.plan_packed_prefill(torch.tensor([0.0, 3.0]), 1), r"integer dtype, got torch\.float32"),
    ("bool", lambda: pp.plan_packed_prefill(torch.tensor([False, True]), 1), r"integer dtype, got torch\.bool"),
    ("short", lambda: pp.plan_packed_prefill(torch.tensor([0]), 1), r"at least 2 entries.*got shape \(1,\)"),
    ("start", lambda: pp.plan_packed_prefill(torch.tensor([1, 3]), 1), r"query_start_loc\[0\] must be 0, got 1"),
    ("empty request", lambda: pp.plan_packed_prefill(torch.tensor([0, 3, 3, 5]), 1), r"strictly increasing.*request 1"),
    ("decreasing", lambda: pp.plan_packed_prefill(torch.tensor([0, 3, 2]), 1), r"strictly increasing.*request 1 has query_start_loc\[1\]=3, query_start_loc\[2\]=2"),
    ("too many", lambda: pp.plan_packed_prefill(torch.tensor([0, 8193]), 1), r"N, tokens in the chunk\) must be in \[1, 8192\], got 8193"),
    ("custom cap", lambda: pp.plan_packed_prefill(torch.tensor([0, 9]), 1, max_tokens=8), r"must be in \[1, 8\], got 9"),
    ("tp zero", lambda: pp.plan_packed_prefill(torch.tensor([0, 3]), 0), r"tp_size must be an int >= 1, got 0"),
    ("tp bool", lambda: pp.plan_packed_prefill(torch.tensor([0, 3]), True), r"tp_size must be an int >= 1, got True"),
    ("max_tokens", lambda: pp.plan_packed_prefill(torch.tensor([0, 3]), 1, max_tokens=0), r"max_tokens must be an int >= 1"),
    ("rank", lambda: pp.plan_packed_prefill(torch.tensor([0, 3]), 1, rank=1), r"rank must be an int in \[0, 1\)"),
    ("group uninit", lambda: pp.plan_packed_prefill(torch.tensor([0, 3]), 1, group=object()), r"torch\.distributed is not initialized|group must be a torch\.distributed ProcessGroup"),
]  # fmt: skip


def test_caps_are_inclusive():
    """A one-token chunk under a one-token cap, and exactly 8192 tokens under the default cap
    (DESIGN section 6: 1 <= N <= 8192), are planned."""
    one = pp.plan_packed_prefill(torch.tensor([0, 1]), 1, max_tokens=1)
    assert (one.num_tokens, one.num_padded) == (1, 1)
    full = pp.plan_packed_prefill(torch.tensor([0, 4096, 8192]), 2)
    assert (full.num_tokens, full.rows_per_rank) == (8192, 4096)


@pytest.mark.parametrize("num_tokens, tp_size", [(1, 4), (5, 8), (9, 2), (8, 4)])
def test_ranks_past_the_last_token_own_no_real_rows(num_tokens, tp_size):
    """Rank k owns packed rows [k*L, (k+1)*L); its real rows are those below N, counted row by
    row here. A rank that starts past N (N=1 at TP=4) has none and only pad rows."""
    plan = pp.plan_packed_prefill(torch.tensor([0, num_tokens]), tp_size)
    rows = plan.rows_per_rank
    for rank in range(tp_size):
        real = sum(1 for row in range(rank * rows, (rank + 1) * rows) if row < num_tokens)
        assert plan.rank_rows(rank) == (rank * rows, real)
        assert pp.local_request_ids(plan, rank).tolist() == [0] * real + [-1] * (rows - real)


def test_plans_compare_by_identity():
    """A plan holds a tensor, which has no boolean equality: ``==`` is identity, so two plans
    of the same chunk are different objects and comparing them never reaches the tensor."""
    first, second = (pp.plan_packed_prefill(torch.tensor([0, 3, 7]), 2) for _ in range(2))
    assert first == first and first != second and len({first, second}) == 2


def test_group_without_initialized_distributed_names_the_cause(monkeypatch):
    # Another test in this process may have initialised torch.distributed: pretend it has not.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(ValueError, match=r"^group was given but torch\.distributed is not initialized$"):
        pp.plan_packed_prefill(torch.tensor([0, 3]), 1, group=object())


def _plan2():
    return pp.plan_packed_prefill(torch.tensor([0, 3, 7]), 2)


HELPER_ERRORS = [
    ("rank high", lambda: pp.local_request_ids(_plan2(), 2), r"rank must be an int in \[0, 2\) \(tp_size\), got 2"),
    ("rank neg", lambda: pp.local_request_ids(_plan2(), -1), r"rank must be an int in \[0, 2\) \(tp_size\), got -1"),
    ("table rows", lambda: pp.validate_request_tables(_plan2(), slots=torch.zeros(2), block_table=torch.zeros(3, 16)), r"'block_table' has shape \(3, 16\).*R=2"),
    ("table 0d", lambda: pp.validate_request_tables(_plan2(), start_pos=torch.tensor(4)), r"'start_pos' has shape \(\).*R=2"),
    ("table type", lambda: pp.validate_request_tables(_plan2(), state=[1, 2]), r"'state' must be a torch\.Tensor.*R=2, got list"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "call", "match"), PLAN_ERRORS + HELPER_ERRORS)
def test_helper_validation_errors(name, call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _ingest_case(**overrides):
    """A valid TP=1 ingestion of the straddle scenario, with overrides applied."""
    sc = build_scenario("straddle")
    project = make_project(sc["layers"], sc["dim"], sc["dtype"])
    calls = []

    def spy(x, pos):
        calls.append(1)
        return project(x, pos)

    qsl = torch.tensor(sc["qsl"])
    kwargs = {
        "plan": pp.plan_packed_prefill(qsl, 1),
        "store": dr.plan_store(qsl, sc["slots"], window=sc["window"], num_slots=sc["num_slots"]),
        "features": sc["features"],
        "positions": sc["positions"],
        "project": spy,
        "kv_caches": sc["caches"],
        "max_model_len": sc["max_model_len"],
        "num_rejected": None,
    }
    kwargs.update(overrides)
    return kwargs, calls


@pytest.mark.parametrize(
    ("name", "bad", "match"),
    [
        ("shape", lambda x, pos: torch.zeros(7, 2, 5), r"project must return \[L, K, D\]=\[7, 2, 4\], got \(7, 2, 5\)"),
        ("type", lambda x, pos: None, r"project must return \[L, K, D\]=\[7, 2, 4\], got NoneType"),
        ("dtype", lambda x, pos: torch.zeros(7, 2, 4, dtype=torch.float64), r"project must return torch\.float32 on cpu.*got torch\.float64"),
    ],
)  # fmt: skip
def test_bad_projection_output_writes_nothing(name, bad, match):
    kwargs, _ = _ingest_case(project=bad)
    before = [(c.clone(), p.clone()) for c, p in kwargs["kv_caches"]]
    with pytest.raises(ValueError, match=match):
        pp.ingest_packed_prefill(**kwargs)
    assert_caches_equal(kwargs["kv_caches"], before, name)


def test_tp2_ingestion_without_a_group_is_refused_before_projecting():
    kwargs, calls = _ingest_case(plan=pp.plan_packed_prefill(torch.tensor([0, 3, 7]), 2))
    with pytest.raises(ValueError, match="plan.group must be a torch.distributed ProcessGroup"):
        pp.ingest_packed_prefill(**kwargs)
    assert calls == []


def test_every_validation_error_has_its_own_message(monkeypatch):
    """Distinct checks give distinct messages (per entry point; shared checks may repeat)."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    for cases in (PLAN_ERRORS, HELPER_ERRORS):
        messages = []
        for _, call, _ in cases:
            with pytest.raises(ValueError) as err:
                call()
            messages.append(str(err.value))
        assert len(set(messages)) == len(messages), messages


# ---------------------------------------------------------------------------
# TP=1 ingestion against the per-request reference
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCENARIOS)
def test_tp1_ingest_matches_reference_and_requests_alone(name):
    sc = build_scenario(name)
    want = reference_caches(sc)
    full, caches, calls = run_ingest(sc, 1, 0, None)
    assert_caches_equal(caches, want, f"{name} TP=1")
    assert full.shape == (sc["qsl"][-1], sc["layers"], sc["dim"])
    assert len(calls) == 1 and calls[0][0].shape[0] == sc["qsl"][-1]

    # Each request ingested alone, one after the other, into the same caches gives the
    # same result: no cross-request coupling through the packing.
    alone = dict(sc)
    qsl = sc["qsl"]
    for r in range(len(qsl) - 1):
        kv, alone["caches"], _ = run_ingest(alone, 1, 0, None, request=r)
        assert torch.equal(kv, full[qsl[r] : qsl[r + 1]]), f"{name}: request {r} rows differ"
    alone = alone["caches"]
    assert_caches_equal(alone, want, f"{name} requests alone")


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


# Plans a rank must refuse in a real TP=2 group: (this rank) -> plan_packed_prefill kwargs.
REFUSED_TP2_PLANS = {
    "another rank": lambda rank: {"tp_size": 2, "rank": 1 - rank},
    "world size": lambda rank: {"tp_size": 1, "rank": 0},
}


def _dist_worker(rank: int, port: int, out_dir: str) -> None:
    """One TP rank: ingest every scenario with TP=2 and save what it stored."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    if os.path.isdir("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=60),
        )
        group = dist.group.WORLD
        results = {}
        for name in SCENARIOS:
            sc = build_scenario(name)
            full, caches, calls = run_ingest(sc, 2, rank, group)
            results[name] = {"full": full, "caches": caches, "calls": calls}
        plan = pp.plan_packed_prefill(torch.tensor([0, 3, 7], dtype=torch.int32), 2)
        results["rids"] = pp.local_request_ids(plan, rank)
        results["refused"] = {}
        for label, kwargs in REFUSED_TP2_PLANS.items():
            try:
                pp.plan_packed_prefill(plan.query_start_loc, group=group, **kwargs(rank))
                results["refused"][label] = None
            except ValueError as err:
                results["refused"][label] = str(err)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """Results of both ranks; the two processes are spawned once for the module."""
    ctx = multiprocessing.get_context("spawn")
    for attempt in range(2):  # a second try if another test grabbed the port
        out = tmp_path_factory.mktemp(f"tp2_{attempt}")
        port = free_port()
        procs = [
            ctx.Process(target=_dist_worker, args=(rank, port, str(out)), daemon=True)
            for rank in range(2)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=150)
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
            p.join(5)
        errors = "\n".join(f.read_text() for f in sorted(out.glob("*.err")))
        if not hung and all(p.exitcode == 0 for p in procs):
            return [torch.load(out / f"rank{r}.pt") for r in range(2)]
        if "ddress already in use" not in errors or attempt:
            pytest.fail(f"TP=2 workers failed (hung={len(hung)}):\n{errors}")
    raise AssertionError("unreachable")


@pytest.mark.dist
@pytest.mark.parametrize("name", SCENARIOS)
def test_tp2_matches_tp1_reference_and_zero_pads(tp2, name):
    sc = build_scenario(name)
    want = reference_caches(sc)
    tp1_full, tp1_caches, _ = run_ingest(sc, 1, 0, None)
    assert_caches_equal(tp1_caches, want, f"{name} TP=1")
    n = sc["qsl"][-1]
    padded = n + n % 2
    for rank, res in enumerate(tp2):
        got = res[name]
        assert_caches_equal(got["caches"], want, f"{name} TP=2 rank {rank}")
        full = got["full"]
        assert full.shape == (padded, sc["layers"], sc["dim"])
        assert torch.equal(full[:n], tp1_full), f"{name}: gathered rows differ from TP=1"
        assert not full[n:].any(), f"{name}: pad rows are not exactly zero"
        # The projection ran on this rank's L rows only.
        ((x, pos),) = got["calls"]
        assert x.shape[0] == padded // 2 and pos.shape == (padded // 2,)
        if rank == 1 and padded > n:
            assert not x[-1].any(), "pad input row is not zero"
            assert pos[-1].item() == sc["positions"].max().item() + 1


@pytest.mark.dist
def test_tp2_straddling_request_and_interleaved_rows(tp2):
    """Request 1 spans both ranks; its ring row sits between rows of other requests."""
    assert tp2[0]["rids"].tolist() == [0, 0, 0, 1]
    assert tp2[1]["rids"].tolist() == [1, 1, 1, -1]
    sc = build_scenario("straddle")
    project = make_project(sc["layers"], sc["dim"], sc["dtype"])
    for rank, res in enumerate(tp2):
        for k, ((cache, cache_pos), (c0, p0)) in enumerate(
            zip(res["straddle"]["caches"], sc["caches"], strict=True)
        ):
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
                    assert cache_pos[row, col] == pos, (rank, k, row, col)
                    assert torch.equal(cache[row, col], kv[0, k]), (rank, k, row, col)
            # Rows 0 and 2 belong to other requests and are untouched.
            for row in (0, 2):
                assert torch.equal(cache[row], c0[row]) and torch.equal(cache_pos[row], p0[row])
            # The pad (position 129) was written nowhere, not even in the scratch row.
            assert not (cache_pos == 129).any()


def test_group_that_is_not_a_process_group_is_refused(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with pytest.raises(
        ValueError, match="group must be a torch.distributed ProcessGroup, got object"
    ):
        pp.plan_packed_prefill(torch.tensor([0, 3]), 1, group=object())


@pytest.mark.dist
def test_tp2_plan_refuses_a_rank_or_size_that_is_not_the_groups(tp2):
    """Each process knows its rank (it was spawned with it): any other rank, or a TP size
    other than the group's, is a ValueError naming both, before any row is split."""
    for rank, res in enumerate(tp2):
        refused = res["refused"]
        assert refused["another rank"] == (
            f"rank={1 - rank} does not match this process's rank {rank} in group"
        )
        assert refused["world size"] == "group has world size 2, expected tp_size=1"
