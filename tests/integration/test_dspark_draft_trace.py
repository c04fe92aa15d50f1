"""The draft block (backbone + Markov head) traces as one graph per padded batch size.

``torch.compile(fullgraph=True)`` fails on any graph break: a host read, a
data-dependent shape, Python control flow on tensor values, RNG state. Passing here is
what lets the block be captured as one CUDA graph per draft size on a GPU. The
``eager`` backend runs the traced graph with the same kernels, so its tokens must equal
the plain eager call's exactly (same shapes, same ops: no batching difference).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.tiny import build_draft, ensure_tiny_model, make_proposer


@pytest.fixture(scope="module")
def proposer():
    draft, vc = build_draft(ensure_tiny_model())
    return make_proposer(draft, vc, probabilistic=True, max_num_seqs=8), vc


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_draft_block_traces_fullgraph_for_two_sizes(proposer, sampled):
    from vllm.forward_context import set_forward_context

    p, vc = proposer
    torch._dynamo.reset()
    traced = torch.compile(p.draft_block, fullgraph=True, backend="eager", dynamic=False)
    gen = torch.Generator().manual_seed(0)
    for rows in (2, 4):
        assert rows in p.draft_sizes
        slots = torch.randperm(p.max_num_seqs, generator=gen)[:rows]
        anchors = torch.randint(0, p.model.shape.vocab_size, (rows,), generator=gen)
        anchor_pos = torch.randint(0, 300, (rows,), generator=gen)
        temperature = noise = None
        if sampled:
            temperature = torch.linspace(0.0, 1.2, rows)
            noise = p.draw_race_noise(torch.arange(rows) + 11, anchor_pos)
        with torch.inference_mode(), set_forward_context(None, vc):
            want = p.draft_block(slots, anchors, anchor_pos, temperature, noise)
            got = traced(slots, anchors, anchor_pos, temperature, noise)
        # tokens, head hidden, Markov embeddings, draft probs (probabilistic drafting)
        assert len(got) == len(want) == 4
        assert got[0].shape == (rows, p.num_speculative_tokens)
        for name, g, w in zip(("tokens", "head", "embeds", "probs"), got, want, strict=True):
            assert torch.equal(g, w), f"traced block's {name} differ at {rows} rows"
