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
step; break-even acceptance length Z.ZZ`` (first concurrency).

Two curves decide whether wider verification can pay, and the DSpark engine measures both:

- verify rows per request: after its fixed-k passes, the DSpark engine runs one pass per
  width ``w`` = 0..k in which each request's drafts past slot ``w`` are dropped before the
  scheduler sees them (what adaptive verification's cut does), so every request verifies
  ``1 + w`` rows (the draft block still drafts all k); per width the
  target forward's and the whole step's median ms, the tokens each request gains per step
  and the tokens/s this width would give against plain decoding's (``by_width``);
- experts read: every routed-expert call of the target's MoE layers is counted (rows in,
  distinct experts among their top-k choices, ms); per step the mean distinct experts per
  MoE layer, by rows (``experts_by_rows``). A plain step of ``c`` requests reads about
  ``c x top-k`` experts per layer at most; a verify of ``c x (1 + w)`` rows, up to that
  many times more.

Usage::

    .venv/bin/python -m scripts.bench.step_cost --profile cpu-tiny [--concurrency 1 4]
    .venv/bin/python -m scripts.bench.step_cost --profile cpu-membound --threads 2
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

from scripts.bench.figures import cpu_name, save_png, subplots, write_json_png

from .. import recipe

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
    moe_calls = count_expert_calls(runner, now)
    width: list[int | None] = [None]  # the forced verify width of the pass (None: fixed k)
    if args.mode == "dspark":
        drafter = runner.drafter
        missing += [f"drafter.{m}" for m, p in DRAFTER_METHODS.items()
                    if not clock.wrap(drafter, m, p)]
        force_width(runner, width)
    rng = random.Random(1234)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=7,
                            ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    steps: list[dict[str, Any]] = []
    k = int(kwargs["speculative_config"]["num_speculative_tokens"]) if args.mode == "dspark" else 0
    widths = list(range(k + 1)) if args.widths and args.mode == "dspark" else []
    for c in args.concurrency:
        # pass 0 warms up; then the fixed-k passes; then one pass per forced width
        passes = [None] * (args.repeats + 1) + widths
        for rep, w in enumerate(passes):
            width[0] = w
            for i in range(c):
                ids = [rng.randrange(9, 1000) for _ in range(args.prompt_len)]
                engine.add_request(f"c{c}-r{rep}-{i}", {"prompt_token_ids": ids}, params)
            while engine.has_unfinished_requests():
                clock.step, step_facts = {}, {}
                moe_calls.clear()
                t0 = now()
                outs = engine.step()
                total = now() - t0
                if rep == 0 or not step_facts.get("decode"):
                    continue
                phases = {p: clock.step.get(p, 0.0) * 1e3 for p in PHASES}
                phases["engine host work"] = total * 1e3 - sum(phases.values())
                steps.append({"concurrency": c, "step_ms": total * 1e3, "phases_ms": phases,
                              "rows": step_facts["rows"], "requests": step_facts["requests"],
                              "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                              "width": w, "moe": expert_summary(moe_calls)})
    return {"mode": args.mode, "missing_methods": missing, "steps": steps, "k": k}


def count_expert_calls(runner, now) -> list[tuple[int, int, float]]:
    """Record (rows, distinct experts, ms) of every routed-expert call inside the target's
    forward (``runner._model_forward``; the draft's own MoE layer is left out). The experts
    class is whichever vLLM chose for the layers: its ``apply`` gets ``topk_ids [rows, k]``."""
    calls: list[tuple[int, int, float]] = []
    inside = [False]
    forward = runner._model_forward

    def target_forward(*a, **kw):
        inside[0] = True
        try:
            return forward(*a, **kw)
        finally:
            inside[0] = False

    runner._model_forward = target_forward
    for cls in {type(m.quant_method.moe_kernel.fused_experts)
                for m in runner.model.modules() if _experts_of(m) is not None}:
        apply = cls.apply

        def counted(self, output, hidden_states, w1, w2, topk_weights, topk_ids, *a,
                    _apply=apply, **kw):
            if not inside[0]:
                return _apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids,
                              *a, **kw)
            t0 = now()
            try:
                return _apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids,
                              *a, **kw)
            finally:
                calls.append((int(topk_ids.shape[0]), int(topk_ids.unique().numel()),
                              (now() - t0) * 1e3))

        cls.apply = counted
    return calls


def _experts_of(module):
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    return getattr(kernel, "fused_experts", None)


def expert_summary(calls: list[tuple[int, int, float]]) -> dict[str, float] | None:
    """One step's MoE layers: mean rows, mean distinct experts per layer, total routed ms."""
    if not calls:
        return None
    return {"layers": len(calls), "rows": statistics.mean(c[0] for c in calls),
            "distinct_experts": statistics.mean(c[1] for c in calls),
            "routed_ms": sum(c[2] for c in calls)}


def force_width(runner, width: list[int | None]) -> None:
    """While ``width[0]`` is set, the scheduler gets each request's first ``width[0]`` drafts
    only (the host-side trim adaptive verification applies to its cut drafts), so every
    request verifies ``1 + width`` rows; ``None`` leaves the drafts as proposed."""
    drafts_cpu = runner._get_draft_token_ids_cpu

    def trimmed():
        lists, req_ids = drafts_cpu()
        if width[0] is None:
            return lists, req_ids
        return [d[: width[0]] for d in lists], req_ids

    runner._get_draft_token_ids_cpu = trimmed


def run_child(args, mode: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "child.json"
        cmd = [sys.executable, "-m", "scripts.bench.step_cost", "--worker", mode,
               "--child-out", str(out), "--profile", args.profile,
               "--concurrency", *map(str, args.concurrency), "--repeats", str(args.repeats),
               "--max-tokens", str(args.max_tokens), "--prompt-len", str(args.prompt_len),
               "--temperature", str(args.temperature), "--clock", args.clock,
               "--threads", str(args.threads)] + ([] if args.widths else ["--no-widths"])
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


def width_curve(steps: list[dict[str, Any]], plain_step_ms: float) -> dict[str, Any]:
    """Per forced verify width (DSpark's width passes of one concurrency): median ms of the
    target forward and the step, tokens per request per step, and the speed against plain
    decoding that this width gives (tokens per request per step over the step ratio)."""
    by_w: dict[int, list[dict[str, Any]]] = {}
    for s in steps:
        if s["width"] is not None:
            by_w.setdefault(s["width"], []).append(s)
    out = {}
    for w, group in sorted(by_w.items()):
        step = statistics.median(s["step_ms"] for s in group)
        tokens = sum(s["tokens"] for s in group) / sum(s["requests"] for s in group)
        out[str(w)] = {
            "verify_rows_per_request": w + 1, "steps": len(group),
            "target_forward_ms": statistics.median(s["phases_ms"]["target forward"]
                                                   for s in group),
            "draft_forward_ms": statistics.median(s["phases_ms"]["draft forward"]
                                                  for s in group),
            "step_ms": step, "tokens_per_request_step": tokens,
            "speed_vs_plain": tokens / (step / plain_step_ms),
        }
    return out


def experts_curve(steps: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """By rows in the step: median distinct experts read per MoE layer and routed-expert ms."""
    by_rows: dict[int, list[dict[str, float]]] = {}
    for s in steps:
        if s.get("moe"):
            by_rows.setdefault(s["rows"], []).append(s["moe"])
    return {rows: {"distinct_experts_per_layer": statistics.median(m["distinct_experts"]
                                                                 for m in v),
                   "routed_ms": statistics.median(m["routed_ms"] for m in v), "steps": len(v)}
            for rows, v in sorted(by_rows.items())}


def rows_curve(steps: list[dict[str, Any]]) -> dict[int, float]:
    by_rows: dict[int, list[float]] = {}
    for s in steps:
        by_rows.setdefault(s["rows"], []).append(s["phases_ms"]["target forward"])
    return {rows: statistics.median(v) for rows, v in sorted(by_rows.items())}


def plot(result: dict[str, Any], path: Path) -> None:
    fig, (ax, ax2, ax3) = subplots(1, 3, figsize=(16, 4.2))
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
    curve = result["experts_by_rows"]
    if curve:
        ax3.plot([int(r) for r in curve], [v["distinct_experts_per_layer"]
                                           for v in curve.values()], "o-")
    ax3.set_xlabel("rows in the step")
    ax3.set_ylabel("distinct routed experts read per MoE layer")
    ax3.grid(alpha=0.3)
    save_png(fig, path)


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
    ap.add_argument("--no-widths", dest="widths", action="store_false",
                    help="skip DSpark's passes at forced verify widths 0..k")
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
        row = {mode: summarize([s for s in side["steps"]
                                if s["concurrency"] == c and s["width"] is None])
               for mode, side in sides.items()}
        row["by_width"] = width_curve([s for s in sides["dspark"]["steps"]
                                       if s["concurrency"] == c], row["plain"]["step_ms"])
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
        "experts_by_rows": experts_curve([s for side in sides.values() for s in side["steps"]]),
        "num_speculative_tokens": sides["dspark"]["k"],
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
        if row["by_width"]:
            print(f"  forced verify width (c={c}): rows/request, target forward ms, draft "
                  "forward ms, step ms, tokens/request/step, speed vs plain")
            for w, v in row["by_width"].items():
                print(f"    w={w}: {v['verify_rows_per_request']}  "
                      f"{v['target_forward_ms']:>9.2f}{v['draft_forward_ms']:>9.2f}"
                      f"{v['step_ms']:>9.2f}{v['tokens_per_request_step']:>7.2f}"
                      f"{v['speed_vs_plain']:>7.2f}x")
    for mode, curve in result["target_forward_by_rows"].items():
        print(f"target forward ms by rows ({mode}): "
              + ", ".join(f"{r}: {ms:.2f}" for r, ms in curve.items()))
    if result["experts_by_rows"]:
        print("distinct routed experts per MoE layer by rows (routed-expert ms of the step): "
              + ", ".join(f"{r}: {v['distinct_experts_per_layer']:.1f} ({v['routed_ms']:.1f})"
                          for r, v in result["experts_by_rows"].items()))
    write_json_png(args.out / "step_cost.json", result, plot)
    print(summary_line(by_c[str(args.concurrency[0])]))
    return 0


def summary_line(first: dict[str, Any]) -> str:
    """The line a script reads, for the first concurrency measured."""
    return (f"step_cost: non-forward {first['dspark']['non_forward_share']:.0%} of a DSpark "
            f"step; DSpark step {first['step_ratio']:.2f}x a plain step; break-even acceptance "
            f"length {first['break_even_acceptance_length']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
