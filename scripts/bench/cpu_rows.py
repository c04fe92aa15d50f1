"""What one more row costs on this CPU: the kernels a DeepSeek-V4 verify step runs, 1..8 rows.

Speculative decoding pays where a step streams weights: then a verify step of ``1 + k`` rows
costs about what a 1-row decode step costs. This times, with the kernels vLLM picks for the
DeepSeek-V4 model on this CPU, each at a size well beyond the last-level cache:

- ``bf16 linear``: ``torch.nn.functional.linear`` on bf16 weights, what vLLM's CPU linear
  layers fall back to when oneDNN cannot build a bf16 matmul (no AVX512-BF16 / AMX);
- ``fp32 linear (oneDNN)``: vLLM's oneDNN matmul on fp32 weights, for comparison (the
  DeepSeek-V4 model cannot run in fp32 on vLLM's CPU path: its mHC kernel needs bf16);
- ``routed experts, same 6``: vLLM's CPU fused MoE (``cpu_fused_moe``, bf16, 256 experts,
  top-6) with every row routed to the same 6 experts;
- ``routed experts, independent``: the same with each row's 6 experts drawn at random
  (``distinct experts`` in the JSON: what the rows read).

Median ms over ``--repeats`` calls per row count, interleaved; ratios against 1 row of the
same kernel in this run. Writes ``bench-results/cpu_rows.json`` and ``.png``; last line
``cpu_rows: 6 rows cost X.XXx one row (bf16 linear), ...``.

    .venv/bin/python -m scripts.bench.cpu_rows [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from scripts.bench.figures import cpu_name, save_png, subplots, write_json_png

from .. import recipe

ROWS = (1, 2, 3, 4, 5, 6, 8)


def kernels(mib: int, experts: int, topk: int):
    """name -> (call(rows) -> None, distinct experts(rows) or None), weights built once."""
    import torch
    from vllm import _custom_ops as ops

    k = 4096
    n = mib * 2**20 // (2 * k)
    w16 = (torch.randn(n, k) * k**-0.5).to(torch.bfloat16)
    w32 = torch.randn(n // 2, k) * k**-0.5  # the same bytes as w16
    handler = ops.create_onednn_mm(w32.t(), 32)
    hidden, inter = 2048, 512
    w13 = ops.cpu_prepack_moe_weight(
        (torch.randn(experts, 2 * inter, hidden) * hidden**-0.5).to(torch.bfloat16), "vec")
    w2 = ops.cpu_prepack_moe_weight(
        (torch.randn(experts, hidden, inter) * inter**-0.5).to(torch.bfloat16), "vec")
    gen = torch.Generator().manual_seed(0)
    routes = {
        "same": lambda r: torch.arange(topk).repeat(r, 1),
        "independent": lambda r: torch.stack(
            [torch.randperm(experts, generator=gen)[:topk] for _ in range(r)]),
    }
    inputs = {r: (torch.randn(r, k).to(torch.bfloat16), torch.randn(r, k),
                  torch.randn(r, hidden).to(torch.bfloat16)) for r in ROWS}
    ids = {(kind, r): make(r).to(torch.int32) for kind, make in routes.items() for r in ROWS}

    def moe(kind):
        def call(r):
            x = inputs[r][2]
            weights = torch.full((r, topk), 1.0 / topk)
            ops.cpu_fused_moe(torch.empty_like(x), x, w13, w2, None, None, weights,
                              ids[kind, r], "silu", "vec")
        return call

    return {
        "bf16 linear": (lambda r: torch.nn.functional.linear(inputs[r][0], w16), None),
        "fp32 linear (oneDNN)": (lambda r: ops.onednn_mm(handler, inputs[r][1], None), None),
        "routed experts, same 6": (moe("same"), lambda r: topk),
        "routed experts, independent": (
            moe("independent"), lambda r: int(ids["independent", r].unique().numel())),
    }, {"linear_MiB": mib, "moe_MiB_per_expert": 3 * hidden * inter * 2 / 2**20,
        "experts": experts, "topk": topk}


def plot(result: dict, path: Path) -> None:
    fig, ax = subplots(figsize=(7, 4.2))
    for name, by_rows in result["ratio_to_one_row"].items():
        ax.plot([int(r) for r in by_rows], list(by_rows.values()), "o-", label=name)
    ax.plot(ROWS, ROWS, "k:", lw=0.8, label="each row a full pass (compute bound)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("rows")
    ax.set_ylabel("ms / ms at 1 row")
    ax.set_title(f"{result['cpu']}, {result['threads']} threads", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    save_png(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--linear-mib", type=int, default=256, help="bytes of each linear's weight")
    ap.add_argument("--out", type=Path, default=recipe.REPO / "bench-results")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    calls, sizes = kernels(args.linear_mib, 256, 6)
    times: dict[str, dict[int, list[float]]] = {n: {r: [] for r in ROWS} for n in calls}
    for call, _ in calls.values():
        call(1)  # warm-up
    for _ in range(args.repeats):  # interleaved: a load swing hits every kernel alike
        for r in ROWS:
            for name, (call, _) in calls.items():
                t0 = time.perf_counter()
                call(r)
                times[name][r].append((time.perf_counter() - t0) * 1e3)
    ms = {n: {r: statistics.median(v) for r, v in by.items()} for n, by in times.items()}
    result = {
        "cpu": cpu_name(), "threads": args.threads, "load_average": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d"), "sizes": sizes, "median_ms": ms,
        "ratio_to_one_row": {n: {r: v / by[1] for r, v in by.items()} for n, by in ms.items()},
        "distinct_experts": {n: {r: d(r) for r in ROWS} for n, (_, d) in calls.items() if d},
    }
    print(f"{result['cpu']}, {args.threads} threads, load {result['load_average'][0]:.1f}; "
          "median ms by rows (x one row)")
    for name, by in ms.items():
        print(f"  {name:<30}" + "".join(f"{r}: {v:7.1f} ({v / by[1]:.2f}x)  "
                                        for r, v in by.items()))
    write_json_png(args.out / "cpu_rows.json", result, plot)
    ratio = result["ratio_to_one_row"]
    print("cpu_rows: 6 rows cost " + ", ".join(f"{ratio[n][6]:.2f}x one row ({n})" for n in ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
