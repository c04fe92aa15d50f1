#!/usr/bin/env python3
"""Train the tiny checkpoint's DSpark draft against its own target, on CPU, once per machine.

The tiny target has random weights, so the draft written by ``make_tiny_model.py`` never
guesses right. This trains the draft's stages (``mtp.*``: projection, decoder layers, head
stack), its Markov head and its confidence head against that target, with DSpark's
objective, on sequences the target itself generates (``target_traces``) from two kinds of
prompt, half each by default: random tokens, and text (the tokenizer's synthetic corpus,
like what the demo and a chat send, whose first continuations differ from a random
prompt's):

* blocks ``[anchor, noise x (N-1)]`` at random anchors of the generated part of each
  sequence; slot k is trained towards the target's distribution at position ``p+k``;
* Markov head teacher-forced on the true previous tokens;
* loss per slot, weighted ``exp(-k / 4)``: ``a CE(target's token) + b L1(p_draft -
  p_target) + BCE(confidence, accepted)``, where ``accepted`` is whether greedy
  verification keeps the slot's draft token (draft argmax == target argmax); DSpark's
  paper has a = 0.1, b = 0.9 for sampled verification, the default here is a = 1, b = 0.1
  for the greedy verification the tiny demo runs;
* the draft function is the trainable twin (``draft_twin``), tested against the
  overlay's own draft.

Then it measures, on held-out sequences, the greedy acceptance the served draft gets:
speculative decoding simulated on the target's own greedy sequences (the draft proposes N
tokens with its own Markov chain; the leading matches are accepted, plus one token from
the target), reported as vLLM does: mean tokens per step and per-position acceptance.

Writes the trained ``mtp.*`` tensors into the checkpoint (every other tensor unchanged) and
``dspark_draft_training.json`` beside it (settings + results). Training always starts from
the draft as generated, kept in ``dspark_draft_initial.pt`` on the first run, so training
again (``--force``, other settings) gives what a first run would, not a fine-tune of the
last result. Deterministic given ``--seed`` on one machine; a second run with the same
settings finds the record and does nothing, so ``make demo`` / ``make test`` train once.

Usage: python -m scripts.tiny.train_tiny_draft --model models/tiny-dsv4-dspark [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

RECORD = "dspark_draft_training.json"
INITIAL_DRAFT = "dspark_draft_initial.pt"  # not *.safetensors: vLLM loads every one of those
# Options that are counts (each must be >= 1) and, with the seed and loss, what a run is.
SIZES = ("sequences", "held_out", "gen_len", "steps", "blocks", "step_sequences")
MAX_MODEL_LEN = 512
TRAINABLE_DTYPES = (
    "torch.bfloat16",
    "torch.float32",
)  # the target engine's and the twin's position range
FIRST_ORDINARY_ID = 9  # ids 0..8 are special tokens (make_tiny_model.SPECIAL_TOKENS)
ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="tiny DSpark checkpoint dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sequences", type=int, default=160, help="training sequences")
    p.add_argument("--held-out", type=int, default=32, help="evaluation sequences")
    p.add_argument("--gen-len", type=int, default=160, help="target tokens per sequence")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--blocks", type=int, default=128, help="blocks per training step")
    p.add_argument("--step-sequences", type=int, default=8, help="sequences the blocks come from")
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument(
        "--text-share",
        type=float,
        default=0.5,
        help="share of the training and held-out sequences whose prompt is text (the "
        "tokenizer's synthetic corpus, 1..300 tokens); the rest start from random tokens",
    )
    # DSpark weighs 0.1 CE + 0.9 L1(p_draft - p_target): its drafts are verified by rejection
    # sampling, where the whole distribution counts. The tiny demo verifies greedily, where
    # only the argmax does: CE leads (measured: 2x the first-slot acceptance early on).
    p.add_argument("--ce-weight", type=float, default=1.0, help="DSpark's paper: 0.1")
    p.add_argument("--l1-weight", type=float, default=0.1, help="DSpark's paper: 0.9")
    # Up to 4: the step is many small GEMMs (measured on 2 cores: 1.2 s a step with one
    # thread, 0.84 s with two); pass 1 when other work shares the cores.
    p.add_argument("--threads", type=int, default=max(1, min(4, os.cpu_count() or 1)),
                   help="torch threads for training")
    p.add_argument(
        "--traces-cache",
        type=Path,
        default=None,
        help="keep the target's traces in this file: a later run on the same target with the "
        "same prompts and "
        "--gen-len loads them instead of running the target again",
    )
    p.add_argument(
        "--force", action="store_true",
        help="train again, from the generated draft, even if these settings are recorded",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for name in (*SIZES, "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0.0 <= args.text_share <= 1.0:
        p.error(f"--text-share must be in [0, 1], got {args.text_share}")
    if not (args.model / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json (run make_tiny_model.py --dspark first)")
    return args


def settings(args) -> dict:
    keys = ("seed", *SIZES, "lr", "text_share", "ce_weight", "l1_weight")
    return {k: getattr(args, k) for k in keys}


def recorded(model_dir: Path, wanted: dict) -> dict | None:
    path = model_dir / RECORD
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    return record if record.get("settings") == wanted else None


# --- batches ----------------------------------------------------------------------


class Corpus:
    """Traces padded into tensors, plus the anchors a block may start at."""

    def __init__(self, traces, block_size: int):
        import torch

        self.n = block_size
        self.lengths = torch.tensor([t.tokens.numel() for t in traces])
        length = int(self.lengths.max())
        self.tokens = torch.zeros(len(traces), length, dtype=torch.int64)
        self.aux = torch.zeros(len(traces), length, traces[0].aux.shape[1], dtype=torch.bfloat16)
        self.logits = torch.zeros(
            len(traces), length, traces[0].logits.shape[1], dtype=torch.bfloat16
        )
        for i, t in enumerate(traces):
            self.tokens[i, : t.tokens.numel()] = t.tokens
            self.aux[i, : t.tokens.numel()] = t.aux
            self.logits[i, : t.tokens.numel()] = t.logits
        self.prompt_lens = torch.tensor([t.prompt_len for t in traces])
        # An anchor p is the first generated token or later, with N labels p+1..p+N.
        self.anchor_pairs = torch.cat(
            [
                torch.stack([torch.full((hi - lo,), i), torch.arange(lo, hi)], dim=1)
                for i, (lo, hi) in enumerate(
                    zip(self.prompt_lens.tolist(), (self.lengths - self.n).tolist(), strict=True)
                )
                if hi > lo
            ]
        )


def context_cells(twin, kv_all, seq_idx, anchors):
    """Each block's W context cells (positions ``p-W .. p-1``) and their validity.

    ``kv_all [S, L, K, D]`` -> ``ctx [K, B, W, D]``, ``mask [B, W]``.
    """
    import torch

    cells = anchors[:, None] - twin.window + torch.arange(twin.window)
    mask = cells >= 0
    ctx = kv_all[seq_idx[:, None], cells.clamp(min=0)]  # [B, W, K, D]
    return ctx.permute(2, 0, 1, 3), mask


def sequence_kv(twin, corpus, seqs):
    """Context KV of every position of sequences ``seqs``: ``[S, L, K, D]``."""
    import torch

    length = corpus.tokens.shape[1]
    aux = corpus.aux[seqs].reshape(len(seqs) * length, -1)
    positions = torch.arange(length).repeat(len(seqs))
    kv = twin.context_kv(twin.main_x(aux), positions)
    return kv.view(len(seqs), length, *kv.shape[1:])


def block_loss(twin, corpus, seq_idx, anchors, kv_all, local_idx, weights, mix=(0.1, 0.9)):
    """DSpark's objective over blocks at ``anchors`` of sequences ``seq_idx``."""
    import torch
    import torch.nn.functional as F

    n = twin.block_size
    ctx, mask = context_cells(twin, kv_all, local_idx, anchors)
    tokens = corpus.tokens[seq_idx]
    offsets = torch.arange(n)
    labels = tokens.gather(1, anchors[:, None] + 1 + offsets)  # [B, N]
    prev = tokens.gather(1, anchors[:, None] + offsets)  # teacher-forced Markov inputs
    target_logits = corpus.logits[seq_idx[:, None], anchors[:, None] + offsets].float()
    block = twin.block(tokens.gather(1, anchors[:, None]).squeeze(1), anchors, ctx, mask)
    embeds = twin.markov_embed(prev)
    z = block.base_logits + twin.markov_bias(embeds)
    p_draft = torch.softmax(z, dim=-1)
    p_target = torch.softmax(target_logits, dim=-1)
    ce = F.cross_entropy(z.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    l1 = (p_draft - p_target).abs().sum(-1)
    accepted = (z.argmax(-1) == target_logits.argmax(-1)).float()
    conf = twin.confidence(block.head_hidden, embeds).clamp(1e-6, 1 - 1e-6)
    bce = F.binary_cross_entropy(conf, accepted, reduction="none")
    per_slot = mix[0] * ce + mix[1] * l1 + bce
    loss = (per_slot * weights).sum(-1).mean() / weights.sum()
    return loss, accepted.mean(0)


# --- held-out acceptance -------------------------------------------------------------


def simulate_acceptance(twin, corpus) -> dict:
    """Greedy speculative decoding of every held-out sequence with the twin's drafts.

    The sequences are the target's greedy outputs, so the target's verdict on a draft is
    the sequence itself: a draft token is accepted while it equals the next token.
    """
    import torch

    n = twin.block_size
    seqs = torch.arange(corpus.tokens.shape[0])
    with torch.no_grad():
        kv_all = sequence_kv(twin, corpus, seqs)
        pos = corpus.prompt_lens.clone()
        per_pos = torch.zeros(n)
        steps = 0
        conf_sum = torch.zeros(n)
        while True:
            live = (pos + n) <= (corpus.lengths - 1)
            if not bool(live.any()):
                break
            idx, anchors = seqs[live], pos[live]
            ctx, mask = context_cells(twin, kv_all, idx, anchors)
            anchor_tok = corpus.tokens[idx, anchors]
            block = twin.block(anchor_tok, anchors, ctx, mask)
            prev, drafts, confs = anchor_tok, [], []
            for k in range(n):
                e = twin.markov_embed(prev)
                prev = (block.base_logits[:, k] + twin.markov_bias(e)).argmax(-1)
                drafts.append(prev)
                confs.append(twin.confidence(block.head_hidden[:, k], e))
            drafts = torch.stack(drafts, 1)
            truth = corpus.tokens[idx[:, None], anchors[:, None] + 1 + torch.arange(n)]
            run = (drafts == truth).long().cumprod(1)  # accepted prefix
            per_pos += run.sum(0).float()
            conf_sum += torch.stack(confs, 1).cumprod(1).sum(0)
            steps += int(live.sum())
            pos[live] = anchors + run.sum(1) + 1
    rates = (per_pos / steps).tolist()
    return {
        "steps": steps,
        "acceptance_length": 1.0 + float(per_pos.sum()) / steps,
        "per_position_acceptance": [round(r, 4) for r in rates],
        "predicted_survival": [round(c, 4) for c in (conf_sum / steps).tolist()],
    }


# --- main ------------------------------------------------------------------------------


def train(args, cfg, tensors, train_corpus, bar):
    import torch

    from scripts.tiny.draft_twin import DraftTwin

    gen = torch.Generator().manual_seed(args.seed)
    twin = DraftTwin(cfg, tensors, MAX_MODEL_LEN)
    opt = torch.optim.AdamW(twin.parameters(), lr=args.lr, weight_decay=0.0)
    weights = torch.exp(-torch.arange(twin.block_size, dtype=torch.float32) / 4.0)
    pairs = train_corpus.anchor_pairs
    log = []
    for step in range(args.steps):
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        # Few sequences per step, many anchors in each: their context KV is computed once.
        chosen = torch.randperm(train_corpus.tokens.shape[0], generator=gen)[: args.step_sequences]
        candidates = pairs[torch.isin(pairs[:, 0], chosen)]
        pick = candidates[torch.randint(len(candidates), (args.blocks,), generator=gen)]
        seqs, local = pick[:, 0].unique(return_inverse=True)
        kv_all = sequence_kv(twin, train_corpus, seqs)
        loss, acc = block_loss(
            twin,
            train_corpus,
            pick[:, 0],
            pick[:, 1],
            kv_all,
            local,
            weights,
            (args.ce_weight, args.l1_weight),
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
        opt.step()
        log.append((float(loss.detach()), [round(float(a), 3) for a in acc]))
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss):.3f}", slot0=f"{float(acc[0]):.2f}")
    return twin, log


def training_prompts(args, cfg: dict, model_dir: Path) -> list[list[int]]:
    """The training prompts then the held-out ones, each set ``--text-share`` text."""
    from tokenizers import Tokenizer

    from scripts.tiny.make_tiny_model import corpus_lines
    from scripts.tiny.target_traces import random_prompts, text_prompts

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    bos = int(cfg["bos_token_id"])
    splits = [(args.sequences, round(args.sequences * args.text_share))]
    splits.append((args.held_out, round(args.held_out * args.text_share)))
    rand = random_prompts(
        args.seed, sum(n - t for n, t in splits), int(cfg["vocab_size"]), FIRST_ORDINARY_ID, bos
    )
    text = text_prompts(
        args.seed,
        sum(t for _, t in splits),
        corpus_lines(args.seed),
        lambda s: tokenizer.encode(s, add_special_tokens=False).ids,
        bos,
    )
    (n_train, t_train), _ = splits
    r_train = n_train - t_train
    return rand[:r_train] + text[:t_train] + rand[r_train:] + text[t_train:]


def cached_traces(path: Path | None, prompts: list[list[int]], gen_len: int):
    """Traces saved by an earlier run for exactly these prompts and length, else None."""
    import torch

    from scripts.tiny.target_traces import Trace

    if path is None or not path.is_file():
        return None
    traces = [Trace(**t) for t in torch.load(path)]
    same = len(traces) == len(prompts) and all(
        t.prompt_len == len(p)
        and t.tokens[: len(p)].tolist() == p
        and t.tokens.numel() == len(p) + gen_len
        for t, p in zip(traces, prompts, strict=True)
    )
    if not same:
        print(f">> {path}: traces of other prompts or lengths; running the target again")
        return None
    print(f">> target traces from {path}")
    return traces


def initial_draft(model_dir: Path, tensors: dict) -> dict:
    """The ``mtp.*`` tensors as generated: saved beside the checkpoint before the first
    training, read back by every later one (the checkpoint then holds a trained draft)."""
    import torch

    path = model_dir / INITIAL_DRAFT
    if path.is_file():
        return torch.load(path)
    if (model_dir / RECORD).is_file():
        raise SystemExit(
            f"error: {model_dir}: its draft was trained by an older version that did not keep "
            f"the generated draft ({INITIAL_DRAFT}); delete the folder and run `make model` "
            "to generate and train it again"
        )
    draft = {n: t.clone() for n, t in tensors.items() if n.startswith("mtp.")}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        torch.save(draft, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return draft


def write_checkpoint(model_dir: Path, tensors: dict, trained: dict) -> None:
    """Replace the ``mtp.*`` tensors in ``model.safetensors``, atomically."""
    from safetensors.torch import save_file

    merged = {**tensors, **trained}
    path = model_dir / "model.safetensors"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file(
            {k: v.contiguous() for k, v in merged.items()}, str(tmp), metadata={"format": "pt"}
        )
        os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    model_dir = args.model.resolve()
    wanted = settings(args)
    record = None if args.force else recorded(model_dir, wanted)
    if record is not None:
        print(
            f">> tiny draft already trained ({model_dir / RECORD}): "
            f"acceptance length {record['held_out']['acceptance_length']:.2f}"
        )
        return 0
    cfg = json.loads((model_dir / "config.json").read_text())
    if "dspark_block_size" not in cfg or not cfg.get("enable_confidence_head", False):
        raise SystemExit(f"error: {model_dir}: needs a DSpark checkpoint with a confidence head")

    import torch
    from safetensors.torch import load_file
    from tqdm import tqdm

    from scripts.tiny.target_traces import collect_traces_in_child

    tensors = load_file(str(model_dir / "model.safetensors"))
    quantized = sorted(
        n
        for n, t in tensors.items()
        if n.startswith("mtp.") and str(t.dtype) not in TRAINABLE_DTYPES
    )
    if quantized:
        raise SystemExit(
            f"error: {model_dir}: the draft tensors must be bf16 or fp32 to train them, got "
            f"{tensors[quantized[0]].dtype} for {quantized[0]} (and {len(quantized) - 1} more); "
            "train the bf16 checkpoint (make_tiny_model.py without --format real)"
        )
    tensors |= initial_draft(model_dir, tensors)
    torch.manual_seed(args.seed)
    torch.set_flush_denormal(True)  # Adam's second moments of tiny gradients, else 10x slower
    t0 = time.monotonic()
    total = args.sequences + args.held_out
    prompts = training_prompts(args, cfg, model_dir)
    engine = {
        "model": str(model_dir),
        "dtype": "bfloat16",
        "enforce_eager": True,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": total,  # one wave of generation: fewer, wider steps
        "seed": args.seed,
    }
    traces = cached_traces(args.traces_cache, prompts, args.gen_len)
    if traces is None:
        print(f">> {total} greedy sequences of the target ({args.gen_len} tokens each)", flush=True)
        layer_ids = list(cfg["dspark_target_layer_ids"])
        traces = collect_traces_in_child(engine, prompts, args.gen_len, layer_ids, not args.quiet)
        if args.traces_cache is not None:
            torch.save([vars(t) for t in traces], args.traces_cache)
    trace_seconds = time.monotonic() - t0
    torch.set_num_threads(args.threads)
    n = int(cfg["dspark_block_size"])
    train_corpus = Corpus(traces[: args.sequences], n)
    held_out = Corpus(traces[args.sequences :], n)

    from scripts.tiny.draft_twin import DraftTwin

    untrained = simulate_acceptance(DraftTwin(cfg, tensors, MAX_MODEL_LEN), held_out)
    bar = tqdm(total=args.steps, desc="training the draft", disable=args.quiet, unit="step")
    twin, log = train(args, cfg, tensors, train_corpus, bar)
    bar.close()
    twin.eval()
    result = simulate_acceptance(twin, held_out)
    write_checkpoint(model_dir, tensors, twin.checkpoint_tensors())
    sample = [t.tokens[t.prompt_len : t.prompt_len + 24].tolist() for t in traces[:2]]
    distinct = sum(len(set(t.tokens[t.prompt_len :].tolist())) for t in traces) / len(traces)
    record = {
        "settings": wanted,
        "seconds": {"traces": round(trace_seconds, 1), "total": round(time.monotonic() - t0, 1)},
        "threads": args.threads,
        "target_generations": {
            "mean_distinct_tokens_per_sequence": round(distinct, 1),
            "generated_tokens_per_sequence": args.gen_len,
            "first_tokens": sample,
        },
        "held_out": result,
        "held_out_untrained": untrained,
        "final_loss": round(log[-1][0], 4),
        "final_train_slot_acceptance": log[-1][1],
    }
    (model_dir / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    print(
        f">> trained the tiny draft in {record['seconds']['total']:.0f}s: held-out acceptance "
        f"length {result['acceptance_length']:.2f} (untrained {untrained['acceptance_length']:.2f}), "
        f"per position {result['per_position_acceptance']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
