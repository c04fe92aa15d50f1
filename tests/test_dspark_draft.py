"""DSpark draft model alone (no engine): packed == alone, attention, Markov and heads.

Runs the overlay's draft (``vllm/models/deepseek_v4/common/dspark_draft.py``) with the
tiny checkpoint's ``mtp.*`` weights inside a 1-rank vLLM context on CPU.
"""

from __future__ import annotations

import pytest
import torch
from dspark_support import build_draft, ensure_tiny_model
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.models.deepseek_v4.common.dspark_draft import (  # noqa: E402
    DraftContext,
    fp8_nope_roundtrip,
)
from vllm.v1.spec_decode.dspark_ragged import window_mask  # noqa: E402


@pytest.fixture(scope="module")
def draft_env():
    from safetensors.torch import load_file

    model_dir = ensure_tiny_model()
    draft, vc = build_draft(model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    return draft, vc, tensors


def _rings(draft, num_slots, slots, anchors, gen):
    """Random rings per layer holding each request's last W positions before its anchor."""
    s = draft.shape
    caches = [
        torch.randn(num_slots, s.window, s.head_dim, generator=gen).to(torch.bfloat16)
        for _ in draft.layers
    ]
    pos = torch.full((num_slots, s.window), -1, dtype=torch.int64)
    for slot, anchor in zip(slots.tolist(), anchors.tolist(), strict=True):
        for p in range(max(0, anchor - s.window), anchor):
            pos[slot, p % s.window] = p
    return caches, pos


def test_packed_block_forward_equals_each_request_alone(draft_env):
    draft, vc, _ = draft_env
    s = draft.shape
    gen = torch.Generator().manual_seed(1)
    slots = torch.tensor([6, 0, 3, 1, 5])
    # Anchors: start of a sequence, mid-window, exactly one window, far past it.
    anchors = torch.tensor([0, 3, 128, 200, 77])
    caches, cache_pos = _rings(draft, 8, slots, anchors, gen)
    mask = window_mask(cache_pos, slots, anchors, s.window)
    n = s.block_size
    ids = torch.randint(0, s.vocab_size, (len(slots), n), generator=gen)
    pos = anchors[:, None] + torch.arange(n)
    with torch.inference_mode(), set_forward_context(None, vc):
        packed = draft(ids, pos, DraftContext(caches, slots, mask))
        packed_logits = draft.compute_logits(packed)
        for r in range(len(slots)):
            alone = draft(
                ids[r : r + 1],
                pos[r : r + 1],
                DraftContext(caches, slots[r : r + 1], mask[r : r + 1]),
            )
            torch.testing.assert_close(alone[0], packed[r], rtol=0, atol=0)
            torch.testing.assert_close(
                draft.compute_logits(alone)[0], packed_logits[r], rtol=0, atol=0
            )
    assert packed.shape == (len(slots), n, s.hidden_size)
    assert torch.isfinite(packed.float()).all()


def test_masked_cells_do_not_influence_the_block(draft_env):
    """Cells outside the window (stale, released, other request) are never read."""
    draft, vc, _ = draft_env
    s = draft.shape
    gen = torch.Generator().manual_seed(2)
    slots = torch.tensor([2, 4])
    anchors = torch.tensor([40, 300])
    caches, cache_pos = _rings(draft, 6, slots, anchors, gen)
    mask = window_mask(cache_pos, slots, anchors, s.window)
    ids = torch.randint(0, s.vocab_size, (2, s.block_size), generator=gen)
    pos = anchors[:, None] + torch.arange(s.block_size)
    garbage = [c.clone() for c in caches]
    for c in garbage:
        c[slots[0], ~mask[0]] = 1e4  # request 0 only fills 40 of its 128 cells
        c[[0, 1, 3, 5]] = -1e4  # rows no request in this batch owns
    with torch.inference_mode(), set_forward_context(None, vc):
        clean = draft(ids, pos, DraftContext(caches, slots, mask))
        dirty = draft(ids, pos, DraftContext(garbage, slots, mask))
    torch.testing.assert_close(clean, dirty, rtol=0, atol=0)


def _reference_attention(attn, x, positions, ctx_kv, ctx_mask, num_requests):
    """Loop-per-query reference: window cells + whole block, sink, grouped output."""
    s = attn.shape
    rows = x.shape[0]
    n = rows // num_requests
    q = attn.wq_b(attn.q_norm(attn.wq_a(x))).view(rows, s.num_heads, s.head_dim).float()
    q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + s.rms_eps)
    q = attn.rope(q.to(x.dtype), positions).float()
    kv = attn.context_kv(x, positions).float().view(num_requests, n, s.head_dim)
    out = torch.zeros(rows, s.num_heads, s.head_dim)
    for r in range(num_requests):
        keys = [ctx_kv[r, w].float() for w in range(ctx_kv.shape[1]) if ctx_mask[r, w]]
        keys += [kv[r, j] for j in range(n)]
        keys = torch.stack(keys)
        for i in range(n):
            for h in range(s.num_heads):
                logits = keys @ q[r * n + i, h] * s.head_dim**-0.5
                logits = torch.cat([logits, attn.attn_sink[h].float().view(1)])
                p = torch.softmax(logits, 0)[:-1]
                out[r * n + i, h] = p @ keys
    out = attn.rope(out.to(x.dtype), positions, inverse=True)
    hpg = s.num_heads // s.o_groups
    w = attn._wo_a_grouped.float()
    z = torch.stack(
        [
            out[:, g * hpg : (g + 1) * hpg].reshape(rows, -1).float() @ w[g].t()
            for g in range(s.o_groups)
        ],
        dim=1,
    )
    return attn.wo_b(z.reshape(rows, -1).to(x.dtype))


def test_block_attention_matches_loop_reference(draft_env):
    draft, vc, _ = draft_env
    s = draft.shape
    attn = draft.layers[0].attn
    gen = torch.Generator().manual_seed(3)
    num_requests, n = 2, s.block_size
    x = torch.randn(num_requests * n, s.hidden_size, generator=gen).to(torch.bfloat16)
    positions = torch.tensor([10, 11, 12, 13, 250, 251, 252, 253])[: num_requests * n]
    ctx = torch.randn(num_requests, s.window, s.head_dim, generator=gen).to(torch.bfloat16)
    ctx_mask = torch.rand(num_requests, s.window, generator=gen) < 0.5
    ctx_mask[0] = False
    ctx_mask[0, :10] = True  # request 0 has only 10 context positions
    with torch.inference_mode():
        got = attn(x, positions, ctx, ctx_mask, num_requests)
        want = _reference_attention(attn, x, positions, ctx, ctx_mask, num_requests)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_block_is_non_causal(draft_env):
    """Changing the last block token changes the first slot's output (it sees the block)."""
    draft, vc, _ = draft_env
    s = draft.shape
    slots = torch.tensor([0])
    anchors = torch.tensor([5])
    caches, cache_pos = _rings(draft, 1, slots, anchors, torch.Generator().manual_seed(4))
    mask = window_mask(cache_pos, slots, anchors, s.window)
    ids = torch.tensor([[17, 3, 3, 3]])[:, : s.block_size]
    pos = anchors[:, None] + torch.arange(ids.shape[1])
    other = ids.clone()
    other[0, -1] = 200
    with torch.inference_mode(), set_forward_context(None, vc):
        a = draft(ids, pos, DraftContext(caches, slots, mask))
        b = draft(other, pos, DraftContext(caches, slots, mask))
    assert not torch.equal(a[0, 0], b[0, 0])


def test_model_markov_and_confidence_heads_use_checkpoint_weights(draft_env):
    draft, vc, tensors = draft_env
    last = f"mtp.{len(draft.layers) - 1}"
    w1 = tensors[f"{last}.markov_head.markov_w1.weight"].float()
    w2 = tensors[f"{last}.markov_head.markov_w2.weight"].float()
    prev = torch.tensor([0, 5, 900, 3])
    with torch.inference_mode():
        e = draft.markov_embed(prev)
        bias = draft.markov_bias(e)
        torch.testing.assert_close(e.float(), w1[prev], rtol=0, atol=0)
        torch.testing.assert_close(bias.float(), w1[prev] @ w2.t(), rtol=2e-2, atol=2e-2)
        h = torch.randn(4, draft.shape.hidden_size).to(torch.bfloat16)
        conf = draft.compute_confidence(h, e)
    w = tensors[f"{last}.confidence_head.proj.weight"].float()
    want = torch.sigmoid(torch.cat([h.float(), w1[prev]], -1) @ w.t()).squeeze(-1)
    torch.testing.assert_close(conf, want, rtol=1e-4, atol=1e-4)


def test_fp8_nope_roundtrip_keeps_rope_dims_and_is_idempotent():
    gen = torch.Generator().manual_seed(7)
    kv = (torch.randn(6, 512, generator=gen) * 3).to(torch.bfloat16)
    once = fp8_nope_roundtrip(kv, 64)
    assert torch.equal(once[:, 448:], kv[:, 448:])
    assert torch.equal(fp8_nope_roundtrip(once, 64), once)
    rel = (once[:, :448].float() - kv[:, :448].float()).abs() / kv[:, :448].float().abs().clamp(
        min=0.5
    )
    assert rel.max() < 0.15


def test_unknown_draft_weight_is_refused(draft_env):
    draft, _, _ = draft_env
    with pytest.raises(ValueError, match="does not have"):
        draft.load_weights([("mtp.0.attn.not_a_weight", torch.zeros(1))])
    # Target weights and stages past the draft's depth are not the draft's: skipped.
    assert draft.load_weights([("layers.0.attn.wkv.weight", torch.zeros(1))]) == set()
