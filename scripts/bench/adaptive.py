"""Fixed k vs confidence-scheduled (adaptive) verification in real vLLM on CPU, same run.

    HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python -m scripts.bench.adaptive \\
        [--repeats 3] [--rounds 1] [--max-tokens 32] [--row-cost X]

The cpu-tiny profile's engine (V1 runner, trained tiny draft, k=4, 64-token chunked
prefill) decodes the same 8 greedy prompts (1 to 300 tokens) with fixed k and with
``enable_adaptive_verification``; each configuration runs in its own process (one vLLM
engine per process), fixed first, the two alternating for ``--rounds``. Per timed repeat:
tokens/s (output tokens over the wall time of the engine steps) and verified rows per
emitted token (draft rows verified plus one sampled row per request and step, over the
output tokens). Medians of the repeats, adaptive / fixed ratios.

The row cost the cut rule uses (``DSPARK_VERIFY_ROW_COST``: a verify row's cost as a
fraction of a step's fixed cost) is, unless ``--row-cost`` is given, fitted from the
steps of the first fixed-k run and of a calibration run of adaptive at the
default row cost (``fit_row_cost``), then used by every adaptive run. Writes ``bench-results/adaptive.json`` and ``.png``.
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


def prompts() -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(9, 1000) for _ in range(n)] for n in PROMPT_LENS]


# ------------------------------------------------------------------ one engine (child)


def worker(adaptive: bool, repeats: int, max_tokens: int) -> dict[str, Any]:
    """Warm up, then ``repeats`` timed passes over the prompts; per-step (rows, ms) too."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    kwargs = recipe.engine_args(recipe.load_profile("cpu-tiny"), demo=True)
    kwargs["seed"] = 0
    kwargs["speculative_config"] = {
        **kwargs["speculative_config"],
        "enable_adaptive_verification": adaptive,
    }
    engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
    drafter = engine.collective_rpc(lambda w: w.model_runner.drafter)[0]
    step_rows: list[int] = []
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
    runs, samples = [], []
    for repeat in range(repeats + 1):  # the first pass warms up and is not reported
        drafter.reset_counters()
        for i, ids in enumerate(prompts()):
            engine.add_request(f"r{repeat}-{i}", {"prompt_token_ids": ids}, params)
        output_tokens, seconds = 0, 0.0
        while engine.has_unfinished_requests():
            before = len(step_rows)
            t0 = time.perf_counter()
            outs = engine.step()
            ms = (time.perf_counter() - t0) * 1e3
            seconds += ms / 1e3
            if repeat and len(step_rows) == before + 1:
                samples.append((*step_rows[-1], ms))
            output_tokens += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
        c = drafter.counters
        if repeat:
            sampled_rows = output_tokens - c.accepted_tokens  # one per request and step
            runs.append(
                {
                    "seconds": seconds,
                    "output_tokens": output_tokens,
                    "tok_s": output_tokens / seconds,
                    "verified_drafts": c.verified_tokens,
                    "accepted_drafts": c.accepted_tokens,
                    "rows_per_token": (c.verified_tokens + sampled_rows) / output_tokens,
                    "acceptance_length": output_tokens / sampled_rows,
                }
            )
    return {"adaptive": drafter.adaptive, "runs": runs, "step_samples": samples}


# ------------------------------------------------------------------------ parent


def run_child(adaptive: bool, args, row_cost: float | None) -> dict[str, Any]:
    env = {**os.environ, **ENGINE_ENV}
    if row_cost is not None:
        env[ROW_COST_ENV] = str(float(row_cost))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "child.json"
        cmd = [sys.executable, "-m", "scripts.bench.adaptive", "--worker",
               "adaptive" if adaptive else "fixed", "--child-out", str(out),
               "--repeats", str(args.repeats), "--max-tokens", str(args.max_tokens)]
        proc = subprocess.run(cmd, cwd=recipe.REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{'adaptive' if adaptive else 'fixed'} run failed:\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def fit_row_cost(samples: list[tuple[int, int, int, float]]) -> dict[str, float]:
    """Step time ``ms = a + c * requests + b * verify rows + p * prefill rows`` by least
    squares over the steps of a fixed-k and an adaptive run (fixed k alone has verify rows
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


def summarize(runs: list[dict[str, Any]]) -> dict[str, float]:
    keys = ("tok_s", "rows_per_token", "acceptance_length", "verified_drafts")
    return {k: statistics.median(r[k] for r in runs) for k in keys} | {"repeats": len(runs)}


def cpu_name() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    found = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    return found.group(1) if found else platform.processor() or platform.machine()


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fixed, adaptive = result["fixed"], result["adaptive"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for ax, key, label in ((axes[0], "tok_s", "output tokens/s"),
                           (axes[1], "rows_per_token", "verified rows per emitted token")):
        bars = ax.bar(["fixed k", "adaptive"], [fixed[key], adaptive[key]],
                      color=["tab:gray", "tab:blue"])
        ax.bar_label(bars, fmt="%.2f")
        ax.set_ylabel(label)
        ax.set_title(f"{label} (adaptive/fixed {result['ratio'][key]:.2f}x)", fontsize=9)
    fig.suptitle(f"DSpark adaptive verification, cpu-tiny, row cost "
                 f"{result['row_cost']:.4f}, {result['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per engine")
    ap.add_argument("--rounds", type=int, default=1, help="fixed/adaptive engine pairs")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--row-cost", type=float, help="default: fitted from the first fixed run")
    ap.add_argument("--out", type=Path, default=OUT_DIR / "adaptive.json")
    ap.add_argument("--worker", choices=("fixed", "adaptive"), help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.rounds < 1 or args.max_tokens < 1:
        ap.error("--repeats, --rounds and --max-tokens must be at least 1")
    if args.row_cost is not None and not 0.0 <= args.row_cost <= 100.0:
        ap.error(f"--row-cost: expected a number in [0, 100], got {args.row_cost}")
    if args.worker:
        result = worker(args.worker == "adaptive", args.repeats, args.max_tokens)
        args.child_out.write_text(json.dumps(result))
        return 0

    runs: dict[str, list] = {"fixed": [], "adaptive": []}
    row_cost, fit = args.row_cost, None
    for round_ in range(args.rounds):
        fixed = run_child(False, args, row_cost)
        if row_cost is None:
            # Calibration: an adaptive run at the default row cost gives ragged steps.
            ragged = run_child(True, args, None)
            fit = fit_row_cost(fixed["step_samples"] + ragged["step_samples"])
            row_cost = fit["row_cost"]
            print(f"fitted verify step: {fit['fixed_ms']:.2f} ms + {fit['ms_per_request']:.3f} "
                  f"ms/request + {fit['ms_per_verify_row']:.3f} ms/verify row -> row cost {row_cost:.4f}")
        adaptive = run_child(True, args, row_cost)
        if fixed["adaptive"] or not adaptive["adaptive"]:
            sys.exit("the engines did not run the configurations asked for")
        runs["fixed"] += fixed["runs"]
        runs["adaptive"] += adaptive["runs"]
        print(f"round {round_ + 1}/{args.rounds}: fixed "
              f"{statistics.median(r['tok_s'] for r in fixed['runs']):.1f} tok/s, adaptive "
              f"{statistics.median(r['tok_s'] for r in adaptive['runs']):.1f} tok/s")
    fixed_s, adaptive_s = summarize(runs["fixed"]), summarize(runs["adaptive"])
    result = {
        "created_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "profile": "cpu-tiny",
        "prompt_lens": PROMPT_LENS,
        "max_tokens": args.max_tokens,
        "row_cost": row_cost,
        "row_cost_fit": fit,
        "fixed": fixed_s,
        "adaptive": adaptive_s,
        "ratio": {k: adaptive_s[k] / fixed_s[k] for k in ("tok_s", "rows_per_token")},
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    print(f"{'':10s} {'tok/s':>8s} {'rows/token':>11s} {'accept len':>11s}")
    for name, s in (("fixed k", fixed_s), ("adaptive", adaptive_s)):
        print(f"{name:10s} {s['tok_s']:8.1f} {s['rows_per_token']:11.3f} "
              f"{s['acceptance_length']:11.3f}")
    print(f"adaptive / fixed: tok/s {result['ratio']['tok_s']:.3f}x, verified rows per token "
          f"{result['ratio']['rows_per_token']:.3f}x ({result['cpu']}, load "
          f"{result['load_avg_1m']:.1f})")
    print(f"wrote {args.out} and {args.out.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
