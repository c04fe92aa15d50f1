"""DSpark draft model alone (no engine): packed == alone, attention, Markov and heads.

Runs the overlay's draft (``vllm/models/deepseek_v4/common/dspark/model.py``) with the
tiny checkpoint's ``mtp.*`` weights inside a 1-rank vLLM context on CPU.
"""

from __future__ import annotations

import pytest
import torch
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.models.deepseek_v4.common.dspark.layers import (  # noqa: E402
    DraftRMSNorm,
    block_key_bias,
    fp8_nope_roundtrip,
    unit_rms_norm,
)
from vllm.models.deepseek_v4.common.dspark.model import DraftContext  # noqa: E402
from vllm.models.deepseek_v4.common.fp8_ds_mla import (  # noqa: E402
    QUANT_BLOCK,
    quantize_blocks,
    roundtrip_blocks,
)
from vllm.v1.spec_decode.dspark.context_store import window_mask  # noqa: E402

from tests.support.tiny import build_draft, ensure_tiny_model


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


# bf16 keeps 8 significant bits: one rounding step is 2^-8 of a value's magnitude. The
# packed and alone passes run their GEMMs with different row counts, and CPU kernels (oneDNN,
# AMX/AVX-512 brgemm) block and accumulate differently per row count, so a value may round
# one step apart at each of the block's layers. Measured: at most one step of the largest
# |value| (0.03 on hidden states of magnitude ~10 on Sapphire Rapids, 0.0625 on an AVX-512
# Xeon without BF16); four steps leave a 2-4x margin. A mixed-up request is far outside it.
BF16_STEPS = 4


def _bf16_tolerance(expected: torch.Tensor) -> float:
    return BF16_STEPS * 2.0**-8 * float(expected.float().abs().max())


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


class _RouterReplay:
    """Router logits recorded in one pass, replayed (a row range of them) in another.

    MoE routing is a discrete choice: a bf16 rounding step from a GEMM run at another row
    count can swap two near-tied experts and move a row far past any tolerance, on some
    CPUs and not others. Replaying the packed pass's router logits for a request alone
    keeps the routing equal; everything the request's rows compute stays its own, so a
    row that leaked another request's context still differs (through the residual).
    """

    def __init__(self, draft) -> None:
        self.recorded: list[torch.Tensor] = []
        self.rows: slice | None = None
        self.calls = 0
        self.handles = [layer.ffn.gate.register_forward_hook(self._hook) for layer in draft.layers]

    def _hook(self, module, args, out):
        logits = out[0] if isinstance(out, tuple) else out
        if self.rows is None:
            self.recorded.append(logits)
            return None
        logits = self.recorded[self.calls % len(self.recorded)][self.rows]
        self.calls += 1
        return (logits, *out[1:]) if isinstance(out, tuple) else logits

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


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
    replay = _RouterReplay(draft)
    try:
        with torch.inference_mode(), set_forward_context(None, vc):
            packed = draft(ids, pos, DraftContext(caches, slots, mask))
            packed_logits = draft.compute_logits(packed)
            assert len(replay.recorded) == len(draft.layers)
            for r in range(len(slots)):
                replay.rows = slice(r * n, (r + 1) * n)
                alone = draft(
                    ids[r : r + 1],
                    pos[r : r + 1],
                    DraftContext(caches, slots[r : r + 1], mask[r : r + 1]),
                )
                alone_logits = draft.compute_logits(alone)
                assert alone.shape == (1, n, s.hidden_size)
                for got, want, what in (
                    (alone[0], packed, "hidden"),
                    (alone_logits[0], packed_logits, "logits"),
                ):
                    tol = _bf16_tolerance(want[r])
                    assert _max_diff(got, want[r]) <= tol, (r, what, _max_diff(got, want[r]), tol)
                    # Any other request's row is far outside the tolerance: the check can fail.
                    other = (r + 1) % len(slots)
                    assert _max_diff(got, want[other]) > 4 * tol, (r, other, what)
    finally:
        replay.close()


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
    # Same batch, same shapes, only masked-out cells differ: masked cells must not matter at all.
    assert torch.equal(clean, dirty)


def _reference_attention(attn, rotary, x, positions, ctx_kv, ctx_mask, num_requests):
    """Loop-per-query reference: window cells + whole block, sink, grouped output.

    RoPE is upstream's ``forward_native`` (``rotary``), not the draft's tables.
    """
    s = attn.shape
    rows = x.shape[0]
    n = rows // num_requests

    def rope(t, inverse=False):
        return rotary.forward_native(positions, t, None, inverse=inverse)[0]

    q_a, kv = attn.fused_wqa_wkv(x).split([s.q_lora_rank, s.head_dim], dim=-1)
    q = attn.wq_b(attn.q_norm(q_a)).view(rows, s.num_heads, s.head_dim).float()
    q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + s.rms_eps)
    q = rope(q.to(x.dtype)).float()
    kv = rope(attn.kv_norm(kv)[:, None])[:, 0]
    kv = fp8_nope_roundtrip(kv, s.rope_dim).float().view(num_requests, n, s.head_dim)
    out = torch.zeros(rows, s.num_heads, s.head_dim)
    for r in range(num_requests):
        keys = [ctx_kv[r, w].float() for w in range(ctx_kv.shape[1]) if ctx_mask[r, w]]
        keys += [kv[r, j] for j in range(n)]
        keys = torch.stack(keys)
        for i in range(n):
            for h in range(s.num_heads):
                logits = keys @ q[r * n + i, h] * s.head_dim**-0.5
                logits = torch.cat([logits, attn.attn_sink.view(-1)[h].float().view(1)])
                p = torch.softmax(logits, 0)[:-1]
                out[r * n + i, h] = p @ keys
    out = rope(out.to(x.dtype), inverse=True)
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
    key_bias = block_key_bias(ctx_mask, s.block_size)
    with torch.inference_mode():
        got = attn(x, draft.rope.at(positions.view(num_requests, n)), ctx, key_bias)
        want = _reference_attention(
            attn, draft.rotary_emb, x, positions, ctx, ctx_mask, num_requests
        )
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
        assert torch.equal(e.float(), w1[prev])  # a lookup, no arithmetic
        torch.testing.assert_close(bias.float(), w1[prev] @ w2.t(), rtol=2e-2, atol=2e-2)
        h = torch.randn(4, draft.shape.hidden_size).to(torch.bfloat16)
        conf = draft.compute_confidence(h, e)
    w = tensors[f"{last}.confidence_head.proj.weight"].float()
    want = torch.sigmoid(torch.cat([h.float(), w1[prev]], -1) @ w.t()).squeeze(-1)
    torch.testing.assert_close(conf, want, rtol=1e-4, atol=1e-4)


def test_rope_tables_equal_upstream_rope_bitwise(draft_env):
    """One table build per pass == upstream's per-call ``forward_native``, both ways.

    Same fp32 products and sums in the same order, so equal bit for bit; the non-RoPE
    dims pass through untouched.
    """
    draft, _, _ = draft_env
    s = draft.shape
    gen = torch.Generator().manual_seed(11)
    positions = torch.tensor([0, 1, 7, 130, 255, draft.rope.num_positions - 1])
    x = (torch.randn(len(positions), 3, s.head_dim, generator=gen) * 4).to(torch.bfloat16)
    tables = draft.rope.at(positions)
    for inverse in (False, True):
        want, _ = draft.rotary_emb.forward_native(positions, x, None, inverse=inverse)
        got = tables.rotate(x, inverse=inverse)
        assert got.dtype == x.dtype
        assert torch.equal(got, want), inverse
    assert torch.equal(tables.rotate(x)[..., : s.head_dim - s.rope_dim], x[..., :-s.rope_dim])
    # The check can fail: another position's tables rotate differently.
    assert not torch.equal(draft.rope.at(positions.flip(0)).rotate(x), tables.rotate(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_draft_rms_norm_equals_vllms_eager_rms_norm(draft_env, dtype):
    """The draft's one-op eager RMSNorm == vLLM's own eager ``rms_norm`` (its IR native op).

    Both take fp32 statistics. torch's op applies the weight in fp32 and rounds once,
    vLLM's eager path rounds the normalised x to x's dtype, then multiplies by the weight
    and rounds again, and a CPU's fused reduction may sum in another order: up to one unit
    in the last place of x's dtype is allowed (bf16: 2^-7 relative at the bottom of a
    binade; fp32: 1e-6), far below the ~1e-1 of a wrong weight or epsilon.
    """
    from vllm.config import set_current_vllm_config
    from vllm.ir.ops.layernorm import rms_norm

    gen = torch.Generator().manual_seed(21)
    x = (torch.randn(5, 3, 256, generator=gen) * 3).to(dtype)
    with set_current_vllm_config(draft_env[1]):
        norm = DraftRMSNorm(256, eps=1e-6, dtype=dtype)
    norm.weight.data.copy_(torch.rand(256, generator=gen) + 0.5)
    tol = {"rtol": 2**-7, "atol": 1e-6} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-6}
    want = rms_norm.impls["native"].impl_fn(x, norm.weight.data, 1e-6)
    got = norm.forward_native(x)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **tol)
    unit = rms_norm.impls["native"].impl_fn(x, None, 1e-6)
    torch.testing.assert_close(unit_rms_norm(x, 1e-6), unit, **tol)
    # The check can fail: another epsilon moves small rows well past the tolerance.
    small = x * 1e-3
    moved = unit_rms_norm(small, 1e-3).float() - rms_norm.impls["native"].impl_fn(small, None, 1e-6)
    assert moved.abs().max() > 0.1


def test_roundtrip_blocks_equal_quantize_then_dequantize():
    """The one-pass round trip == the cache's quantise + ``q * 2^exponent``, bitwise."""
    gen = torch.Generator().manual_seed(12)
    blocks = torch.randn(5, 7, QUANT_BLOCK, generator=gen) * torch.logspace(-6, 3, 7)[:, None]
    blocks[0, 0] = 0.0  # scale floored at 1e-4
    q, exponent = quantize_blocks(blocks)
    assert torch.equal(roundtrip_blocks(blocks), q.float() * torch.exp2(exponent))


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


OVERLAY_DSPARK_MODULES = (
    "overlay/vllm/v1/spec_decode/dspark/proposer.py",
    "overlay/vllm/v1/spec_decode/dspark/context_store.py",
    "overlay/vllm/models/deepseek_v4/common/dspark/model.py",
    "overlay/vllm/models/deepseek_v4/common/dspark/markov.py",
    "overlay/vllm/v1/spec_decode/dspark/packed_prefill.py",
)


def test_overlay_dspark_path_never_imports_upstream_nvidia_draft():
    from tests.support.tiny import REPO

    for rel in OVERLAY_DSPARK_MODULES:
        text = (REPO / rel).read_text()
        assert "nvidia.dspark" not in text and "nvidia import dspark" not in text, rel


def test_proposer_builds_the_overlay_draft_when_the_platform_is_cuda(draft_env, monkeypatch):
    """On CUDA the registry's DSparkDraftModel is upstream's V2-only NVIDIA class; the V1
    proposer must build the overlay's class anyway. The platform reports CUDA while the loader
    picks the class; the weights then load for real on this CPU."""
    import sys
    from types import SimpleNamespace

    import vllm.model_executor.model_loader.utils as loader_utils
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v4.common.dspark.model import DSparkDeepseekV4Draft
    from vllm.platforms import current_platform

    from tests.support.tiny import make_proposer

    draft, vc, _ = draft_env
    proposer = make_proposer(draft, vc)
    real_initialize = loader_utils.initialize_model
    chosen = []

    reports_cuda = [True]

    def initialize_on_cuda(*args, model_class=None, **kwargs):
        chosen.append((current_platform.is_cuda(), current_platform.is_cpu(), model_class))
        reports_cuda[0] = False  # build and load on this machine's real platform
        return real_initialize(*args, model_class=model_class, **kwargs)

    monkeypatch.setattr(current_platform, "is_cuda", lambda: reports_cuda[0])
    monkeypatch.setattr(current_platform, "is_cpu", lambda: not reports_cuda[0])
    monkeypatch.setattr(loader_utils, "initialize_model", initialize_on_cuda)
    monkeypatch.delitem(sys.modules, "vllm.models.deepseek_v4.nvidia.dspark", raising=False)
    # vLLM's CPU runner turns the accelerator calls the loader makes into no-ops; so here.
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    # A second draft in the same config: its layer names must not clash with the first's.
    monkeypatch.setattr(vc.compilation_config, "static_forward_context", {})
    vc.speculative_config = SimpleNamespace(draft_model_config=vc.model_config)
    target = SimpleNamespace(model=SimpleNamespace(embed_tokens=draft.embed_tokens),
                             lm_head=draft.lm_head)
    try:
        with set_current_vllm_config(vc):  # as the runner's load_model does
            proposer.load_model(target)
    finally:
        vc.speculative_config = None
    assert chosen == [(True, False, DSparkDeepseekV4Draft)]
    assert type(proposer.model) is DSparkDeepseekV4Draft and proposer.model is not draft
    assert "vllm.models.deepseek_v4.nvidia.dspark" not in sys.modules
    # It is a working draft: the checkpoint's weights (same inputs, same shapes, same kernels
    # as the fixture's draft, so equal bitwise), the target's heads.
    built, s = proposer.model, draft.shape
    gen = torch.Generator().manual_seed(5)
    aux = torch.randn(7, s.hidden_size * len(s.target_layer_ids), generator=gen)
    positions = torch.arange(7) * 11
    ids = torch.randint(0, s.vocab_size, (7,), generator=gen)
    with torch.inference_mode(), set_forward_context(None, vc):
        for model in (built, draft):
            main_x = model.combine_hidden_states(aux.to(torch.bfloat16))
            model.outputs = (main_x, model.context_kv(main_x, positions), model.markov_embed(ids))
    for got, want in zip(built.outputs, draft.outputs, strict=True):
        assert torch.equal(got, want)
    assert built.lm_head is draft.lm_head


def test_stacked_projections_hold_each_layers_checkpoint_weights(draft_env):
    """``fused_wqa_wkv`` is its layer's [wq_a; wkv], ``context_wkv_proj`` every layer's wkv
    in layer order: checked against the checkpoint's tensors, so a shard mix-up shows."""
    draft, _, tensors = draft_env
    s = draft.shape
    x = (torch.randn(5, s.hidden_size, generator=torch.Generator().manual_seed(8))).to(
        torch.bfloat16
    )

    def close(got, want):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))

    with torch.inference_mode():
        context = draft.context_wkv_proj(x).float().view(5, len(draft.layers), s.head_dim)
        for j, layer in enumerate(draft.layers):
            wq_a = tensors[f"mtp.{j}.attn.wq_a.weight"].float()
            wkv = tensors[f"mtp.{j}.attn.wkv.weight"].float()
            q_a, kv = layer.attn.fused_wqa_wkv(x).float().split([s.q_lora_rank, s.head_dim], -1)
            close(q_a, x.float() @ wq_a.t())
            close(kv, x.float() @ wkv.t())
            close(context[:, j], x.float() @ wkv.t())
    # The layers' wkv differ well beyond the tolerance: the check can fail.
    w0, w1 = (tensors[f"mtp.{j}.attn.wkv.weight"].float() for j in (0, 1))
    kv0, kv1 = x.float() @ w0.t(), x.float() @ w1.t()
    assert (kv0 - kv1).abs().max() > 10 * 2e-2 * float(kv0.abs().max())
