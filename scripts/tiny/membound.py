#!/usr/bin/env python3
"""The memory-bound CPU twin: a generated DeepSeek-V4-DSpark checkpoint sized for benchmarks.

The tiny checkpoint (``make model``) fits in the last-level cache, so its steps measure
framework overhead, not weights. This one is GB-scale (about 2.7 GB of bf16 weights; a
plain decode step reads about 160 MB of them, five times a 32 MiB L3) and keeps the
published DeepSeek-V4-Flash-DSpark ratios that decide whether speculation pays:

- bytes per layer of attention : active routed experts : shared expert, as the published
  checkpoint stores them (FP8 attention and shared expert, MXFP4 routed experts) about
  118 : 80 : 25; here all bf16, so the expert and shared sizes are chosen to give the same
  byte ratios (``byte_table`` prints both);
- experts per token over experts per layer: 6 of 256, as published;
- draft stages over target layers: 1 over 14 (0.071; published 3 over 43, 0.070);
- block size 5 (``num_speculative_tokens`` 5).

The target is random except for the designed successor structure of ``shape_true`` (the LM
head row of a token's successor along that token's embedding; the draft's Markov head
encodes the same permutation): three quarters of the tokens have a likely successor, the
random attention and MoE decide the rest. ``--head-logit`` sets how peaked the target's
next-token distributions are; the default aims at a mean top-1 probability of about 0.7,
like a trained language model's, so acceptance under sampling (the checkpoint is served at
temperature 0.8, its ``generation_config.json``) is neither zero nor trivial. The draft is
then trained against the target (``train_tiny_draft``), which also records the target's
measured mean top-1 probability.

Nothing is downloaded; the weights are a pure function of the options. A second run finds
the checkpoint and the training record and does nothing.

    python -m scripts.tiny.membound --out models/membound-dsv4-dspark
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from scripts.tiny import make_tiny_model as tiny
from scripts.tiny import shape_true

RECORD = "membound.json"
DEFAULT_OUT = Path("models/membound-dsv4-dspark")
TEMPERATURE = 0.8  # what the checkpoint is served at (generation_config.json)
HEAD_LOGIT = 14.0
# The random layers' output projections (attention's wo_b, every expert's w2) scaled by this:
# at 1, 14 random layers drown the embedding in the residual stream and the designed head
# has nothing to read (measured: mean top-1 probability 0.012 at HEAD_LOGIT 12).
OUTPUT_SCALE = 0.15
OUTPUTS = (".attn.wo_b.weight", ".w2.weight")
# The twin's geometry (make_tiny_model options). Layer pattern as published: a pure-SWA first
# layer, then C4A / C128A alternating.
GEOMETRY = {
    "layers": 14,
    "mtp_layers": 1,
    "hidden_size": 768,
    "num_heads": 4,
    "o_groups": 2,
    "q_lora_rank": 192,
    "o_lora_rank": 192,
    "experts": 256,
    "topk": 6,
    "moe_intermediate_size": 144,
    "shared_experts": 2,
    "vocab_size": 3584,  # what the local BPE tokenizer reaches on its corpus (3667 at most)
    "block_size": 5,
    "markov_rank": 64,
    "num_hash_layers": 1,
}
# The draft's training on the twin (train_tiny_draft options): fewer, shorter traces than the
# tiny one's, each trace step a GB-scale forward.
TRAINING = ["--sequences", "48", "--held-out", "16", "--gen-len", "96", "--steps", "200",
            "--blocks", "64", "--step-sequences", "6", "--threads", "2", "--ce-weight", "0.5",
            "--l1-weight", "0.5"]
PUBLISHED_CONFIG = Path(__file__).resolve().parents[2] / "tests/fixtures/dsv4_flash_dspark_config.json"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--head-logit", type=float, default=HEAD_LOGIT,
                   help="successor logit per unit cosine: how peaked the target is")
    p.add_argument("--output-scale", type=float, default=OUTPUT_SCALE,
                   help="scale of the layers' output projections (how much the random "
                   "layers move the residual stream)")
    p.add_argument("--temperature", type=float, default=TEMPERATURE,
                   help="the temperature generation_config.json serves")
    p.add_argument("--layers", type=int, default=GEOMETRY["layers"],
                   help="target layers (a smaller twin for a quick check)")
    p.add_argument("--experts", type=int, default=GEOMETRY["experts"], choices=tiny.CPU_EXPERT_COUNTS)
    p.add_argument("--no-train", action="store_true", help="generate only; no draft training")
    p.add_argument("--force", action="store_true", help="generate again")
    return p.parse_args(argv)


def tiny_args(args) -> argparse.Namespace:
    """``make_tiny_model``'s options for the twin (validated there)."""
    g = {**GEOMETRY, "layers": args.layers, "experts": args.experts}
    ratios = [0] + [(4, 128)[i % 2] for i in range(g["layers"] - 1)]
    ns = argparse.Namespace(
        seed=args.seed, compress_ratios=",".join(map(str, ratios)),
        max_position_embeddings=4096, dspark=True, target_layer_ids=None,
        no_confidence_head=False, format="bf16", bf16_twin=None, **g,
    )
    ns.num_heads = g["num_heads"]
    tiny._validate(ns)
    return ns


# --- bytes per layer, by part -----------------------------------------------------------


def _attention_params(cfg: dict, ratio: int) -> int:
    H, heads, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    ql, ol, og = cfg["q_lora_rank"], cfg["o_lora_rank"], cfg["o_groups"]
    n = H * ql + heads * hd * ql + hd * H + og * ol * (heads * hd // og) + H * og * ol
    if ratio > 1:
        coff = 2 if ratio == 4 else 1
        n += 2 * coff * hd * H  # compressor wkv + wgate
    if ratio == 4:
        ih, ihd = cfg["index_n_heads"], cfg["index_head_dim"]
        n += ih * ihd * ql + ih * H + 2 * 2 * ihd * H  # indexer wq_b, weights_proj, compressor
    return n


def byte_table(cfg: dict, attention_bytes: float, expert_bytes: float) -> dict:
    """Mean bytes per target layer that one decode token reads: attention (every projection,
    compressor and indexer), the active routed experts, the shared expert; and the LM head.
    ``attention_bytes`` / ``expert_bytes``: bytes per weight (published: FP8 1 + a UE8M0
    scale per 128x128 block; MXFP4 0.5 + one scale byte per 32)."""
    L = cfg["num_hidden_layers"]
    ratios = cfg["compress_ratios"][:L]
    H, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    expert = 3 * H * inter
    attention = sum(_attention_params(cfg, r) for r in ratios) / L * attention_bytes
    routed = cfg["num_experts_per_tok"] * expert * expert_bytes
    shared = cfg["n_shared_experts"] * expert * attention_bytes
    head = cfg["vocab_size"] * H * 2  # bf16 in both
    per_layer = attention + routed + shared
    return {
        "attention_MB": attention / 1e6, "routed_active_MB": routed / 1e6,
        "shared_MB": shared / 1e6,
        "ratio_attention_routed_shared": [1.0, routed / attention, shared / attention],
        "experts_per_token_over_experts": cfg["num_experts_per_tok"] / cfg["n_routed_experts"],
        "routed_total_MB_per_layer": cfg["n_routed_experts"] * expert * expert_bytes / 1e6,
        "decode_step_MB": (L * per_layer + head) / 1e6, "head_share": head / (L * per_layer + head),
        "draft_stages_over_layers": cfg.get("n_mtp_layers", 3) / L,
    }


def published_table() -> dict:
    cfg = json.loads(PUBLISHED_CONFIG.read_text())
    cfg["n_mtp_layers"] = tiny.REAL_STAGES
    return byte_table(cfg, 1 + 1 / 128**2, 0.5 + 1 / 32)


def print_ratios(cfg: dict) -> dict:
    twin, pub = byte_table(cfg, 2, 2), published_table()
    print(f"{'per target layer, one token':<34}{'published':>12}{'twin':>12}")
    rows = [("attention MB", "attention_MB"), ("active routed experts MB", "routed_active_MB"),
            ("shared expert MB", "shared_MB")]
    for label, key in rows:
        print(f"  {label:<32}{pub[key]:>12.2f}{twin[key]:>12.2f}")
    fmt = lambda t: ":".join(f"{x:.2f}" for x in t["ratio_attention_routed_shared"])  # noqa: E731
    print(f"  {'attention : routed : shared':<32}{fmt(pub):>13}{fmt(twin):>13}")
    for label, key in (("experts per token / per layer", "experts_per_token_over_experts"),
                       ("draft stages / target layers", "draft_stages_over_layers"),
                       ("LM head share of a decode step", "head_share")):
        print(f"  {label:<32}{pub[key]:>12.3f}{twin[key]:>12.3f}")
    print(f"  {'weights read per decode step MB':<32}{pub['decode_step_MB']:>12.0f}"
          f"{twin['decode_step_MB']:>12.0f}")
    return {"published": pub, "twin": twin}


# --- generation -------------------------------------------------------------------------


def generate(args, out: Path) -> dict:
    import torch

    targs = tiny_args(args)
    cfg = tiny.build_config(targs, targs.vocab_size)
    ratios = print_ratios(cfg)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    t0 = time.monotonic()
    total = targs.layers + targs.mtp_layers
    done = [0]

    def progress(msg: str) -> None:
        # build_tensors logs one line per layer before drawing it
        if msg.lstrip().startswith(("layer", "draft stage")):
            elapsed = time.monotonic() - t0
            eta = "" if not done[0] else f", about {elapsed / done[0] * (total - done[0]):.0f}s left"
            print(f"  [{done[0] + 1}/{total}]{msg.strip()[msg.strip().find(' '):]}"
                  f" ({elapsed:.0f}s{eta})", flush=True)
            done[0] += 1

    with tiny.staged_folders([out]) as (tmp,):
        print(f"[1/3] tokenizer (vocab {targs.vocab_size})", flush=True)
        tiny.write_tokenizer(tmp, targs.vocab_size, args.seed, targs.max_position_embeddings)
        print(f"[2/3] weights: {targs.layers} target layers + {targs.mtp_layers} draft stage, "
              f"{targs.experts} experts of {targs.moe_intermediate_size}, hidden "
              f"{targs.hidden_size} (10-20 s per layer on 2 idle cores, minutes on busy ones)", flush=True)
        tensors = tiny.build_tensors(cfg, args.seed, progress, targs.mtp_layers)
        for name, t in tensors.items():
            if name.endswith(OUTPUTS):
                tensors[name] = (t.float() * args.output_scale).to(t.dtype)
        tensors.update(shape_true.designed_tensors(cfg, args.seed, args.head_logit,
                                                   targs.mtp_layers))
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        print(f"[3/3] writing {size / 1e9:.2f} GB ({time.monotonic() - t0:.0f}s so far)",
              flush=True)
        tiny._write_checkpoint(tmp, cfg, tensors, lambda *a: None, args.temperature)
        del tensors
        record = {"options": record_options(args), "bytes": size, "ratios": ratios}
        (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out} in {time.monotonic() - t0:.0f}s", flush=True)
    return record


def measure_top1(out: Path, prompts: int = 4, tokens: int = 32, seed: int = 0) -> dict:
    """The target's mean top-1 probability (temperature 1) along its own greedy continuations
    of random prompts, in real vLLM: the logprob vLLM reports for each greedy token."""
    import math
    import random
    import statistics

    for key, value in {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams

    cfg = json.loads((out / "config.json").read_text())
    llm = LLM(model=str(out), dtype="bfloat16", enforce_eager=True, max_model_len=512,
              max_num_seqs=prompts, seed=seed)
    rng = random.Random(seed)
    ids = [[rng.randrange(len(tiny.SPECIAL_TOKENS), cfg["vocab_size"] - 8) for _ in range(64)]
           for _ in range(prompts)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    top1 = [math.exp(next(iter(lp.values())).logprob)
            for o in outs for lp in o.outputs[0].logprobs]
    return {"mean_top1_probability": round(statistics.mean(top1), 4),
            "median_top1_probability": round(statistics.median(top1), 4),
            "share_above_0.5": round(sum(p > 0.5 for p in top1) / len(top1), 4),
            "tokens": len(top1), "distinct_tokens_per_sequence": round(statistics.mean(
                len(set(o.outputs[0].token_ids)) for o in outs), 1)}


def record_options(args) -> dict:
    return {"seed": args.seed, "head_logit": args.head_logit, "temperature": args.temperature,
            "output_scale": args.output_scale,
            "layers": args.layers, "experts": args.experts, "geometry": GEOMETRY}


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out / RECORD
    cached = path.is_file() and json.loads(path.read_text())["options"] == record_options(args)
    if cached and not args.force:
        print(f">> {out}: generated already ({path})")
        if tiny.write_generation_config(out, args.temperature):  # a tool rewrote it
            print(f">> {out}: served temperature set back to {args.temperature:g}")
    else:
        if out.exists() and any(out.iterdir()) and not args.force and not path.is_file():
            raise SystemExit(f"error: {out} is not empty and holds no twin; pass --force")
        generate(args, out)
    record = json.loads(path.read_text())
    if "target" not in record:
        print(">> measuring the target's top-1 probability (one engine, a few minutes)",
              flush=True)
        record["target"] = measure_top1(out)
        path.write_text(json.dumps(record, indent=2) + "\n")
    t = record["target"]
    print(f">> target: mean top-1 probability {t['mean_top1_probability']:.2f} "
          f"(median {t['median_top1_probability']:.2f}, above 0.5 for "
          f"{t['share_above_0.5']:.0%} of {t['tokens']} greedy tokens)", flush=True)
    if args.no_train:
        return 0
    from scripts.tiny import train_tiny_draft

    print(">> training the draft against the twin's target (traces: a few minutes on 2 cores)",
          flush=True)
    return train_tiny_draft.main(["--model", str(out), *TRAINING]
                                 + (["--force"] if args.force else []))


if __name__ == "__main__":
    sys.exit(main())
