"""Subprocess driver for the TP=4 DSpark test: real vLLM (CPU build), four ranks over gloo.

    python -m tests.e2e.runners.dspark_tp --model DIR --out R.json [--tp 4] [--batched-tokens 75]

The engine is the cpu-4x profile's (TP=4, DSpark, probabilistic drafting, prefix caching,
async scheduling) with a prefill chunk of ``--batched-tokens`` rows, odd on purpose: the packed
prefill then splits chunks whose row count is not a multiple of 4 (pad rows on the last ranks).
The oracle is the plain target of the same profile at the same TP (``PlainTarget``, a child
process): its greedy continuations script half of the drafts (corrupted at an index that
cycles through 0..k, so every acceptance count occurs); the other half are the checkpoint's
own drafts. Afterwards it scores every output by teacher forcing.

Per rank, from the engine's worker processes (``collective_rpc``): the proposer's counters,
the adaptive rule's table after a refit from served steps only rank 0 observed,
every packed ingest (the chunk's geometry and the rank it ran on, recorded by wrapping the
proposer's ``ingest_packed_prefill``), and a fingerprint of the draft rings, which packed
prefill must leave identical on every rank.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

from scripts.verify import engine as verify_engine
from scripts.verify.engine import make_engine
from scripts.verify.plain_target import PlainTarget
from tests.support.tp_workers import install_scripted_drafts, rank_report, refit_from_rank_zero

PROFILE = "cpu-4x"
# Prompt lengths: several chunks each at a 75-row budget, beside decodes of the others.
PROMPTS = [3, 41, 97, 150, 203, 266]
MAX_TOKENS = 16
SCRIPTED = {"P1", "P3", "P5"}  # drafted from the oracle's continuation


def prompts() -> dict[str, list[int]]:
    rng = random.Random(4)
    return {f"P{i}": [rng.randrange(9, 1000) for _ in range(n)] for i, n in enumerate(PROMPTS)}


def engine_kwargs(model: str, tp: int, budget: int | None, speculative: bool) -> dict:
    over = {"tensor_parallel_size": tp, "seed": 0}
    if budget is not None:
        over["max_num_batched_tokens"] = budget
    return verify_engine.engine_kwargs(PROFILE, model=model, speculative=speculative, **over)


# ---- driver ---------------------------------------------------------------------------------
def run(model: str, tp: int, budget: int) -> dict:
    from vllm import SamplingParams

    all_prompts = prompts()
    ids = sorted(all_prompts)
    with PlainTarget(engine_kwargs(model, tp, budget, speculative=False)) as target:
        horizon = MAX_TOKENS + 8
        conts = target.greedy([all_prompts[r] for r in ids], horizon)
        reference = {r: all_prompts[r] + c for r, c in zip(ids, conts, strict=True)}
        engine = make_engine(engine_kwargs(model, tp, budget, speculative=True))
        ranks = engine.collective_rpc(install_scripted_drafts, args=(reference, sorted(SCRIPTED)))
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        for rid in ids:
            engine.add_request(rid, {"prompt_token_ids": all_prompts[rid]}, params)
        outputs: dict[str, list[int]] = {}
        steps, t0 = 0, time.monotonic()
        while engine.has_unfinished_requests() and steps < 400:
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
            steps += 1
        seconds = time.monotonic() - t0
        per_rank = engine.collective_rpc(rank_report)
        refit = engine.collective_rpc(refit_from_rank_zero)
        engine.engine_core.shutdown()
        del engine
        done = sorted(outputs)
        batch = [all_prompts[r] for r in done]
        ref = [reference[r][len(all_prompts[r]) :][:MAX_TOKENS] for r in done]
        oracle = target.teacher_force(batch, [outputs[r] for r in done], ref)
    return {
        "tp": tp,
        "budget": budget,
        "ranks": ranks,
        "steps": steps,
        "seconds": seconds,
        "outputs": outputs,
        "per_rank": per_rank,
        "refit": refit,
        "oracle": {"ids": done, **asdict(oracle), "ok": oracle.ok},
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--batched-tokens", type=int, default=75)
    args = ap.parse_args()
    Path(args.out).write_text(json.dumps(run(args.model, args.tp, args.batched_tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
