"""Teacher-force the rehearsal's greedy outputs with the plain target at the profile's TP.

    python -m scripts.rehearsal.score --profile cpu-2x --load LOAD.json --out SCORE.json

Runs after the nodes are gone (one engine at a time): the profile's model, sizes and
tensor-parallel size, its ranks on this machine's cores, no speculation, no async
scheduling, no prefix caching; the verdict is ``scripts/verify/teacher_forcing.py``'s, the
one the demo and the suite use. The oracle runs at the rehearsal's own TP: TP=2 and TP=1
reduce in different orders, and that rounding alone moved a near-tie by 0.28 nats (over
the 0.25 tolerance) on a run whose outputs the TP=2 target scores lossless.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="cpu-2x")
    ap.add_argument("--load", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from scripts import recipe

    profile = recipe.load_profile(args.profile)
    kwargs = recipe.engine_args(profile, speculative=False)
    tp = int(kwargs.get("tensor_parallel_size", 1))
    cores = os.cpu_count() or 1
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r % cores) for r in range(tp)))

    from vllm import LLM, SamplingParams

    from scripts.verify.teacher_forcing import teacher_force

    load = json.loads(args.load.read_text())
    greedy = [r for r in load["requests"] if r["greedy"] and "output" in r]
    kwargs.update(async_scheduling=False, enable_prefix_caching=False, seed=0,
                  disable_log_stats=True)  # fmt: skip
    llm = LLM(**kwargs)
    prompts = [r["prompt"] for r in greedy]
    rep = teacher_force(llm, prompts, [r["output"] for r in greedy])
    # The noise floor: this engine's own greedy tokens for the same prompts, scored the same
    # way (decode and teacher forcing batch the rows differently, and bf16 rounds by shape).
    plain = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(temperature=0.0, max_tokens=len(r["output"]), ignore_eos=True)
         for r in greedy],
        use_tqdm=False,
    )  # fmt: skip
    floor = teacher_force(llm, prompts, [list(o.outputs[0].token_ids) for o in plain])
    args.out.write_text(json.dumps({
        "greedy_requests": len(greedy),
        "worst_deficit": rep.worst_deficit,
        "noise_floor": floor.worst_deficit,
        "epsilon": rep.epsilon,
        "violations": rep.violations,
        "summary": f"{rep.summary(len(greedy))}; noise floor {floor.worst_deficit:.4f} nats "
                   "(the plain target's own greedy tokens, scored the same way)",
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
