"""DSparkProposer without an engine: ingestion bookkeeping, slots, reorder, packed path.

Every step is synthetic (random aux hidden states, positions, rejections), fed through the
real proposer and draft model. After each step every request's ring must hold exactly its
accepted context rows of the last W positions (a per-request reference), whatever the mix
of prefill chunks and verify rows, the batch order or slot reuse.
"""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest
import torch
import vllm.v1.spec_decode.dspark.step_plan as step_mod
from vllm.v1.spec_decode.dspark.step_plan import DSparkStepInput

from tests.support.draft_hooks import replace_drafts, restore_drafts
from tests.support.dspark_steps import observe_steps
from tests.support.tiny import build_draft, ensure_tiny_model, make_proposer


@pytest.fixture(scope="module")
def env():
    draft, vc = build_draft(ensure_tiny_model())
    return draft, vc


class Sim:
    """Drives a proposer with synthetic steps and keeps a per-request reference."""

    def __init__(self, proposer, seed):
        self.p = proposer
        self.seed = seed
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        shape = proposer.model.shape
        self.width = shape.hidden_size * len(shape.target_layer_ids)
        self.vocab = shape.vocab_size
        self.length = {}  # req id -> committed positions
        self.reference = {}  # req id -> {pos: [K, D] kv}
        self.records = []
        observe_steps(proposer, self.records.append)

    def step(self, segments, order=None):
        """segments: list of (req_id, new_rows, num_rejected). Returns (drafts, record)."""
        if order is not None:
            segments = [segments[i] for i in order]
        qsl, positions, rej, ids, aux, anchors, bound = [0], [], [], [], [], [], []
        k = self.p.num_speculative_tokens
        for rid, rows, r in segments:
            # The scheduler's draft count bounds the rejections: a verify segment of
            # rows <= k+1 verified rows-1 drafts, however many the target rejected.
            bound.append(rows - 1 if rows <= k + 1 else r)
            start = self.length.setdefault(rid, 0)
            positions.extend(range(start, start + rows))
            qsl.append(qsl[-1] + rows)
            rej.append(r)
            ids.append(rid)
            # Inputs depend on (request, position) only, never on the batch order.
            g = torch.Generator().manual_seed(self.seed * 7919 + zlib.crc32(rid.encode()) + start)
            aux.append(torch.randn(rows, self.width, generator=g).to(torch.bfloat16))
            anchors.append(int(torch.randint(0, self.vocab, (1,), generator=g)))
        aux = torch.cat(aux)
        anchors = torch.tensor(anchors)
        drafts = self.p.propose(DSparkStepInput(
            req_ids=ids,
            query_start_loc_cpu=np.array(qsl),
            num_draft_tokens=np.array(bound),
            prefilling=np.zeros(len(ids), bool),
            positions=torch.tensor(positions),
            aux_hidden_states=aux,
            num_rejected=torch.tensor(rej),
            next_token_ids=anchors,
        ))
        rec = self.records[-1]
        for i, (rid, rows, r) in enumerate(segments):
            for row in range(qsl[i], qsl[i + 1] - r):
                self.reference.setdefault(rid, {})[positions[row]] = rec.context_kv[row]
            self.length[rid] += rows - r
        return drafts, rec

    def check_windows(self, rec):
        window = self.p.window
        for i, rid in enumerate(rec.req_ids):
            anchor = int(rec.anchor_positions[i])
            assert anchor == self.length[rid]
            held = {}
            for cell in range(window):
                pos = int(rec.ring_pos[i, cell])
                if rec.window[i, cell]:
                    held[pos] = rec.ring[i, cell]
            want = range(max(0, anchor - window), anchor)
            assert sorted(held) == list(want), f"{rid}: window holds {sorted(held)[:5]}..."
            for pos in want:
                assert torch.equal(held[pos], self.reference[rid][pos]), (rid, pos)


def test_every_step_ingests_accepted_rows_flat_and_ragged(env):
    draft, vc = env
    p = make_proposer(draft, vc, max_num_seqs=8)
    sim = Sim(p, seed=0)
    k = p.num_speculative_tokens
    # Prefill chunks of very different lengths, then mixed steps, then uniform decode.
    sim.step([("a", 1, 0), ("b", 37, 0), ("c", 150, 0)])
    sim.check_windows(sim.records[-1])
    for _ in range(6):
        segs = [
            ("a", k + 1, sim.rng.randint(0, k)),
            ("b", k + 1, sim.rng.randint(0, k)),
            ("c", 1 + sim.rng.randint(0, k), 0),
            ("d", sim.rng.randint(1, 40), 0),  # a request still in chunked prefill
        ]
        segs[2] = ("c", segs[2][1], sim.rng.randint(0, segs[2][1] - 1))
        sim.step(segs)
        sim.check_windows(sim.records[-1])
    for _ in range(3):
        sim.step([(r, k + 1, sim.rng.randint(0, k)) for r in "abcd"])
        sim.check_windows(sim.records[-1])
    c = p.counters
    assert c.ragged_steps == 7 and c.flat_steps == 3 and c.steps == 10
    assert c.packed_steps >= 1
    assert c.ingested_rows == sum(len(v) for v in sim.reference.values())


def test_rejected_rows_never_overwrite_live_context(env):
    """A rejected verify row's cell (pos % W) holds a live position W back: keep it."""
    draft, vc = env
    p = make_proposer(draft, vc)
    sim = Sim(p, seed=1)
    window, k = p.window, p.num_speculative_tokens
    sim.step([("x", window + 3, 0)])
    before = sim.records[-1]
    sim.step([("x", k + 1, k)])  # all drafts rejected: only the anchor row is accepted
    after = sim.records[-1]
    sim.check_windows(after)
    assert int(after.anchor_positions[0]) == window + 4
    # the cells of the k rejected positions still hold their older positions
    for j in range(1, k + 1):
        cell = (window + 3 + j) % window
        assert int(after.ring_pos[0, cell]) == int(before.ring_pos[0, cell])


def test_batch_reorder_gives_the_same_drafts_per_request(env):
    draft, vc = env
    results = []
    for order in (None, [2, 0, 1]):
        p = make_proposer(draft, vc)
        sim = Sim(p, seed=2)
        segs = [("a", 9, 0), ("b", 130, 0), ("c", 2, 0)]
        drafts, _ = sim.step(segs, order=order)
        k = p.num_speculative_tokens
        drafts2, rec = sim.step([("a", k + 1, 1), ("b", k + 1, 0), ("c", k + 1, 3)], order=order)
        results.append({rid: drafts2[i].tolist() for i, rid in enumerate(rec.req_ids)})
    assert results[0] == results[1]


def _propose(p, segments, width, gen):
    """One explicit step: segments = [(req_id, first_pos, rows, rejected, anchor, aux)]."""
    qsl, pos, aux = [0], [], []
    for _, first, rows, _, _, a in segments:
        qsl.append(qsl[-1] + rows)
        pos.extend(range(first, first + rows))
        aux.append(a)
    return p.propose(DSparkStepInput(
        req_ids=[s[0] for s in segments],
        query_start_loc_cpu=np.array(qsl),
        num_draft_tokens=np.array([s[3] for s in segments]),
        prefilling=np.zeros(len(segments), bool),
        positions=torch.tensor(pos),
        aux_hidden_states=torch.cat(aux),
        num_rejected=torch.tensor([s[3] for s in segments]),
        next_token_ids=torch.tensor([s[4] for s in segments]),
    ))


def test_released_slot_is_reused_without_its_old_context(env):
    draft, vc = env
    width = draft.shape.hidden_size * len(draft.shape.target_layer_ids)
    gen = torch.Generator().manual_seed(3)

    def rows(n):
        return torch.randn(n, width, generator=gen).to(torch.bfloat16)

    new_aux = rows(3)
    p = make_proposer(draft, vc, max_num_seqs=2)
    _propose(p, [("old", 0, 60, 0, 5, rows(60)), ("keep", 0, 5, 0, 6, rows(5))], width, gen)
    [slot_old] = p.slot_table.assign(["old"])  # its row (a known id keeps it)
    p.release(["old"])
    assert p.counters.released_slots == 1
    assert not (p.kv_pos[slot_old] >= 0).any()
    reused = _propose(p, [("keep", 5, 1, 0, 6, rows(1)), ("new", 0, 3, 0, 9, new_aux)], width, gen)
    assert p.slot_table.assign(["new"]) == [slot_old]
    fresh = make_proposer(draft, vc, max_num_seqs=2)
    alone = _propose(fresh, [("new", 0, 3, 0, 9, new_aux)], width, gen)
    assert torch.equal(reused[1], alone[0])
    with pytest.raises(RuntimeError, match="full"):
        _propose(
            p,
            [
                ("keep", 6, 1, 0, 1, rows(1)),
                ("new", 3, 1, 0, 1, rows(1)),
                ("x", 0, 1, 0, 1, rows(1)),
            ],
            width,
            gen,
        )


def test_before_step_frees_every_request_that_left(env):
    """Finished and preempted (as reported) and unreported ones (the runner no longer holds
    them) lose their ring rows before the step; requests still running keep theirs."""
    from types import SimpleNamespace

    from vllm.v1.spec_decode.dspark.runner_glue import before_step

    draft, vc = env
    width = draft.shape.hidden_size * len(draft.shape.target_layer_ids)
    gen = torch.Generator().manual_seed(5)
    p = make_proposer(draft, vc, max_num_seqs=4)
    p.vllm_config = vc
    ids = ["done", "preempted", "vanished", "running"]
    _propose(p, [(r, 0, 3, 0, 5, torch.randn(3, width, generator=gen).bfloat16()) for r in ids],
             width, gen)
    slots = dict(zip(ids, p.slot_table.assign(ids), strict=True))
    runner = SimpleNamespace(drafter=p, vllm_config=vc,
                             requests=dict.fromkeys(["preempted", "running"]))
    before_step(runner, SimpleNamespace(finished_req_ids={"done"},
                                        preempted_req_ids={"preempted"}))
    assert p.live_request_ids == {"running"}
    assert p.counters.released_slots == 3
    for r in ("done", "preempted", "vanished"):
        assert not (p.kv_pos[slots[r]] >= 0).any()
    assert (p.kv_pos[slots["running"]] >= 0).sum() == 3


def test_packed_prefill_path_equals_direct_store(env, monkeypatch):
    draft, vc = env
    rings = []
    for packed in (True, False):
        if not packed:
            monkeypatch.setattr(step_mod, "MAX_PACKED_TOKENS", 0)
        p = make_proposer(draft, vc)
        sim = Sim(p, seed=4)
        sim.step([("a", 70, 0), ("b", 3, 0), ("c", 140, 0)])
        sim.step([("a", 5, 2), ("b", 40, 0), ("c", 5, 0)])
        assert p.counters.packed_steps == (2 if packed else 0)
        rings.append((p.kv_cache.clone(), p.kv_pos.clone()))
    assert torch.equal(rings[0][0], rings[1][0])
    assert torch.equal(rings[0][1], rings[1][1])


def test_probabilistic_drafts_keep_distributions(env):
    draft, vc = env
    p = make_proposer(draft, vc, probabilistic=True)
    sim = Sim(p, seed=5)
    temperature = torch.tensor([0.0, 0.8, 1.3])
    ids = ["g", "r1", "r2"]
    drafts = p.propose(DSparkStepInput(
        req_ids=ids,
        query_start_loc_cpu=np.array([0, 4, 9, 30]),
        num_draft_tokens=np.zeros(3, np.int64),
        prefilling=np.zeros(3, bool),
        positions=torch.cat([torch.arange(4), torch.arange(5), torch.arange(21)]),
        aux_hidden_states=torch.randn(30, sim.width, generator=sim.gen).to(torch.bfloat16),
        num_rejected=torch.zeros(3, dtype=torch.int64),
        next_token_ids=torch.tensor([7, 8, 9]),
        temperature=temperature,
        temperature_cpu=temperature.numpy(),
    ))
    probs = p.take_last_draft_probs()
    assert p.take_last_draft_probs() is None
    k = p.num_speculative_tokens
    assert drafts.shape == (3, k) and drafts.dtype == torch.int32
    assert probs.shape == (3, k, sim.vocab) and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, k))
    # the greedy request's distribution is the one-hot of its draft
    assert torch.equal(probs[0].argmax(-1), drafts[0].long())
    assert torch.equal(probs[0].max(-1).values, torch.ones(k))
    # sampled tokens have positive probability under their distribution
    picked = probs[1:].gather(-1, drafts[1:].long()[..., None]).squeeze(-1)
    assert (picked > 0).all()
    assert p.last_confidence.shape == (3, p.block_size)


def test_harness_draft_hook_replaces_drafts_and_restores_the_model(env):
    """The e2e tests' oracle drafts go through ``support.draft_hooks``: it must see the
    step's anchors, replace exactly the drafts handed back, and leave the model after."""
    draft, vc = env
    p = make_proposer(draft, vc)
    sim = Sim(p, seed=6)
    seen = {}

    def override(*, req_ids, anchor_positions, anchor_tokens, drafts):
        seen["anchor"] = anchor_positions.tolist()
        seen["req_ids"] = list(req_ids)
        return torch.full_like(drafts, 11)

    replace_drafts(p, override)
    drafts, _ = sim.step([("a", 3, 0), ("b", 8, 0)])
    assert seen == {"anchor": [3, 8], "req_ids": ["a", "b"]}
    assert drafts.eq(11).all()
    assert p.counters.drafted_tokens == 2 * p.num_speculative_tokens
    restore_drafts(p)
    drafts, _ = sim.step([("a", 1, 0), ("b", 1, 0)])
    assert not drafts.eq(11).all()


def test_a_refused_step_gives_no_ring_row_away(env):
    """A step the plan refuses (a request with more verified drafts than rows) leaves the
    slot table as it was: the known request keeps its row, the new one holds none."""
    draft, vc = env
    width = draft.shape.hidden_size * len(draft.shape.target_layer_ids)
    gen = torch.Generator().manual_seed(4)
    p = make_proposer(draft, vc, max_num_seqs=2)
    _propose(p, [("known", 0, 5, 0, 6, torch.randn(5, width, generator=gen).bfloat16())],
             width, gen)
    [row] = p.slot_table.assign(["known"])
    bad = [("known", 5, 2, 0, 6, torch.randn(2, width, generator=gen).bfloat16()),
           ("new", 0, 1, 1, 9, torch.randn(1, width, generator=gen).bfloat16())]
    with pytest.raises(ValueError, match="request 1 has 1 rows"):
        _propose(p, bad, width, gen)
    assert set(p.live_request_ids) == {"known"} and p.slot_table.assign(["known"]) == [row]
