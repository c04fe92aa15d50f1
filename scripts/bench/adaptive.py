"""Fixed k vs confidence-scheduled (adaptive) verification in real vLLM on CPU, paired.

    HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python -m scripts.bench.adaptive \\
        [--pairs 16] [--requests 8 16] [--max-tokens 64] [--row-cost X] \\
        [--row-cost-scales 1 3] [--async-scheduling]

The cpu-tiny profile's engine (V1 runner, trained tiny draft, k=4, 256-token step budget,
``enable_adaptive_verification`` on) decodes the same greedy prompts (1 to 300
tokens) in passes that alternate between fixed k and adaptive inside one engine: for a
fixed-k pass the benchmark replaces the proposer's cut (``_cut``) by the identity, which
is what an engine with adaptive off runs (the runner's trim then finds nothing to trim).
Comparing within one process matters on CPU: separate engine processes differed by up to
3x in tokens/s on a shared machine, far more than adaptive changes. Pairs run in ABBA
order so a drift in machine speed cancels.

Per pass: tokens/s (output tokens over the wall time of the engine steps) and verified
rows per emitted token (draft rows verified plus one sampled row per request and step,
over the output tokens). Per pair the adaptive / fixed ratio; the median ratio over pairs
with a bootstrap 95% interval, for each concurrency in ``--requests`` (``max_num_seqs``)
and each multiple of the row cost in ``--row-cost-scales``.

The row cost the cut rule uses (``DSPARK_VERIFY_ROW_COST``: a verify row's cost as a
fraction of a step's fixed cost) is, unless ``--row-cost`` is given, fitted once from
the steps of a short calibration engine at the default row cost (``fit_row_cost``), then
used by every measured engine. ``--async-scheduling`` schedules as the Spark profiles do.
Writes ``bench-results/adaptive.json`` (``adaptive-async.json``) and ``.png``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .. import recipe

OUT_DIR = recipe.REPO / "bench-results"
PROMPT_LENS = [1, 2, 9, 33, 80, 130, 210, 300]
ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
ROW_COST_ENV = "DSPARK_VERIFY_ROW_COST"  # read by the proposer (dspark/adaptive.py)
MODES = ("fixed", "adaptive")


def prompts(num_requests: int) -> list[list[int]]:
    rng = random.Random(1234)
    lens = [PROMPT_LENS[i % len(PROMPT_LENS)] for i in range(num_requests)]
    return [[rng.randrange(9, 1000) for _ in range(n)] for n in lens]


# ------------------------------------------------------------------ one engine (child)


def worker(
    pairs: int, max_tokens: int, num_requests: int, async_scheduling: bool
) -> dict[str, Any]:
    """Warm up both modes, then ``pairs`` fixed/adaptive pairs of timed passes (ABBA)."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    # The profile's own 256-token step budget (not the demo's 64-token chunks): decoding
    # requests, not a starved prefill, fill the steps.
    kwargs = recipe.engine_args(recipe.load_profile("cpu-tiny"))
    kwargs["seed"] = 0
    kwargs["max_num_seqs"] = num_requests
    kwargs["async_scheduling"] = async_scheduling
    kwargs["speculative_config"] = {
        **kwargs["speculative_config"],
        "enable_adaptive_verification": True,
    }
    engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
    drafter = engine.collective_rpc(lambda w: w.model_runner.drafter)[0]
    if not drafter.adaptive:
        sys.exit("the engine did not turn adaptive verification on")
    adaptive_cut = drafter._cut
    step_rows: list[tuple[int, int, int]] = []
    propose = drafter.propose

    def counting(**kw):
        # (requests, rows of decoding requests, rows of prefill chunks) of the step.
        lengths = np.diff(np.asarray(kw["query_start_loc_cpu"]))
        prefill = np.zeros(len(lengths), bool) if kw.get("prefilling") is None else np.asarray(
            kw["prefilling"], bool
        )
        step_rows.append((len(lengths), int(lengths[~prefill].sum()), int(lengths[prefill].sum())))
        return propose(**kw)

    drafter.propose = counting
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    batch = prompts(num_requests)

    def one_pass(mode: str, tag: str, samples: list | None) -> dict[str, Any]:
        # Fixed k: the cut becomes the identity, as in an engine with adaptive off (under
        # async scheduling no budgets are made, so the scheduler keeps k per request).
        drafter._cut = adaptive_cut if mode == "adaptive" else (lambda plan, drafts: drafts)
        drafter.reset_counters()
        for i, ids in enumerate(batch):
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params)
        output_tokens, seconds = 0, 0.0
        while engine.has_unfinished_requests():
            before = len(step_rows)
            t0 = time.perf_counter()
            outs = engine.step()
            ms = (time.perf_counter() - t0) * 1e3
            seconds += ms / 1e3
            if samples is not None and len(step_rows) == before + 1:
                samples.append((*step_rows[-1], ms, MODES.index(mode)))
            output_tokens += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
        c = drafter.counters
        sampled_rows = output_tokens - c.accepted_tokens  # one per request and step
        return {
            "mode": mode,
            "seconds": seconds,
            "output_tokens": output_tokens,
            "tok_s": output_tokens / seconds,
            "verified_drafts": c.verified_tokens,
            "accepted_drafts": c.accepted_tokens,
            "rows_per_token": (c.verified_tokens + sampled_rows) / output_tokens,
            "acceptance_length": output_tokens / sampled_rows,
        }

    for mode in MODES:  # warm-up, not reported
        one_pass(mode, f"warm-{mode}", None)
    samples: list[tuple[int, int, int, float, int]] = []  # ..., ms, 1 if adaptive
    result: list[dict[str, Any]] = []
    for p in range(pairs):
        order = MODES if p % 2 == 0 else MODES[::-1]  # ABBA: a drift in speed cancels
        runs = {mode: one_pass(mode, f"p{p}-{mode}", samples) for mode in order}
        result.append(runs)
    return {"pairs": result, "step_samples": samples}


# ------------------------------------------------------------------------ parent


def run_child(args, num_requests: int, pairs: int, row_cost: float | None) -> dict[str, Any]:
    env = {**os.environ, **ENGINE_ENV}
    env.pop(ROW_COST_ENV, None)
    if row_cost is not None:
        env[ROW_COST_ENV] = str(float(row_cost))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "child.json"
        cmd = [sys.executable, "-m", "scripts.bench.adaptive", "--worker",
               "--child-out", str(out), "--pairs", str(pairs),
               "--requests", str(num_requests), "--max-tokens", str(args.max_tokens),
               *(["--async-scheduling"] if args.async_scheduling else [])]
        proc = subprocess.run(cmd, cwd=recipe.REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"engine with {num_requests} requests failed:\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def fit_row_cost(samples: list[tuple[int, int, int, float]]) -> dict[str, float]:
    """Step time ``ms = a + c * requests + b * verify rows + p * prefill rows`` by least
    squares over the steps of fixed-k and adaptive passes (fixed k alone has verify rows
    = requests x (k+1) and cannot tell the two apart); steps over 3x the median time (a
    stray stall of a shared machine) are left out. The cut rule's row cost is ``b`` over
    the fixed part of a step at the mean request count, clipped to [0, 100]."""
    import numpy as np

    data = np.asarray(samples, dtype=np.float64)
    data = data[data[:, 3] <= 3 * np.median(data[:, 3])]
    design = np.column_stack([np.ones(len(data)), data[:, :3]])
    (a, c, b, p), *_ = np.linalg.lstsq(design, data[:, 3], rcond=None)
    fixed = a + c * float(data[:, 0].mean())
    row_cost = float(min(max(b / fixed, 0.0), 100.0)) if fixed > 0 else 0.0
    return {
        "fixed_ms": float(a),
        "ms_per_request": float(c),
        "ms_per_verify_row": float(b),
        "ms_per_prefill_row": float(p),
        "mean_requests": float(data[:, 0].mean()),
        "row_cost": row_cost,
        "steps": len(data),
    }


def median_interval(values: list[float], resamples: int = 2000) -> tuple[float, float, float]:
    """The median of ``values`` and a percentile-bootstrap 95% interval for it (seeded)."""
    rng = random.Random(0)
    medians = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)
    )
    return (statistics.median(values), medians[int(0.025 * resamples)],
            medians[int(0.975 * resamples) - 1])


def summarize(pairs: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Medians per mode, and per-pair adaptive / fixed ratios with their interval."""
    out: dict[str, Any] = {}
    for mode in MODES:
        runs = [pair[mode] for pair in pairs]
        out[mode] = {k: statistics.median(r[k] for r in runs)
                     for k in ("tok_s", "rows_per_token", "acceptance_length", "verified_drafts")}
    for key in ("tok_s", "rows_per_token"):
        ratios = [pair["adaptive"][key] / pair["fixed"][key] for pair in pairs]
        median, low, high = median_interval(ratios)
        out[f"ratio_{key}"] = {"median": median, "ci95": [low, high], "per_pair": ratios,
                               "adaptive_not_worse": sum(r >= 1.0 for r in ratios)
                               if key == "tok_s" else sum(r <= 1.0 for r in ratios)}
    out["pairs"] = len(pairs)
    return out


def cpu_name() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    found = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    return found.group(1) if found else platform.processor() or platform.machine()


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    settings = result["settings"]
    scales = sorted({s["row_cost_scale"] for s in settings})
    palette = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")
    colors = {scale: palette[i % len(palette)] for i, scale in enumerate(scales)}
    for ax, key, label in ((axes[0], "tok_s", "tokens/s, adaptive / fixed"),
                           (axes[1], "rows_per_token", "verified rows per token, adaptive / fixed")):
        for s in settings:
            ratio, scale = s[f"ratio_{key}"], s["row_cost_scale"]
            x = s["requests"] + 0.6 * (scales.index(scale) - (len(scales) - 1) / 2)
            ax.scatter([x] * len(ratio["per_pair"]), ratio["per_pair"], s=10,
                       color=colors[scale], alpha=0.35)
            low, high = ratio["ci95"]
            ax.errorbar([x], [ratio["median"]],
                        yerr=[[ratio["median"] - low], [high - ratio["median"]]], fmt="o",
                        color=colors[scale], capsize=4,
                        label=f"row cost {s['row_cost']:.4f} ({scale:g}x fitted)"
                        if s["requests"] == settings[0]["requests"] else None)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(sorted({s["requests"] for s in settings}))
        ax.set_xlabel("concurrent requests")
        ax.set_title(label, fontsize=9)
    axes[1].legend(fontsize=7)
    scheduling = "async" if result.get("async_scheduling") else "sync"
    fig.suptitle(f"DSpark adaptive verification vs fixed k=4, cpu-tiny, {scheduling} scheduling, "
                 f"{result['cpu']}: per pair (dots), median and 95% interval", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=16, help="fixed/adaptive pass pairs per engine")
    ap.add_argument("--requests", type=int, nargs="+", default=[8, 16],
                    help="concurrent requests (max_num_seqs), one engine each")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--row-cost", type=float, help="default: fitted by a calibration engine")
    ap.add_argument("--row-cost-scales", type=float, nargs="+", default=[1.0, 3.0],
                    help="also run at these multiples of the row cost (3: a row 3x as "
                         "costly as measured, what the cut does where rows cost more)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="schedule asynchronously, as the Spark profiles do (the cut then "
                         "reaches the scheduler as per-request budgets, one step late)")
    ap.add_argument("--out", type=Path, help="default: bench-results/adaptive[-async].json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.pairs < 1 or args.max_tokens < 1 or min(args.requests) < 1:
        ap.error("--pairs, --requests and --max-tokens must be at least 1")
    if args.row_cost is not None and not 0.0 <= args.row_cost <= 100.0:
        ap.error(f"--row-cost: expected a number in [0, 100], got {args.row_cost}")
    if min(args.row_cost_scales) < 0:
        ap.error("--row-cost-scales: expected numbers >= 0")
    if args.worker:
        result = worker(args.pairs, args.max_tokens, args.requests[0], args.async_scheduling)
        args.child_out.write_text(json.dumps(result))
        return 0

    if args.out is None:
        args.out = OUT_DIR / ("adaptive-async.json" if args.async_scheduling else "adaptive.json")
    row_cost, fit = args.row_cost, None
    if row_cost is None:
        # Calibration at the default row cost: adaptive passes give ragged steps to fit on.
        calibration = run_child(args, max(args.requests), 2, None)
        fit = fit_row_cost(calibration["step_samples"])
        row_cost = fit["row_cost"]
        print(f"fitted verify step: {fit['fixed_ms']:.2f} ms + {fit['ms_per_request']:.3f} "
              f"ms/request + {fit['ms_per_verify_row']:.3f} ms/verify row -> row cost "
              f"{row_cost:.4f}")
    settings = []
    for n in args.requests:
        for scale in args.row_cost_scales:
            cost = min(row_cost * scale, 100.0)
            s = summarize(run_child(args, n, args.pairs, cost)["pairs"])
            s |= {"requests": n, "row_cost": cost, "row_cost_scale": scale}
            settings.append(s)
            t, r = s["ratio_tok_s"], s["ratio_rows_per_token"]
            print(f"{n:3d} requests, row cost {cost:.4f} ({scale:g}x): tok/s "
                  f"{s['fixed']['tok_s']:.1f} -> {s['adaptive']['tok_s']:.1f}, ratio "
                  f"{t['median']:.3f}x [{t['ci95'][0]:.3f}, {t['ci95'][1]:.3f}] "
                  f"({t['adaptive_not_worse']}/{s['pairs']} pairs >= 1); rows/token "
                  f"{s['fixed']['rows_per_token']:.3f} -> {s['adaptive']['rows_per_token']:.3f}"
                  f" ({r['median']:.3f}x); acceptance length "
                  f"{s['fixed']['acceptance_length']:.2f} -> "
                  f"{s['adaptive']['acceptance_length']:.2f}", flush=True)
    result = {
        "created_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "profile": "cpu-tiny",
        "prompt_lens": PROMPT_LENS,
        "max_tokens": args.max_tokens,
        "async_scheduling": args.async_scheduling,
        "pairs": args.pairs,
        "row_cost_fitted": row_cost if fit is not None else None,
        "row_cost_fit": fit,
        "settings": settings,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    print(f"({result['cpu']}, load {result['load_avg_1m']:.1f}) wrote {args.out} and "
          f"{args.out.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
