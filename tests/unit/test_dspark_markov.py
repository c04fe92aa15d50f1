"""Tests for the DSpark Markov head loop (overlay/.../common/dspark/markov.py).

Loaded by path (pure torch, no vLLM import); every result is checked against a hand-written
per-request, per-slot loop in float64 written from the module's docstring contract.
"""

from __future__ import annotations

import torch

from tests.support.overlay import load_overlay_module

markov_block_sample = load_overlay_module(
    "vllm/models/deepseek_v4/common/dspark/markov.py"
).markov_block_sample


def _race_noise(shape, seed):
    """``Exp(1)`` draws ``[R, N, V]``: the exponential race's noise, drawn by the caller."""
    return torch.empty(shape).exponential_(generator=torch.Generator().manual_seed(seed))


def _markov_reference(base, anchor, w1, w2, temperature, race=None):
    """Hand-written loop over requests and slots, float64; ``race [R, N, V]`` for T > 0."""
    num_requests, n, vocab = base.shape
    tokens = torch.zeros(num_requests, n, dtype=torch.int64)
    probs = torch.zeros(num_requests, n, vocab, dtype=torch.float64)
    for r in range(num_requests):
        prev = int(anchor[r])
        for k in range(n):
            z = [
                float(base[r, k, v])
                + sum(float(w2[v, j]) * float(w1[prev, j]) for j in range(w1.shape[1]))
                for v in range(vocab)
            ]
            z = torch.tensor(z, dtype=torch.float64)
            t = float(temperature[r])
            if t > 0:
                q = torch.softmax(z / t, 0)
                x = int(torch.argmax(q.float() / race[r, k]))
            else:
                x = int(torch.argmax(z))
                q = torch.zeros(vocab, dtype=torch.float64)
                q[x] = 1.0
            tokens[r, k] = x
            probs[r, k] = q
            prev = x
    return tokens, probs


def test_markov_loop_matches_hand_written_reference():
    gen = torch.Generator().manual_seed(5)
    vocab, rank, num_requests, n = 7, 3, 4, 5
    w1 = torch.randn(vocab, rank, generator=gen)
    w2 = torch.randn(vocab, rank, generator=gen) * 2
    base = torch.randn(num_requests, n, vocab, generator=gen)
    anchor = torch.tensor([0, 6, 3, 3])
    temperature = torch.tensor([0.0, 0.7, 1.0, 0.0])
    race = _race_noise(base.shape, 9)
    seen_prev = []

    def embed(ids):
        seen_prev.append(ids.clone())
        return w1[ids]

    got = markov_block_sample(
        base,
        anchor,
        embed,
        lambda e: e @ w2.t(),
        temperature=temperature,
        race_noise=race,
        return_probs=True,
    )
    want_tokens, want_probs = _markov_reference(base, anchor, w1, w2, temperature, race)
    assert torch.equal(got.tokens, want_tokens)
    torch.testing.assert_close(got.probs.double(), want_probs, rtol=1e-5, atol=1e-6)
    # prev starts at the anchor, then follows the drafted tokens.
    assert torch.equal(seen_prev[0], anchor)
    for k in range(1, n):
        assert torch.equal(seen_prev[k], got.tokens[:, k - 1])
    torch.testing.assert_close(got.embeds, w1[torch.stack(seen_prev, 1)])


def test_markov_greedy_without_temperature():
    gen = torch.Generator().manual_seed(6)
    w1 = torch.randn(9, 2, generator=gen)
    w2 = torch.randn(9, 2, generator=gen)
    base = torch.randn(2, 3, 9, generator=gen)
    got = markov_block_sample(base, torch.tensor([1, 2]), lambda i: w1[i], lambda e: e @ w2.t())
    tokens, _ = _markov_reference(base, torch.tensor([1, 2]), w1, w2, torch.zeros(2))
    assert torch.equal(got.tokens, tokens)
    assert got.probs is None


def test_greedy_probs_are_one_hot_of_the_reference_tokens():
    """temperature=None with return_probs: q_k is the one-hot of x_k, x_k the reference argmax."""
    gen = torch.Generator().manual_seed(7)
    w1 = torch.randn(6, 2, generator=gen)
    w2 = torch.randn(6, 2, generator=gen)
    base = torch.randn(3, 4, 6, generator=gen)
    anchor = torch.tensor([5, 0, 2])
    got = markov_block_sample(
        base, anchor, lambda i: w1[i], lambda e: e @ w2.t(), return_probs=True
    )
    tokens, probs = _markov_reference(base, anchor, w1, w2, torch.zeros(3))
    assert torch.equal(got.tokens, tokens)
    assert got.probs.dtype == torch.float32
    assert torch.equal(got.probs.double(), probs)  # exact: 0.0 and 1.0 only


def test_anchor_and_temperature_of_other_dtypes_draw_the_same_block():
    """An int32 anchor and a float64 temperature act as int64 / float32 ones: same tokens, and
    the probabilities stay float32 with T rounded to float32 (not float64 arithmetic)."""
    gen = torch.Generator().manual_seed(8)
    w1 = torch.randn(7, 3, generator=gen)
    w2 = torch.randn(7, 3, generator=gen)
    base = torch.randn(3, 4, 7, generator=gen)
    anchor = torch.tensor([6, 0, 2])
    temperature = torch.tensor([0.7, 0.0, 1.3])
    race = _race_noise(base.shape, 3)

    def draw(a, t):
        return markov_block_sample(
            base, a, lambda i: w1[i], lambda e: e @ w2.t(), temperature=t,
            race_noise=race, return_probs=True,
        )

    want = draw(anchor, temperature)
    got = draw(anchor.int(), temperature.double())
    assert torch.equal(got.tokens, want.tokens)
    assert got.probs.dtype == torch.float32
    assert torch.equal(got.probs, want.probs)  # same inputs after the cast, same ops
    ref_tokens, _ = _markov_reference(base, anchor, w1, w2, temperature, race)
    assert torch.equal(got.tokens, ref_tokens)
