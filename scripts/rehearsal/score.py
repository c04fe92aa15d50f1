"""Teacher-force the rehearsal's greedy outputs with the plain target at TP=1 (no speculation).

    python -m scripts.rehearsal.score --profile cpu-2x --load LOAD.json --out SCORE.json

Runs after the two nodes are gone (one engine at a time): the cpu-2x profile's model and
sizes, one rank, no speculation, no async scheduling, no prefix caching; the verdict is
``scripts/verify/teacher_forcing.py``'s, the one the demo and the suite use.
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

    from vllm import LLM

    from scripts import recipe
    from scripts.verify.teacher_forcing import teacher_force

    load = json.loads(args.load.read_text())
    greedy = [r for r in load["requests"] if r["greedy"] and "output" in r]
    kwargs = recipe.engine_args(recipe.load_profile(args.profile), speculative=False)
    kwargs.update(tensor_parallel_size=1, async_scheduling=False, enable_prefix_caching=False,
                  seed=0, disable_log_stats=True)  # fmt: skip
    llm = LLM(**kwargs)
    rep = teacher_force(llm, [r["prompt"] for r in greedy], [r["output"] for r in greedy])
    args.out.write_text(json.dumps({
        "greedy_requests": len(greedy),
        "worst_deficit": rep.worst_deficit,
        "epsilon": rep.epsilon,
        "violations": rep.violations,
        "summary": rep.summary(len(greedy)),
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
