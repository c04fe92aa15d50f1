"""Memory roofline of DeepSeek-V4 + DSpark decoding: the bytes one step reads per GPU and the
tokens/s a box's bandwidth allows at an acceptance length (an upper bound: compute,
communication and launch overheads are left out). `python -m scripts.bench.roofline --help`.

A step reads every dense weight once (TP-sharded ones 1/TP per GPU), each routed expert its
rows pick once, and each request's KV. A DSpark step's verify rows may all pick a request's
experts or each their own: bytes `low` (rows of a request share experts) .. `high` (every row
routes independently). Sizes and dtypes (FP8 block-scaled linears, MXFP4 experts when
expert_dtype is fp4, bf16 head, gates, compressors) come from config.json; TP, k and the KV
dtype from the recipe profile; `--tp N` asks what N GB10s would read (TP=4: four Sparks).

At TP=N the bytes a GPU reads per step do not fall to 1/N: attention's compressed-KV and
indexer projections, the gates, the mHC mixes and the KV itself are replicated. What TP adds
is the fabric: every target and draft layer ends in two all-reduces (attention output, MoE
output), the embedding in one, and the head's vocab-parallel logits are all-gathered. The
`limit` lines charge each collective a latency plus its ring traffic at the fabric's
bandwidth, as NCCL's ring does: 2 (N-1)/N of the message per GPU for an all-reduce, (N-1)/N
of the gathered logits for an all-gather.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scripts import recipe

GB10_GBS = 273.0  # DGX Spark (GB10) LPDDR5x
FABRIC_GBS = 25.0  # one 200 Gb/s RoCE port per GB10 (ConnectX-7)
ALLREDUCE_US = 20.0  # assumed latency of one small collective over RoCE (not measured)
BF16, F32 = 2.0, 4.0
FP8_BLOCK = 1.0 + 1.0 / (128 * 128)  # e4m3 + one e8m0 scale per 128x128 block
MXFP4 = 0.5 + 1.0 / 32  # e2m1 pairs + one e8m0 scale per 32
FP8_DS_MLA_SLOT = 576  # bytes per token per layer: 448 fp8 (no-RoPE part) + 64 bf16 (RoPE)

# The size fields of deepseek-ai/DeepSeek-V4-Flash-DSpark's published config.json, for a
# machine without the checkpoint (index_n_heads is not in our notes: 64 assumed).
PUBLISHED = {
    "deepseek-ai/DeepSeek-V4-Flash-DSpark": {
        "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64,
        "head_dim": 512, "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8,
        "sliding_window": 128, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0, 0, 0],
        "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
        "n_routed_experts": 256, "num_experts_per_tok": 6, "moe_intermediate_size": 2048,
        "n_shared_experts": 1, "hc_mult": 4, "vocab_size": 129280, "expert_dtype": "fp4",
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
        "dspark_target_layer_ids": [40, 41, 42], "dspark_markov_rank": 256,
    },
}  # fmt: skip


@dataclass(frozen=True)
class Model:
    """Per-GPU bytes of what a step reads, and the sizes that decide how much."""

    dense: float  # target weights read once per step, head included
    expert: float  # one routed expert of one layer
    experts: int
    topk: int
    layers: list[int]  # compress ratio per target layer
    kv_slot: float  # bytes per cached token per layer
    window: int
    index_topk: int
    index_dim: int
    draft_dense: float  # draft weights read once per step, the (shared) head again included
    draft_layers: int
    draft_kv: float  # bytes per windowed token of all draft layers (bf16 rings)
    markov: float  # Markov head W2, read once per drafted token
    k: int
    tp: int
    replicated: float = 0.0  # of `dense`, what every GPU reads whatever the TP
    hidden: int = 0
    vocab: int = 0


def load_config(profile: dict[str, Any], config_path: Path | None) -> tuple[dict, str]:
    """(config.json, where it came from): the given path, the local checkpoint, the HF cache,
    else the published sizes above."""
    ref = recipe.model_ref(profile)
    candidates = [config_path] if config_path else [Path(ref) / "config.json"]
    if not config_path:
        hub = Path.home() / ".cache/huggingface/hub" / f"models--{ref.replace('/', '--')}"
        candidates += sorted(hub.glob("snapshots/*/config.json"))
    for path in candidates:
        if path.is_file():
            return json.loads(path.read_text()), str(path)
    if config_path or ref not in PUBLISHED:
        raise ValueError(f"config.json: none at {candidates[0]} and no published sizes for {ref}")
    return PUBLISHED[ref], f"published sizes of {ref}"


def _layer(c: dict, lin: float, ratio: int, tp: int) -> float:
    """Dense bytes of one decoder layer per GPU (attention, compressor, indexer, mHC, gate,
    shared experts); column/row-parallel matrices split by TP, the rest replicated."""
    H, hd, heads, ql = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["q_lora_rank"]
    og, ol, hc = c["o_groups"], c["o_lora_rank"], c["hc_mult"]
    shared = 3 * c["moe_intermediate_size"] * c.get("n_shared_experts", 1) * H
    sharded = (heads * hd * ql + og * ol * heads * hd // og + H * og * ol + shared) * lin
    mix = (2 + hc) * hc
    replicated = (ql + hd) * H * lin + 2 * mix * hc * H * F32 + c["n_routed_experts"] * H * BF16
    for dim, present in ((hd, ratio > 1), (c.get("index_head_dim", 0), ratio == 4)):
        if present:  # a compressor (C4 windows overlap: twice the width): wkv, wgate, ape
            width = (2 if ratio == 4 else 1) * dim
            replicated += 2 * width * H * BF16 + ratio * width * F32
    if ratio == 4:  # the indexer's own projections
        ih = c["index_n_heads"]
        replicated += ih * c["index_head_dim"] * ql * lin + ih * H * BF16
    return sharded / tp + replicated


def build(config: dict, profile: dict) -> Model:
    c, tp = config, profile["parallel"]["tensor_parallel_size"]
    quant = (c.get("quantization_config") or {}).get("quant_method") == "fp8"
    lin = FP8_BLOCK if quant else BF16
    expert_dtype = (MXFP4 if c.get("expert_dtype") == "fp4" else FP8_BLOCK) if quant else BF16
    H, V, L = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    ratios = list(c.get("compress_ratios") or [0] * L)[:L]
    head = V * H * BF16 / tp
    hc_head = c["hc_mult"] * c["hc_mult"] * H * F32
    dense = sum(_layer(c, lin, r, tp) for r in ratios) + head + hc_head
    replicated = sum(_layer(c, lin, r, float("inf")) for r in ratios) + hc_head
    draft_layers = c.get("n_mtp_layers", 3)
    taps = len(c.get("dspark_target_layer_ids", [])) or 3
    spec = profile["speculative"]
    dspark = spec["method"] == "dspark"
    kv = profile["model"]["kv_cache_dtype"]
    return Model(
        dense=dense, expert=3 * c["moe_intermediate_size"] * H * expert_dtype / tp,
        experts=c["n_routed_experts"], topk=c["num_experts_per_tok"],
        kv_slot=FP8_DS_MLA_SLOT if kv == "fp8_ds_mla" else c["head_dim"] * BF16,
        layers=ratios, window=c["sliding_window"], index_topk=c["index_topk"],
        index_dim=c["index_head_dim"],
        draft_dense=(draft_layers * _layer(c, lin, 0, tp) + taps * H * H * lin + head + hc_head)
        if dspark else 0.0,
        draft_layers=draft_layers if dspark else 0, draft_kv=draft_layers * c["head_dim"] * BF16,
        markov=V * c.get("dspark_markov_rank", 0) * BF16 if dspark else 0.0,
        k=spec["num_speculative_tokens"] if dspark else 0, tp=tp, replicated=replicated,
        hidden=H, vocab=V,
    )  # fmt: skip


def distinct_experts(m: Model, groups: float) -> float:
    """Expected distinct experts of a layer when `groups` rows route independently."""
    return m.experts * (1.0 - (1.0 - m.topk / m.experts) ** groups)


def kv_bytes(m: Model, context: int) -> float:
    """One request's KV read by one target step: the sliding window, the compressed entries
    attended (top-k of the C4 layers, all of the C128 ones) and the C4 indexer's keys."""
    total = 0.0
    for ratio in m.layers:
        total += min(context, m.window) * m.kv_slot
        if ratio == 4:
            total += min(context // 4, m.index_topk) * m.kv_slot + context // 4 * m.index_dim
        elif ratio > 1:
            total += context // ratio * m.kv_slot
    return total


def step_bytes(m: Model, concurrency: int, context: int, speculative: bool) -> tuple[float, float]:
    """(low, high) bytes per GPU of one step serving `concurrency` requests."""
    target = m.dense + concurrency * kv_bytes(m, context)
    if not speculative or not m.k:
        return (target + len(m.layers) * m.expert * distinct_experts(m, concurrency),) * 2
    draft = (m.draft_dense + m.k * m.markov
             + concurrency * min(context, m.window) * m.draft_kv)
    out = []
    for rows_t, rows_d in ((concurrency, concurrency),
                           (concurrency * (m.k + 1), concurrency * m.k)):
        experts = (len(m.layers) * distinct_experts(m, rows_t)
                   + m.draft_layers * distinct_experts(m, rows_d)) * m.expert
        out.append(target + draft + experts)
    return out[0], out[1]


def predict(m: Model, bandwidth_gbs: float, concurrency: int, context: int,
            acceptance_length: float | None) -> dict[str, float]:
    """Roofline tok/s (all streams together): plain decode, and DSpark at the acceptance length
    (`tok_s_low` with every verify row routing independently, `tok_s_high` with shared)."""
    bw = bandwidth_gbs * 1e9
    decode = step_bytes(m, concurrency, context, speculative=False)[0]
    out = {"decode_gb": decode / 1e9, "decode_tok_s": concurrency * bw / decode}
    if m.k and acceptance_length:
        low, high = step_bytes(m, concurrency, context, speculative=True)
        out |= {"step_gb_low": low / 1e9, "step_gb_high": high / 1e9,
                "tok_s_low": concurrency * acceptance_length * bw / high,
                "tok_s_high": concurrency * acceptance_length * bw / low}
    return out


def fabric_seconds(m: Model, concurrency: int, speculative: bool, fabric_gbs: float,
                   latency_us: float) -> float:
    """Time one step spends in TP collectives (0 at TP=1): per layer two bf16 all-reduces of
    the step's rows x hidden, one for the embedding, and the all-gather of the head's logits;
    the draft's block adds the same over its layers and k rows per request."""
    if m.tp == 1:
        return 0.0
    ring, share = 2 * (m.tp - 1) / m.tp, (m.tp - 1) / m.tp
    passes = [(len(m.layers), concurrency * (m.k + 1 if speculative and m.k else 1))]
    if speculative and m.k:
        passes.append((m.draft_layers, concurrency * m.k))
    seconds = 0.0
    for layers, rows in passes:
        reduces = 2 * layers + 1
        sent = reduces * ring * rows * m.hidden * BF16 + share * rows * m.vocab * BF16
        seconds += (reduces + 1) * latency_us * 1e-6 + sent / (fabric_gbs * 1e9)
    return seconds


def limit(m: Model, bandwidth_gbs: float, fabric_gbs: float, latency_us: float,
          concurrency: int, context: int, acceptance_length: float) -> dict[str, float]:
    """tok/s when a step costs its bytes at the memory bandwidth plus its collectives on the
    fabric (`decode`, and DSpark's `low`..`high` as in `predict`)."""
    bw = bandwidth_gbs * 1e9
    comm = {s: fabric_seconds(m, concurrency, s, fabric_gbs, latency_us) for s in (False, True)}
    decode = step_bytes(m, concurrency, context, speculative=False)[0] / bw + comm[False]
    out = {"decode_tok_s": concurrency / decode, "fabric_ms": comm[True] * 1e3}
    if m.k:
        low, high = step_bytes(m, concurrency, context, speculative=True)
        out["tok_s_low"] = concurrency * acceptance_length / (high / bw + comm[True])
        out["tok_s_high"] = concurrency * acceptance_length / (low / bw + comm[True])
    return out


def limit_lines(m: Model, bandwidth_gbs: float, fabric_gbs: float, latency_us: float,
                context: int, acceptance: list[float]) -> str:
    """The c=1 limit at this TP for each acceptance length (the first two: prose, code)."""
    names = ["prose", "code"] + [f"accept {t:g}" for t in acceptance[2:]]
    lines = [f"TP={m.tp}: per GPU per step {m.dense / 1e9:.2f} GB of target weights, "
             f"{m.replicated / 1e9:.2f} GB of it replicated (TP does not divide it); "
             f"collectives at {fabric_gbs:g} GB/s and {latency_us:g} us each"]
    for name, tau in zip(names, acceptance, strict=False):
        p = limit(m, bandwidth_gbs, fabric_gbs, latency_us, 1, context, tau)
        spec = (f", DSpark {p['tok_s_low']:.1f} .. {p['tok_s_high']:.1f} tok/s "
                f"({p['fabric_ms']:.2f} ms of collectives per step)") if m.k else ""
        lines.append(f"limit TP={m.tp} c=1 {name} (accept len {tau:.2f}): "
                     f"decode {p['decode_tok_s']:.1f} tok/s{spec}")
    return "\n".join(lines) + "\n"


def table(m: Model, bandwidth_gbs: float, concurrency: list[int], context: int,
          acceptance: list[float]) -> str:
    lines = ["| C | accept len | decode GB/step | decode tok/s | DSpark GB/step | DSpark tok/s "
             "| DSpark / decode |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for conc in concurrency:
        for tau in acceptance if m.k else [None]:
            p = predict(m, bandwidth_gbs, conc, context, tau)
            cells = ["–"] * 4
            if tau:
                gain = [p[k] / p["decode_tok_s"] for k in ("tok_s_low", "tok_s_high")]
                cells = [f"{tau:.2f}", f"{p['step_gb_low']:.2f} .. {p['step_gb_high']:.2f}",
                         f"{p['tok_s_low']:.1f} .. {p['tok_s_high']:.1f}",
                         f"{gain[0]:.2f} .. {gain[1]:.2f}"]
            lines.append(f"| {conc} | {cells[0]} | {p['decode_gb']:.2f} "
                         f"| {p['decode_tok_s']:.1f} | " + " | ".join(cells[1:]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench.roofline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="spark-2x", help="recipe profile (default: %(default)s)")
    ap.add_argument("--config", type=Path, help="the checkpoint's config.json (default: the "
                    "profile's local checkpoint or HF cache, else the published sizes)")
    ap.add_argument("--acceptance", type=float, nargs="+", default=[2.74, 4.4],
                    help="mean acceptance lengths, tokens per step (default: 2.74 4.4)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--context", type=int, default=2048, help="tokens in each request's KV")
    ap.add_argument("--bandwidth-gbs", type=float, default=GB10_GBS,
                    help="memory bandwidth per GPU, GB/s (default: GB10, %(default)s)")
    ap.add_argument("--tp", type=int, choices=(1, 2, 4, 8),
                    help="tensor-parallel GPUs, one per Spark (default: the profile's)")
    ap.add_argument("--fabric-gbs", type=float, default=FABRIC_GBS,
                    help="fabric bandwidth per GPU for the collectives, GB/s (default: %(default)s)")
    ap.add_argument("--allreduce-us", type=float, default=ALLREDUCE_US,
                    help="latency of one collective, microseconds (default: %(default)s, assumed)")
    args = ap.parse_args(argv)
    try:
        if min(args.acceptance) < 1 or min(args.concurrency) < 1 or args.context < 1:
            raise ValueError("--acceptance must be >= 1, --concurrency and --context >= 1")
        if args.fabric_gbs <= 0 or args.allreduce_us < 0:
            raise ValueError("--fabric-gbs must be > 0 and --allreduce-us >= 0")
        profile = recipe.load_profile(args.profile)
        if args.tp is not None:
            profile["parallel"]["tensor_parallel_size"] = args.tp
        config, source = load_config(profile, args.config)
        model = build(config, profile)
    except (ValueError, KeyError) as exc:
        print(f"roofline: error: {exc}", file=sys.stderr)
        return 2
    print(f"Roofline for profile {args.profile} (TP={model.tp}, k={model.k}), "
          f"{args.bandwidth_gbs:g} GB/s per GPU, context {args.context} tokens; "
          f"sizes from {source}\n")
    print(table(model, args.bandwidth_gbs, args.concurrency, args.context, args.acceptance))
    print(limit_lines(model, args.bandwidth_gbs, args.fabric_gbs, args.allreduce_us,
                      args.context, args.acceptance), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
