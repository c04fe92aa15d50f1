"""Adaptive verification (``adaptive: auto``) against every fixed verify width, paired.

    HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python -m scripts.bench.adaptive \\
        [--profile cpu-tiny] [--concurrency 1 4 8] [--rounds 10] [--max-tokens 64]

One engine of the profile per concurrency c (``max_num_seqs`` = c, synchronous scheduling,
greedy, the profile's own step budget), started with an empty cost-table cache so it
measures its step-time table as a fresh deployment does. Inside that engine, passes of 3c
requests (the same prompts every pass) through its c slots rotate between the modes:

- ``auto``: the profile's engine with ``adaptive: auto`` (the proposer's own decision from
  its table: the cut rule, or nothing where the table predicts no gain);
- ``w1`` .. ``wk``: every request verifies its first w drafts (the benchmark replaces the
  proposer's cut by that truncation; ``wk`` is full-width verification, adaptive off).

Comparing inside one process matters on a shared CPU, where separate engines differ by more
than the modes do; the order of the modes rotates every round so a drift in machine speed
spreads over all of them. A pass is timed while all c slots are busy (a finished request's
slot goes to the next prompt); its tail, where every width waits on the slowest request, is
aborted. Per pass: tokens/s over the timed steps' wall time, verified rows
per emitted token, acceptance length. Per concurrency: median tokens/s per mode, the best
fixed width, and the per-round ratios auto / best fixed and auto / full width (medians, with
95% bootstrap intervals over rounds: how far a median could move from run to run).

Writes ``bench-results/adaptive-<profile>.json`` and ``.png`` (tokens/s per mode and the
measured table: step time against rows, one line per request count) and ends with

    adaptive: auto/best-fixed c=1 X.XXx, c=4 Y.YYx, c=8 Z.ZZx; auto/full-width c=8 W.WWx
"""

from __future__ import annotations

import argparse
import datetime as dt
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
PROMPT_LENS = [80, 9, 210, 33, 300, 2, 130, 1]
MAX_LEARNING_PASSES = 12  # auto's passes before the rounds at most (its warm-up included)
# Requests per pass, in multiples of the concurrency: the engine's c slots are refilled as
# requests finish, so most of a pass runs at c requests (steady load); the tail, where fewer
# than c are left and every width waits on the slowest request, is not timed.
PASS_GENERATIONS = 3
BOOTSTRAP_RESAMPLES = 2000
ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def prompts(num_requests: int) -> list[list[int]]:
    rng = random.Random(1234)
    lens = [PROMPT_LENS[i % len(PROMPT_LENS)] for i in range(num_requests)]
    return [[rng.randrange(9, 1000) for _ in range(n)] for n in lens]


def mode_names(k: int) -> list[str]:
    return ["auto", *(f"w{w}" for w in range(1, k + 1))]


# ------------------------------------------------------------------ one engine (child)


def worker(profile_name: str, concurrency: int, rounds: int, max_tokens: int) -> dict[str, Any]:
    """Measure the table (engine start), warm every mode up, then ``rounds`` rounds."""
    import torch
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.spec_decode.dspark.adaptive import apply_cut

    profile = recipe.load_profile(profile_name)
    profile["speculative"]["adaptive"] = "auto"  # what is measured, whatever the profile ships
    os.environ.update(recipe.vllm_env(profile))
    kwargs = recipe.engine_args(profile)
    kwargs |= {"seed": 0, "max_num_seqs": concurrency, "async_scheduling": False}
    engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
    drafter = engine.collective_rpc(lambda w: w.model_runner.drafter)[0]
    if not drafter.adaptive:
        sys.exit("the profile's engine does not run adaptive verification (adaptive: false?)")
    k = drafter.num_speculative_tokens
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    batch = prompts(PASS_GENERATIONS * concurrency)
    adaptive_cut = drafter._cut
    started = {"seconds": None}

    def first_step() -> None:
        # The engine's first step measures the table (cost_table): its time is the start-up
        # cost, reported from the table itself.
        engine.add_request("table", {"prompt_token_ids": batch[0]}, SamplingParams(max_tokens=1))
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        started["seconds"] = time.perf_counter() - t0

    first_step()
    rule_on = drafter.rule_on
    # auto's own state: the rule's switch and the served-step correction (served_steps),
    # which only auto's passes feed, as only auto runs in a deployment.
    auto_state = {"rule_on": rule_on, "base_ms": drafter._base_ms,
                  "calibration": drafter.calibration}
    current = {"mode": "auto"}

    def set_mode(mode: str) -> None:
        if current["mode"] == "auto":
            auto_state["rule_on"] = drafter.rule_on
        current["mode"] = mode
        if mode == "auto":
            drafter._cut, drafter.rule_on = adaptive_cut, auto_state["rule_on"]
            drafter._base_ms = auto_state["base_ms"]
            drafter.calibration = auto_state["calibration"]
            return
        width = int(mode[1:])
        keep = torch.arange(k, device=drafter.device) < width
        drafter._cut = lambda plan, drafts, narrow=False: apply_cut(drafts, keep[None, :].expand_as(drafts))
        drafter.rule_on = width < k  # full width: adaptive off, nothing to cut
        drafter._base_ms = None  # no served-step fit, no exploration: the width as set
        drafter.calibration = None  # nor the head's calibration (auto's, kept for its passes)

    def one_pass(mode: str, tag: str) -> dict[str, Any]:
        """``PASS_GENERATIONS x c`` requests through the engine's c slots; timed while every
        slot is taken (a finished request's slot goes to the next prompt, as under steady
        load), the tail in which the last requests finish is aborted, not timed."""
        set_mode(mode)
        drafter.reset_counters()
        for i, ids in enumerate(batch):
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params)
        output_tokens, seconds = 0, 0.0
        while engine.get_num_unfinished_requests() >= concurrency:
            t0 = time.perf_counter()
            outs = engine.step()
            seconds += time.perf_counter() - t0
            output_tokens += sum(len(o.outputs[0].token_ids) for o in outs)  # deltas
        engine.abort_request([f"{tag}-{i}" for i in range(len(batch))])
        while engine.has_unfinished_requests():  # nothing left to run: the aborts land
            engine.step()
        c = drafter.counters
        sampled_rows = output_tokens - c.accepted_tokens  # one per request and step
        return {
            "tok_s": output_tokens / seconds,
            "rows_per_token": (c.verified_tokens + sampled_rows) / output_tokens,
            "acceptance_length": output_tokens / sampled_rows,
        }

    modes = mode_names(k)
    for mode in modes:  # warm-up, not reported
        one_pass(mode, f"warm-{mode}")
    # auto learns its served-step correction in its first steps, exploring one step in 8
    # until the fit's slope is known or DENSE_PROPOSALS have passed; the rounds compare
    # steady states, so auto keeps warming up until then (its learning is reported apart).
    served = drafter.served
    learning = {"passes": 1, "proposals": served.proposals}
    while (not served.pinned and served.proposals <= served.DENSE_PROPOSALS
           and learning["passes"] < MAX_LEARNING_PASSES):
        one_pass("auto", f"learn-{learning['passes']}")
        learning = {"passes": learning["passes"] + 1, "proposals": served.proposals}
    learning["fitted"] = served.fitted is not None
    learning["pinned"] = served.pinned  # the slope known at the last fit
    passes: list[dict[str, dict[str, Any]]] = []
    for rnd in range(rounds):
        shift = rnd % len(modes)
        order = modes[shift:] + modes[:shift]
        passes.append({mode: one_pass(mode, f"r{rnd}-{mode}") for mode in order})
    table = drafter.cost_table
    set_mode("auto")
    return {
        "k": k,
        "rule_on": rule_on,
        "rule_on_at_end": drafter.rule_on,
        "served_fit": drafter.served.fitted,
        "rule_rests": drafter.rest.rests,  # times auto's rule rested (it cut nothing lately)
        # The head's per-slot calibration at the end (all 1 where the rule never ran).
        "calibration": None if drafter.calibration is None else drafter.calibration.scale.tolist(),
        "table": json.loads(table.to_json()),
        "max_gain": table.max_gain(concurrency),
        "first_step_seconds": started["seconds"],
        "learning": learning,
        "rounds": passes,
    }


# ------------------------------------------------------------------------ parent


def run_children(args) -> dict[int, dict[str, Any]]:
    """One engine process per concurrency, ``--jobs`` of them at a time (each compares its
    modes inside itself, so engines running side by side only add noise, not bias)."""
    results: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        pending, running = list(args.concurrency), []
        while pending or running:
            while pending and len(running) < args.jobs:
                c = pending.pop(0)
                tables = Path(tmp) / f"tables-{c}"  # empty: the engine measures its table
                env = {**os.environ, **ENGINE_ENV, "DSPARK_COST_TABLE_DIR": str(tables)}
                out = Path(tmp) / f"child-{c}.json"
                cmd = [sys.executable, "-m", "scripts.bench.adaptive", "--worker",
                       "--child-out", str(out), "--profile", args.profile, "--concurrency",
                       str(c), "--rounds", str(args.rounds), "--max-tokens",
                       str(args.max_tokens)]
                err = open(Path(tmp) / f"child-{c}.err", "w")  # noqa: SIM115
                proc = subprocess.Popen(cmd, cwd=recipe.REPO, env=env, stdout=err, stderr=err)
                running.append((c, proc, out, err))
            c, proc, out, err = running.pop(0)
            proc.wait()
            err.close()
            if proc.returncode != 0:
                sys.exit(f"engine at c={c} failed:\n{Path(err.name).read_text()[-4000:]}")
            results[c] = json.loads(out.read_text())
    return results


def interval(ratios: list[float], resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float]:
    """95% bootstrap interval of the median of ``ratios`` (rounds resampled with a fixed
    seed): how far the reported median could move from run to run on this machine."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                     for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def summarize(child: dict[str, Any]) -> dict[str, Any]:
    """Median tokens/s per mode, the best fixed width, and per-round ratios of auto.

    The best fixed width is the best of the same rounds: where widths tie, that is whichever
    width's noise ran high, so the ratio errs against auto (by up to a standard error)."""
    rounds, k = child["rounds"], child["k"]
    modes = mode_names(k)
    med = {m: {key: statistics.median(r[m][key] for r in rounds)
               for key in ("tok_s", "rows_per_token", "acceptance_length")} for m in modes}
    fixed = modes[1:]
    best = max(fixed, key=lambda m: med[m]["tok_s"])
    full = f"w{k}"
    ratio_best = [r["auto"]["tok_s"] / r[best]["tok_s"] for r in rounds]
    ratio_full = [r["auto"]["tok_s"] / r[full]["tok_s"] for r in rounds]
    return {
        "modes": med,
        "best_fixed": best,
        "auto_over_best_fixed": statistics.median(ratio_best),
        "auto_over_best_fixed_interval": interval(ratio_best),
        "auto_over_full_width": statistics.median(ratio_full),
        "auto_over_full_width_interval": interval(ratio_full),
        "per_round_auto_over_best_fixed": ratio_best,
        "per_round_auto_over_full_width": ratio_full,
        **{key: child[key] for key in ("rule_on", "rule_on_at_end", "rule_rests", "served_fit", "max_gain",
                                       "table", "first_step_seconds", "learning",
                                       "calibration")},
        "rounds": len(rounds),
    }


def calibration_text(scale) -> str:
    return "none" if scale is None else " ".join(f"{x:.2f}" for x in scale)


def fit_text(fit) -> str:
    return "not fitted" if fit is None else f"{fit[0]:.1f} ms + {fit[1]:.2f} x table"


def summary_line(results: dict[int, dict[str, Any]]) -> str:
    best = ", ".join(f"c={c} {s['auto_over_best_fixed']:.2f}x" for c, s in sorted(results.items()))
    top = max(results)
    return (f"adaptive: auto/best-fixed {best}; auto/full-width c={top} "
            f"{results[top]['auto_over_full_width']:.2f}x")


def plot(result: dict[str, Any], path: Path) -> None:
    settings = result["concurrency"]
    fig, axes = subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    for i, (c, s) in enumerate(sorted(settings.items(), key=lambda kv: int(kv[0]))):
        modes = list(s["modes"])
        values = [s["modes"][m]["tok_s"] for m in modes]
        xs = [j + 0.8 * (i - (len(settings) - 1) / 2) / len(settings) for j in range(len(modes))]
        ax.bar(xs, values, width=0.8 / len(settings), label=f"c={c}")
        ax.set_xticks(range(len(modes)), modes)
    ax.set_ylabel("tokens/s (median)")
    ax.set_title("auto vs fixed verify width w (drafts verified per request)", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1]
    # The largest engine's table holds every request count up to it.
    top = settings[max(settings, key=int)]["table"]
    for r, times in zip(top["requests"], top["ms"], strict=True):
        rows = [r * (w + 1) for w, t in enumerate(times) if t is not None]
        ax.plot(rows, [t for t in times if t is not None], marker="o", label=f"{r} requests")
    ax.set_xlabel("verify rows (requests x (1 + drafts each))")
    ax.set_ylabel("step time, ms")
    ax.set_title(f"measured step-time table ({top['measure_seconds']:.1f} s at start-up)",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.suptitle(f"DSpark adaptive verification, {result['profile']}, sync scheduling, "
                 f"{result['cpu']} (load {result['load_avg_1m']:.1f})", fontsize=8)
    save_png(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="cpu-tiny")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8],
                    help="concurrent requests (max_num_seqs), one engine each")
    ap.add_argument("--rounds", type=int, default=10, help="passes of every mode per engine")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--jobs", type=int, default=1, help="engines at a time (default 1)")
    ap.add_argument("--out", type=Path, help="default: bench-results/adaptive-PROFILE.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if min(args.rounds, args.max_tokens, args.jobs, *args.concurrency) < 1:
        ap.error("--rounds, --concurrency, --max-tokens and --jobs must be at least 1")
    recipe.load_profile(args.profile)  # a clear error before any engine starts
    if args.worker:
        result = worker(args.profile, args.concurrency[0], args.rounds, args.max_tokens)
        args.child_out.write_text(json.dumps(result))
        return 0

    out = args.out or OUT_DIR / f"adaptive-{args.profile}.json"
    results: dict[int, dict[str, Any]] = {}
    for c, child in sorted(run_children(args).items()):
        s = summarize(child)
        results[c] = s
        tok = " ".join(f"{m} {v['tok_s']:.1f}" for m, v in s["modes"].items())
        lo, hi = s["auto_over_best_fixed_interval"]
        flo, fhi = s["auto_over_full_width_interval"]
        print(f"c={c}: tok/s {tok}; best fixed {s['best_fixed']}; auto/best "
              f"{s['auto_over_best_fixed']:.3f}x (95% {lo:.2f}-{hi:.2f}), auto/full "
              f"{s['auto_over_full_width']:.3f}x (95% {flo:.2f}-{fhi:.2f}); "
              f"rule {'on' if s['rule_on'] else 'off'} (most a cut could gain "
              f"{100 * s['max_gain']:.0f}%), {'on' if s['rule_on_at_end'] else 'off'} at the "
              f"end, rested {s['rule_rests']} times; served steps {fit_text(s['served_fit'])} (learned in "
              f"{s['learning']['proposals']} steps, {s['learning']['passes']} passes); table measured in "
              f"{s['table']['measure_seconds']:.1f} s; head calibration per slot "
              f"{calibration_text(s['calibration'])}", flush=True)
    result = {
        "created_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "profile": args.profile,
        "prompt_lens": PROMPT_LENS,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "jobs": args.jobs,
        "concurrency": {str(c): s for c, s in results.items()},
        "summary": summary_line(results),
    }
    print(f"{result['cpu']}, load {result['load_avg_1m']:.1f}")
    write_json_png(out, result, plot)
    print(result["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
