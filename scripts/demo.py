"""`make demo`: DSpark speculative decoding inside real vLLM (CPU build), end to end.

1. Generates the tiny DeepSeek-V4-DSpark checkpoint if it is missing and trains its draft
   against the tiny target once (``train_tiny_draft.py``; recorded beside the checkpoint).
2. Starts the plain target (no speculation) in a child process: it decodes the greedy
   reference (the no-speculation baseline, timed) and scores every output by teacher forcing.
3. Decodes a batch of prompts of very different lengths (1 to ~300 tokens) with DSpark on
   vLLM's V1 runner (the overlay's proposer and the trained draft), with the cpu-tiny
   profile's demo chunk size so engine steps mix prefill chunks and verify rows.
4. Prints the outputs, the teacher-forcing verdict (``lossless: YES/NO``, worst deficit,
   epsilon), token-identical counts against the greedy reference (information only: bf16
   kernels round differently under different batch shapes), the proposer's flat vs ragged
   step counts, vLLM's acceptance length and per-position acceptance, and tokens/s with and
   without speculation. Exits 1 only on a real violation.

Usage: python -m scripts.demo [--profile cpu-tiny] [--model DIR] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from scripts import recipe
from scripts.tiny.ensure import ensure_tiny_model
from scripts.verify.engine import make_engine
from scripts.verify.plain_target import ENGINE_ENV_DEFAULTS, PlainTarget
from scripts.verify.prompts import text_prompts
from scripts.verify.teacher_forcing import report

REPO = Path(__file__).resolve().parent.parent

for key, value in ENGINE_ENV_DEFAULTS.items():  # this process runs an engine too
    os.environ.setdefault(key, value)

def acceptance(engine) -> dict:
    """vLLM's own speculative-decoding counters: acceptance length, per position."""
    totals: dict[str, float] = {}
    per_pos: list[int] = []
    for metric in engine.get_metrics():
        name = metric.name.removesuffix("_total")
        if name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            previous = per_pos or [0] * len(metric.values)
            per_pos = [a + b for a, b in zip(metric.values, previous, strict=True)]
        elif name.startswith("vllm:spec_decode_num_"):
            totals[name] = totals.get(name, 0) + float(metric.value)
    drafts = totals.get("vllm:spec_decode_num_drafts", 0.0)
    accepted = totals.get("vllm:spec_decode_num_accepted_tokens", 0.0)
    return {
        "drafts": int(drafts),
        "length": 1.0 + accepted / drafts if drafts else float("nan"),
        "per_position": [a / drafts for a in per_pos] if drafts else [],
    }


def generate(engine, batch, max_tokens: int) -> tuple[list[list[int]], float, int]:
    """Decode ``batch`` (token-id lists) greedily; returns (outputs, seconds, steps)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, toks in enumerate(batch):
        engine.add_request(f"p{i}", {"prompt_token_ids": toks}, sp)
    outputs: dict[str, list[int]] = {}
    steps, t0 = 0, time.monotonic()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
    seconds = time.monotonic() - t0
    return [outputs[f"p{i}"] for i in range(len(batch))], seconds, steps


def print_outputs(tok, batch, reference, runs) -> None:
    """One line per prompt: worst deficit and token identity per run, first tokens."""
    names = "  ".join(f"{name + ' deficit':>14} {'same':5}" for name, _, _ in runs)
    print(f"{'prompt':>6} {'len':>4}  {names}  output with DSpark (first tokens)")
    for i, p in enumerate(batch):
        cells = "  ".join(
            f"{rep.request_worst[i]:14.4f} {str(outs[i] == reference[i]):5}"
            for _, outs, rep in runs
        )
        last = runs[-1][1][i]
        text = tok.decode(last[:12]).replace("\n", " ")
        print(f"{'p' + str(i):>6} {len(p):>4}  {cells}  {last[:6]} {text[:32]!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="cpu-tiny", help="recipe profile (engine settings)")
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: profile's)")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)

    profile = recipe.load_profile(args.profile)
    spec_kwargs = recipe.engine_args(profile, demo=True)
    # The plain target runs the same settings: its greedy run is the no-speculation baseline.
    target_kwargs = recipe.engine_args(profile, speculative=False, demo=True)
    model = ensure_tiny_model(args.model or Path(spec_kwargs["model"]), quiet=False, announce=">> ")
    spec_kwargs["model"] = target_kwargs["model"] = str(model)
    chunk = spec_kwargs["max_num_batched_tokens"]
    num_spec = spec_kwargs["speculative_config"]["num_speculative_tokens"]
    print(f">> model: {model.relative_to(REPO) if model.is_relative_to(REPO) else model}")
    print(f">> profile {profile['name']}: {chunk}-token chunked prefill, {num_spec} drafts/step")


    print(">> [1/2] greedy decoding without speculation (plain target, child process)")
    with PlainTarget({**target_kwargs, "seed": 0}) as target:
        engine = make_engine({**spec_kwargs, "seed": 0, "disable_log_stats": False})
        tok = engine.get_tokenizer()
        batch = text_prompts(tok)
        t0 = time.monotonic()
        reference = target.greedy(batch, args.max_tokens)
        base_seconds = time.monotonic() - t0

        print(">> [2/2] DSpark on vLLM's V1 runner (the checkpoint's trained mtp.* draft)")
        drafter = engine.collective_rpc(lambda worker: worker.model_runner.drafter)[0]
        drafter.reset_counters()
        outputs, seconds, steps = generate(engine, batch, args.max_tokens)
        real = drafter.counters.as_dict()
        accept = acceptance(engine)

        print(">> scoring every output by teacher forcing with the plain target")
        real_rep = target.teacher_force(batch, outputs, reference)
        # The noise floor: the plain target's own greedy tokens, scored the same way.
        floor = target.teacher_force(batch, reference).worst_deficit

    n = len(batch)
    n_tokens = n * args.max_tokens
    print()
    print_outputs(tok, batch, reference, [("DSpark", outputs, real_rep)])
    both = report([real_rep.request_worst], real_rep.epsilon)
    print()
    print(
        f"lossless: {'YES' if both.ok else 'NO'} (teacher forcing: every emitted token is the "
        f"plain target's argmax given its run's own prefix, within a tolerance of "
        f"{both.epsilon:g} nats of the best; bf16 noise floor measured in this run "
        f"{floor:.4f} nats: the plain target's own greedy tokens scored the same way)"
    )
    print(f"  {real_rep.summary(n)}")
    for i, j, d in real_rep.violations[:5]:
        print(f"    VIOLATION: prompt p{i}, output token {j}: {d:.3f} nats below the best")
    print(
        "  token-identical counts equality with greedy decoding without speculation: "
        "information only (bf16 kernels round differently under different batch shapes)"
    )
    print(
        f"engine steps: DSpark {steps} "
        f"(proposer: {real['flat_steps']} flat + {real['ragged_steps']} ragged, "
        f"{real['packed_steps']} with packed prefill; {chunk}-token chunked prefill)"
    )
    print(
        f"context rows ingested: {real['ingested_rows']} (rejected verify rows, never "
        f"stored: {real['rejected_rows']}; drafts discarded while in chunked prefill: "
        f"{real['discarded_drafts']})"
    )
    per_pos = ", ".join(f"{a:.2f}" for a in accept["per_position"])
    print(
        f"acceptance (trained tiny draft, vLLM's counters): length {accept['length']:.2f} "
        f"tokens per step over {accept['drafts']} drafting steps; per position [{per_pos}]; "
        f"{real['accepted_tokens']}/{real['verified_tokens']} verified drafts accepted"
    )
    base_rate, spec_rate = n_tokens / base_seconds, n_tokens / seconds
    verdict = "pays" if spec_rate > base_rate else "does not pay on this CPU"
    print(
        f"tokens/s ({n_tokens} output tokens, same run): no speculation {base_rate:.1f}, "
        f"DSpark {spec_rate:.1f} ({spec_rate / base_rate:.2f}x: speculation {verdict}; "
        "both swing with load on shared cores)"
    )
    return 0 if both.ok else 1


if __name__ == "__main__":
    sys.exit(main())
