"""Where the overlay's DSpark follows upstream's V2 DSpark (vLLM 0.32.0) semantics.

Block length N = num_speculative_tokens, the noise token's resolution order, draft positions
clamped at max_model_len - 1, probabilistic drafting keyed per request and position (a
seeded request reproduces in any batch), and block-FP8 shared-expert padding at TP=2.
Oracles: upstream's rules restated independently in each test, per-request references,
exact counting; no expected value is produced by the code under test.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.forward_context import set_forward_context
from vllm.models.deepseek_v4.common.dspark.markov import markov_block_sample
from vllm.models.deepseek_v4.common.dspark.model import (
    DraftContext,
    draft_block_positions,
    draft_noise_token_id,
    pad_to_tp_shards,
)
from vllm.models.deepseek_v4.common.dspark.noise import RequestSeeds, keyed_race_noise
from vllm.v1.spec_decode.dspark.context_store import window_mask
from vllm.v1.spec_decode.dspark.step_plan import DSparkStepInput

from tests.support.tiny import build_draft, ensure_tiny_model, make_proposer


@pytest.fixture(scope="module")
def env():
    return build_draft(ensure_tiny_model())


# ---------------------------------------------------------------- noise token, positions


def test_noise_token_follows_upstreams_order():
    both = SimpleNamespace(vocab_size=100, mask_token_id=7, dspark_noise_token_id=3)
    assert draft_noise_token_id(both) == 7  # mask_token_id wins over dspark_noise_token_id
    nested = SimpleNamespace(
        vocab_size=100, dflash_config={"mask_token_id": 9}, mask_token_id=7, dspark_noise_token_id=3
    )
    assert draft_noise_token_id(nested) == 9
    only_dspark = SimpleNamespace(vocab_size=100, mask_token_id=None, dspark_noise_token_id=3)
    assert draft_noise_token_id(only_dspark) == 3


@pytest.mark.parametrize(
    "cfg,message",
    [
        (SimpleNamespace(vocab_size=100), "needs a noise token"),
        (SimpleNamespace(vocab_size=100, mask_token_id=100), "mask_token_id must be a token id"),
        (SimpleNamespace(vocab_size=100, dspark_noise_token_id=-1), "dspark_noise_token_id must"),
        (SimpleNamespace(vocab_size=100, mask_token_id=True), "mask_token_id must be a token id"),
    ],
)
def test_bad_noise_token_is_refused_with_the_field(cfg, message):
    with pytest.raises(ValueError, match=message):
        draft_noise_token_id(cfg)


def test_block_positions_clamp_at_the_last_servable_position():
    anchors = torch.tensor([0, 10, 508, 511])
    pos = draft_block_positions(anchors, 4, 512, torch.arange(4))
    for r, p in enumerate(anchors.tolist()):
        assert pos[r].tolist() == [min(p + j, 511) for j in range(4)]


# ---------------------------------------------------------------------- block length N = k


def test_block_length_is_num_speculative_tokens(env):
    """k=2 on a block-size-4 checkpoint drafts a 2-slot block (a cheaper pass), and its drafts
    are the greedy Markov walk over that 2-slot block, computed here directly."""
    draft, vc = env
    s = draft.shape
    assert s.block_size == 4
    k = 2
    p = make_proposer(draft, vc, num_spec=k)
    blocks = []
    hook = draft.register_forward_pre_hook(lambda mod, args: blocks.append(args[0].clone()))
    gen = torch.Generator().manual_seed(3)
    width = s.hidden_size * len(s.target_layer_ids)
    lengths = [5, 9]
    try:
        drafts = p.propose(DSparkStepInput(
            req_ids=["a", "b"],
            query_start_loc_cpu=np.array([0, 5, 14]),
            num_draft_tokens=np.zeros(2, np.int64),
            prefilling=np.zeros(2, bool),
            positions=torch.cat([torch.arange(n) for n in lengths]),
            aux_hidden_states=torch.randn(14, width, generator=gen).to(torch.bfloat16),
            num_rejected=torch.zeros(2, dtype=torch.int64),
            next_token_ids=torch.tensor([21, 22]),
        ))
    finally:
        hook.remove()
    assert [tuple(b.shape) for b in blocks] == [(2, k)]
    assert blocks[0][:, 0].tolist() == [21, 22]
    assert (blocks[0][:, 1:] == p.noise_token_id).all()
    assert drafts.shape == (2, k)
    # Reference: the same block through the draft, then argmax left to right.
    slots = torch.tensor(p.slot_table.assign(["a", "b"]))
    anchor_pos = torch.tensor(lengths)
    ids = torch.tensor([[21, p.noise_token_id], [22, p.noise_token_id]])
    with torch.inference_mode(), set_forward_context(None, vc):
        mask = window_mask(p.kv_pos, slots, anchor_pos, p.window)
        head = draft(ids, anchor_pos[:, None] + torch.arange(k), DraftContext(
            p.layer_caches(), slots, mask))
        base = draft.compute_logits(head).float()
        prev, want = torch.tensor([21, 22]), []
        for j in range(k):
            prev = (base[:, j] + draft.markov_bias(draft.markov_embed(prev)).float()).argmax(-1)
            want.append(prev)
    assert torch.equal(drafts.long(), torch.stack(want, dim=1))


# ------------------------------------------------------------------ seeded, keyed drafting


def _toy_markov(vocab: int, rank: int = 3):
    """fp32 Markov head as pure table lookups (row-independent, batch-shape independent)."""
    g = torch.Generator().manual_seed(11)
    w1 = torch.randn(vocab, rank, generator=g)
    w2 = torch.randn(rank, vocab, generator=g)
    return (lambda ids: w1[ids]), (lambda e: e @ w2)


def test_seeded_request_drafts_the_same_tokens_in_any_batch():
    vocab, n = 50, 4
    embed, bias = _toy_markov(vocab)
    g = torch.Generator().manual_seed(2)
    base = torch.randn(5, n, vocab, generator=g)
    anchors = torch.randint(0, vocab, (5,), generator=g)
    anchor_pos = torch.tensor([3, 40, 7, 7, 100])
    temp = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.9])
    seeds = torch.tensor([123, 9, 8, 7, 6])

    def run(rows):
        rows = torch.tensor(rows)
        return markov_block_sample(
            base[rows], anchors[rows], embed, bias, temperature=temp[rows],
            race_noise=keyed_race_noise(seeds[rows], anchor_pos[rows], n, vocab),
        ).tokens

    full = run([0, 1, 2, 3, 4])
    assert torch.equal(run([0])[0], full[0])
    assert torch.equal(run([3, 1, 0])[2], full[0])
    # A different seed on the same request draws a different block (with these inputs).
    seeds_other = seeds.clone()
    seeds_other[0] = 124
    other = markov_block_sample(
        base[:1], anchors[:1], embed, bias, temperature=temp[:1],
        race_noise=keyed_race_noise(seeds_other[:1], anchor_pos[:1], n, vocab),
    ).tokens
    assert not torch.equal(other[0], full[0])


def test_keyed_race_draws_from_the_markov_distribution():
    """Over 4000 seeds, slot 0's token frequencies match q_0 = softmax(z_0 / T)."""
    vocab, draws = 6, 4000
    embed, bias = _toy_markov(vocab)
    base = torch.tensor([[[0.5, -1.0, 2.0, 0.0, 1.0, -0.5]]]).expand(draws, 1, vocab)
    anchors = torch.full((draws,), 2)
    temp = torch.full((draws,), 0.8)
    seeds = torch.arange(draws) * 7919 + 1
    out = markov_block_sample(
        base, anchors, embed, bias, temperature=temp, return_probs=True,
        race_noise=keyed_race_noise(seeds, torch.full((draws,), 50), 1, vocab),
    )
    q = out.probs[0, 0].double()
    freq = torch.bincount(out.tokens[:, 0], minlength=vocab).double() / draws
    # Binomial standard error per token; 5 sigma keeps this deterministic test meaningful.
    sigma = (q * (1 - q) / draws).sqrt()
    assert ((freq - q).abs() <= 5 * sigma + 1e-9).all(), (freq, q)


def test_request_seeds_keep_explicit_seeds_and_draw_once_for_the_rest():
    seeds = RequestSeeds(base_seed=0)
    first = seeds.lookup(["a", "b", "c"], [None, 42, None])
    assert first[1] == 42 and first[0] != first[2]
    again = seeds.lookup(["c", "a"], [None, None])
    assert again.tolist() == [first[2].item(), first[0].item()]  # follows the request id
    seeds.release(["a"])
    assert seeds.lookup(["a"], [None])[0] != first[0]  # a new request under an old id
    with pytest.raises(ValueError, match="one entry per request"):
        seeds.lookup(["a", "b"], [None])


def test_proposer_seeded_request_reproduces_beside_other_requests(env):
    """Same request, seed=123, once beside 'x' and once beside 'y' (same shapes, other
    content and seeds, other batch row): the same probabilistic drafts."""
    draft, vc = env
    s = draft.shape
    width = s.hidden_size * len(s.target_layer_ids)
    own = torch.randn(6, width, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    results = []
    for other, other_seed, order in (("x", 5, (0, 1)), ("y", None, (1, 0))):
        noise = torch.randn(6, width, generator=torch.Generator().manual_seed(len(results) + 9))
        p = make_proposer(draft, vc, probabilistic=True)
        segs = {"s": own, other: noise.to(torch.bfloat16)}
        seeds = {"s": 123, other: other_seed}
        ids = [["s", other][i] for i in order]
        drafts = p.propose(DSparkStepInput(
            req_ids=ids,
            query_start_loc_cpu=np.array([0, 6, 12]),
            num_draft_tokens=np.zeros(2, np.int64),
            prefilling=np.zeros(2, bool),
            positions=torch.cat([torch.arange(6), torch.arange(6)]),
            aux_hidden_states=torch.cat([segs[r] for r in ids]),
            num_rejected=torch.zeros(2, dtype=torch.int64),
            next_token_ids=torch.tensor([17 if r == "s" else 18 for r in ids]),
            temperature=torch.ones(2),
            temperature_cpu=np.ones(2),
            request_seeds=[seeds[r] for r in ids],
        ))
        results.append(drafts[ids.index("s")])
    assert torch.equal(results[0], results[1])


# --------------------------------------------------------------- shared-expert TP padding


def test_pad_to_tp_shards_matches_upstreams_block_rounding():
    """3 blocks of 128 at TP=2: each rank holds cdiv(3, 2) = 2 blocks; rank 1 gets block 2
    and a zero block (upstream DeepseekV4MLP + _pad_shared_expert_weight)."""
    block, blocks, tp, hidden = 128, 3, 2, 8
    weight = torch.randn(blocks * block, hidden)
    local_blocks = -(-blocks // tp)
    padded = pad_to_tp_shards(weight, 0, local_blocks * block, tp)
    assert padded.shape == (local_blocks * block * tp, hidden)
    rank0, rank1 = padded.split(local_blocks * block)
    assert torch.equal(rank0, weight[: 2 * block])
    assert torch.equal(rank1[:block], weight[2 * block :]) and not rank1[block:].any()
    scale = torch.rand(hidden // 4, blocks)  # down_proj scale: intermediate blocks on dim 1
    padded_scale = pad_to_tp_shards(scale, 1, local_blocks, tp)
    assert padded_scale.shape == (hidden // 4, local_blocks * tp)
    assert torch.equal(padded_scale[:, :blocks], scale) and not padded_scale[:, blocks:].any()
    assert pad_to_tp_shards(weight, 0, blocks * block, 1) is weight  # nothing to pad
    with pytest.raises(ValueError, match="more than the 2 TP shards of 64"):
        pad_to_tp_shards(weight, 0, 64, 2)


def test_loader_pads_shared_experts_to_the_parameters_tp_shards(env, monkeypatch):
    """The loader reads each shared-expert parameter's local size and its layer's TP size."""
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v4.common.dspark.model import DSparkDeepseekV4Draft
    from vllm.utils.torch_utils import set_default_torch_dtype

    _, vc = env
    # A fresh, unloaded draft (the fixture's weights were repacked for the CPU GEMM).
    monkeypatch.setattr(vc.compilation_config, "static_forward_context", {})
    with set_current_vllm_config(vc), set_default_torch_dtype(torch.bfloat16):
        draft = DSparkDeepseekV4Draft(vllm_config=vc)
    mlp = draft.layers[0].ffn.shared_experts
    local_i = mlp.gate_up_proj.weight.shape[0] // 2
    hidden = mlp.gate_up_proj.weight.shape[1]
    monkeypatch.setattr(mlp.gate_up_proj, "tp_size", 2, raising=False)
    monkeypatch.setattr(mlp.down_proj, "tp_size", 2, raising=False)
    w1 = torch.randn(local_i, hidden)
    got = draft._pad_shared_expert("layers.0.ffn.shared_experts.w1.weight", w1)
    assert got.shape == (2 * local_i, hidden) and torch.equal(got[:local_i], w1)
    w2 = torch.randn(hidden, local_i)
    got = draft._pad_shared_expert("layers.0.ffn.shared_experts.down_proj.weight", w2)
    assert got.shape == (hidden, 2 * local_i) and not got[:, local_i:].any()
