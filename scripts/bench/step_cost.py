"""Cost of one engine step, phase by phase: plain decoding against DSpark, in real vLLM.

One engine process per side (plain target, DSpark) on the profile's checkpoint; each runs the
same decode workload at each concurrency: ``c`` random prompts, then new tokens until
``--max-tokens``, with ``--repeats`` timed passes after a warm-up. Only steps in which every
request decodes (no prefill chunk, no new request) are counted. The benchmark wraps the
runner's and the proposer's bound methods in its own process (no seam in the product) and
times each phase's own wall time (a wrapped call's time minus that of the wrapped calls
inside it):

- target forward: ``_model_forward`` + ``compute_logits`` (verify rows for DSpark);
- draft forward: the proposer's context projection (``_project``) and draft block
  (``_run_block``);
- draft noise (``draw_race_noise``), host plan (``plan``), context store (``_ingest``),
  proposer glue (the rest of ``propose_draft_token_ids``);
- sampling: ``_sample`` (the rejection sampler under DSpark);
- bookkeeping and metrics: ``_update_states`` (with DSpark's ring release and metrics),
  ``_bookkeeping_sync``, the proposer's counters (``_count``);
- input preparation: ``_prepare_inputs``;
- engine host work: the rest of ``LLMEngine.step`` (scheduler, output processing).

Prints per concurrency the median ms of each phase and its share of the step, the DSpark /
plain step ratio, the measured acceptance length, the break-even acceptance length (the
ratio: DSpark emits L tokens per request per step where plain emits one) and the target
forward's median ms by number of rows in the step. Writes ``bench-results/step_cost.json`` and
``.png``; ends with ``step_cost: non-forward X% of a DSpark step; DSpark step Y.YYx a plain
step; break-even acceptance length Z.ZZ`` (first concurrency). Usage::

    .venv/bin/python -m scripts.bench.step_cost --profile cpu-tiny [--concurrency 1 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .. import recipe
from .adaptive import cpu_name

OUT_DIR = recipe.REPO / "bench-results"
ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
FORWARD = ("target forward", "draft forward")
PHASES = (
    "target forward", "draft forward", "draft noise", "host plan", "context store",
    "proposer glue", "sampling", "bookkeeping and metrics", "input preparation",
    "engine host work",
)
RUNNER_METHODS = {
    "_model_forward": "target forward",
    "_sample": "sampling",
    "_update_states": "bookkeeping and metrics",
    "_bookkeeping_sync": "bookkeeping and metrics",
    "_prepare_inputs": "input preparation",
    "propose_draft_token_ids": "proposer glue",
}
DRAFTER_METHODS = {
    "_project": "draft forward",
    "_run_block": "draft forward",
    "draw_race_noise": "draft noise",
    "plan": "host plan",
    "_ingest": "context store",
    "_count": "bookkeeping and metrics",
}


class PhaseClock:
    """Exclusive time per phase within one engine step (nested wrapped calls subtract), on
    ``now``: wall time, or the engine thread's CPU time (what a shared machine's load leaves
    alone: other processes' work never counts, only this thread's)."""

    def __init__(self, now) -> None:
        self.now = now
        self.step: dict[str, float] = {}
        self._stack: list[list[float]] = []  # per open call: time spent in wrapped callees

    def wrap(self, obj: Any, name: str, phase: str) -> bool:
        fn = getattr(obj, name, None)
        if fn is None:
            return False

        def timed(*args, **kwargs):
            self._stack.append([0.0])
            t0 = self.now()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = self.now() - t0
                inner = self._stack.pop()[0]
                self.step[phase] = self.step.get(phase, 0.0) + elapsed - inner
                if self._stack:
                    self._stack[-1][0] += elapsed

        setattr(obj, name, timed)
        return True


def _decode_only(so) -> bool:
    """Every scheduled request decodes: one row plus its drafts, nothing new, no prefill."""
    if so.scheduled_new_reqs or not so.num_scheduled_tokens:
        return False
    spec = so.scheduled_spec_decode_tokens or {}
    return all(n == 1 + len(spec.get(r, ())) for r, n in so.num_scheduled_tokens.items())


def worker(args) -> dict[str, Any]:
    """One engine (``args.mode``): timed decode passes per concurrency; per-step records."""
    import torch
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.llm_engine import LLMEngine

    profile = recipe.load_profile(args.profile)
    kwargs = recipe.engine_args(profile, speculative=args.mode == "dspark")
    kwargs["seed"] = 0
    kwargs["max_num_seqs"] = max(args.concurrency)
    engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
    runner = engine.collective_rpc(lambda w: w.model_runner)[0]
    torch.set_num_threads(args.threads)  # the in-process engine computes on this thread
    now = time.thread_time if args.clock == "cpu" else time.perf_counter
    clock = PhaseClock(now)
    step_facts: dict[str, Any] = {}
    missing = [m for m, p in RUNNER_METHODS.items() if not clock.wrap(runner, m, p)]
    if not clock.wrap(runner.model, "compute_logits", "target forward"):
        missing.append("model.compute_logits")
    update = runner._update_states

    def facts(scheduler_output, *a, **kw):
        so = scheduler_output
        step_facts.update(decode=_decode_only(so), rows=int(so.total_num_scheduled_tokens),
                          requests=len(so.num_scheduled_tokens))
        return update(so, *a, **kw)

    runner._update_states = facts
    if args.mode == "dspark":
        drafter = runner.drafter
        missing += [f"drafter.{m}" for m, p in DRAFTER_METHODS.items()
                    if not clock.wrap(drafter, m, p)]
    rng = random.Random(1234)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=7,
                            ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    steps: list[dict[str, Any]] = []
    for c in args.concurrency:
        for rep in range(args.repeats + 1):  # pass 0 warms up
            for i in range(c):
                ids = [rng.randrange(9, 1000) for _ in range(args.prompt_len)]
                engine.add_request(f"c{c}-r{rep}-{i}", {"prompt_token_ids": ids}, params)
            while engine.has_unfinished_requests():
                clock.step, step_facts = {}, {}
                t0 = now()
                outs = engine.step()
                total = now() - t0
                if rep == 0 or not step_facts.get("decode"):
                    continue
                phases = {p: clock.step.get(p, 0.0) * 1e3 for p in PHASES}
                phases["engine host work"] = total * 1e3 - sum(phases.values())
                steps.append({"concurrency": c, "step_ms": total * 1e3, "phases_ms": phases,
                              "rows": step_facts["rows"], "requests": step_facts["requests"],
                              "tokens": sum(len(o.outputs[0].token_ids) for o in outs)})
    return {"mode": args.mode, "missing_methods": missing, "steps": steps}


def run_child(args, mode: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "child.json"
        cmd = [sys.executable, "-m", "scripts.bench.step_cost", "--worker", mode,
               "--child-out", str(out), "--profile", args.profile,
               "--concurrency", *map(str, args.concurrency), "--repeats", str(args.repeats),
               "--max-tokens", str(args.max_tokens), "--prompt-len", str(args.prompt_len),
               "--temperature", str(args.temperature), "--clock", args.clock,
               "--threads", str(args.threads)]
        proc = subprocess.run(cmd, cwd=recipe.REPO, env={**os.environ, **ENGINE_ENV},
                              capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{mode} engine failed:\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the steps of one side and concurrency; shares of the median step."""
    step = statistics.median(s["step_ms"] for s in steps)
    phases = {p: statistics.median(s["phases_ms"][p] for s in steps) for p in PHASES}
    forward = statistics.median(sum(s["phases_ms"][p] for p in FORWARD) for s in steps)
    tokens = sum(s["tokens"] for s in steps) / sum(s["requests"] for s in steps)
    return {"steps": len(steps), "step_ms": step, "phases_ms": phases,
            "non_forward_share": 1.0 - forward / step, "tokens_per_request_step": tokens}


def rows_curve(steps: list[dict[str, Any]]) -> dict[int, float]:
    by_rows: dict[int, list[float]] = {}
    for s in steps:
        by_rows.setdefault(s["rows"], []).append(s["phases_ms"]["target forward"])
    return {rows: statistics.median(v) for rows, v in sorted(by_rows.items())}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    labels, bottoms = [], []
    bars = [(f"c={c}\n{mode}", result["by_concurrency"][str(c)][mode])
            for c in result["concurrency"] for mode in ("plain", "dspark")]
    bottoms = [0.0] * len(bars)
    labels = [b[0] for b in bars]
    for phase in PHASES:
        values = [b[1]["phases_ms"][phase] for b in bars]
        ax.bar(labels, values, bottom=bottoms, label=phase)
        bottoms = [x + y for x, y in zip(bottoms, values, strict=True)]
    ax.set_ylabel(f"median {result['clock']} ms per decode step")
    ax.legend(fontsize=7)
    ax.set_title(f"{result['profile']}: step cost by phase (T={result['temperature']})")
    for mode, marker in (("plain", "o"), ("dspark", "s")):
        curve = result["target_forward_by_rows"][mode]
        ax2.plot([int(r) for r in curve], list(curve.values()), marker, label=mode)
    ax2.set_xlabel("rows in the step")
    ax2.set_ylabel("median target forward ms")
    ax2.legend()
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="cpu-tiny")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per concurrency")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="cpu: the engine thread's CPU time (default; steady on a shared "
                    "machine), wall: wall time (what a dedicated machine would see)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each engine")
    ap.add_argument("--out", type=Path, default=OUT_DIR)
    ap.add_argument("--worker", choices=("plain", "dspark"), help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        args.mode = args.worker
        args.child_out.write_text(json.dumps(worker(args)))
        return 0

    sides = {mode: run_child(args, mode) for mode in ("plain", "dspark")}
    for mode, side in sides.items():
        if side["missing_methods"]:
            print(f"warning: {mode}: not found, not timed: {side['missing_methods']}")
    by_c: dict[str, Any] = {}
    for c in args.concurrency:
        row = {mode: summarize([s for s in side["steps"] if s["concurrency"] == c])
               for mode, side in sides.items()}
        row["step_ratio"] = row["dspark"]["step_ms"] / row["plain"]["step_ms"]
        row["acceptance_length"] = row["dspark"]["tokens_per_request_step"]
        row["break_even_acceptance_length"] = row["step_ratio"]
        row["speed_ratio"] = row["acceptance_length"] / row["step_ratio"]
        by_c[str(c)] = row
    result = {
        "profile": args.profile, "temperature": args.temperature, "clock": args.clock,
        "torch_threads": args.threads,
        "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "prompt_len": args.prompt_len, "repeats": args.repeats, "by_concurrency": by_c,
        "target_forward_by_rows": {m: rows_curve(s["steps"]) for m, s in sides.items()},
        "meta": {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(),
                 "load_average": os.getloadavg(), "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=recipe.REPO, capture_output=True,
            text=True, check=False).stdout.strip()},
    }
    for c in args.concurrency:
        row = by_c[str(c)]
        d, p = row["dspark"], row["plain"]
        print(f"\nc={c}, T={args.temperature}: median {args.clock} ms per decode step "
              f"({p['steps']} plain, {d['steps']} DSpark steps)")
        print(f"  {'phase':<26}{'plain':>9}{'DSpark':>9}{'DSpark share':>14}")
        for phase in PHASES:
            print(f"  {phase:<26}{p['phases_ms'][phase]:>9.2f}{d['phases_ms'][phase]:>9.2f}"
                  f"{d['phases_ms'][phase] / d['step_ms']:>13.1%}")
        print(f"  {'step':<26}{p['step_ms']:>9.2f}{d['step_ms']:>9.2f}")
        print(f"  non-forward: plain {p['non_forward_share']:.1%}, DSpark "
              f"{d['non_forward_share']:.1%}; DSpark step {row['step_ratio']:.2f}x plain; "
              f"acceptance length {row['acceptance_length']:.2f} (break-even "
              f"{row['break_even_acceptance_length']:.2f}): DSpark {row['speed_ratio']:.2f}x plain")
    for mode, curve in result["target_forward_by_rows"].items():
        print(f"target forward ms by rows ({mode}): "
              + ", ".join(f"{r}: {ms:.2f}" for r, ms in curve.items()))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_cost.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "step_cost.png")
    print(f"wrote {args.out / 'step_cost.json'} and {args.out / 'step_cost.png'}")
    first = by_c[str(args.concurrency[0])]
    print(f"step_cost: non-forward {first['dspark']['non_forward_share']:.0%} of a DSpark step; "
          f"DSpark step {first['step_ratio']:.2f}x a plain step; break-even acceptance length "
          f"{first['break_even_acceptance_length']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
