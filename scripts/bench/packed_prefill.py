#!/usr/bin/env python3
"""Micro-benchmark for packed multi-request DSpark prefill (CPU).

Ingestion as the product runs it (``plan_step`` then ``ingest_packed_prefill``) at TP=1
(one process, one thread) against TP=2 (two gloo processes on 127.0.0.1, one thread each:
two "devices" that each project half the rows, then all-gather), for N in {512, 2048, 8192}. The projection has the
   DSV4 draft's shape (main_proj + main_norm, one W_kv per draft layer), scaled down in
   width so it runs in seconds on a laptop; the cache row is the real 512 wide.

Prints medians and ratios against the baseline measured in the same run and writes
``bench-results/packed_prefill.json`` and ``.png``. Timings, not assertions.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from scripts.bench.figures import save_png, subplots, write_json_png
from scripts.dev.overlay_source import load_overlay_module

ROOT = Path(__file__).resolve().parents[2]
OUT_DIR = ROOT / "bench-results"


pp = load_overlay_module("vllm/v1/spec_decode/dspark/packed_prefill.py")
dr = load_overlay_module("vllm/v1/spec_decode/dspark/context_store.py")
rings = load_overlay_module("vllm/v1/spec_decode/dspark/rings.py")
step_plan = load_overlay_module("vllm/v1/spec_decode/dspark/step_plan.py")


def median_time(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


class Projection:
    """DSV4 draft context-KV projection shape: main_norm(main_proj(concat aux)), then per
    draft layer kv_norm(W_kv x); RoPE is left out (elementwise, not what TP splits)."""

    def __init__(self, taps: int, hidden: int, layers: int, dim: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.main_proj = torch.randn(hidden, taps * hidden, generator=gen) / (taps * hidden) ** 0.5
        self.w_kv = torch.randn(layers * dim, hidden, generator=gen) / hidden**0.5
        self.layers, self.dim = layers, dim

    def __call__(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.rms_norm(x @ self.main_proj.T, (self.main_proj.shape[0],))
        kv = (h @ self.w_kv.T).view(x.shape[0], self.layers, self.dim)
        return torch.nn.functional.rms_norm(kv, (self.dim,)).view(x.shape[0], -1)


def ingest_inputs(num_tokens: int, args) -> dict:
    gen = torch.Generator().manual_seed(num_tokens)
    num_requests = min(args.ingest_requests, num_tokens)
    cuts = torch.randperm(num_tokens - 1, generator=gen)[: num_requests - 1] + 1
    qsl = torch.cat([torch.tensor([0]), cuts.sort().values, torch.tensor([num_tokens])])
    starts = torch.randint(0, 4096, (num_requests,), generator=gen)
    lens = qsl[1:] - qsl[:-1]
    req = torch.repeat_interleave(torch.arange(num_requests), lens)
    positions = starts[req] + torch.arange(num_tokens) - qsl[:-1][req]
    features = torch.randn(num_tokens, args.taps * args.hidden, generator=gen)
    return {
        "qsl": qsl.int(),
        "positions": positions,
        "features": features,
        "slots": torch.randperm(num_requests, generator=gen),
    }


def fresh_ring(num_slots: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """The proposer's ring: every draft layer's context KV side by side in one row."""
    return rings.allocate_rings(num_slots, args.window, args.layers * args.dim, torch.float32, "cpu")


def time_ingest(tp: int, rank: int, group, args, barrier=None) -> dict[int, dict[str, float]]:
    """Median seconds per chunk: ``total`` (slowest rank) and ``project`` (its projection).

    ``total - project`` is what packing costs on top of the projection: the host plan
    (checks, layout, one copy), padding, the all-gather and the ring store of all N rows
    (every rank stores the full chunk).
    """
    projection = Projection(args.taps, args.hidden, args.layers, args.dim)
    spent = []

    def project(x, pos):
        start = time.perf_counter()
        out = projection(x, pos)
        spent.append(time.perf_counter() - start)
        return out

    times = {}
    for num_tokens in args.ingest_tokens:
        inp = ingest_inputs(num_tokens, args)
        num_requests = len(inp["slots"])
        ring = fresh_ring(num_requests, args)
        no_rejections = torch.zeros(num_requests, dtype=torch.int64)
        totals, projects = [], []
        for i in range(args.repeats + 1):
            if barrier is not None:
                barrier()
            start = time.perf_counter()
            plan = step_plan.plan_step(
                inp["qsl"].numpy(),
                inp["slots"].tolist(),
                num_draft_tokens=np.zeros(num_requests, dtype=np.int64),
                prefilling=np.ones(num_requests, dtype=bool),
                temperature_cpu=None,
                never_cut=None,
                window=args.window,
                num_slots=num_requests,
                num_spec_tokens=1,
                draft_sizes=[num_requests],
                tp_size=tp,
                rank=rank,
                group=group,
            )
            pp.ingest_packed_prefill(
                plan.packed,
                plan.store,
                inp["features"],
                inp["positions"],
                project,
                ring,
                max_model_len=1 << 20,
                accepted=dr.last_accepted(plan.store, inp["positions"], no_rejections),
            )
            sample = torch.tensor([time.perf_counter() - start, spent[-1]], dtype=torch.float64)
            if group is not None:  # a step ends when the slowest rank ends
                torch.distributed.all_reduce(sample, torch.distributed.ReduceOp.MAX, group)
            if i:  # the first call is a warm-up
                totals.append(float(sample[0]))
                projects.append(float(sample[1]))
        times[num_tokens] = {
            "total": statistics.median(totals),
            "project": statistics.median(projects),
        }
    return times


_ALL_CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def pin_to_cpu(index: int | None) -> None:
    """One core per rank, as each Spark has its own chip (None: unpin); no-op where
    unsupported or with a single CPU."""
    if len(_ALL_CPUS) < 2:
        return
    cpus = _ALL_CPUS if index is None else [_ALL_CPUS[index % len(_ALL_CPUS)]]
    os.sched_setaffinity(0, cpus)


def time_gather(args, group) -> dict[int, float]:
    """Median seconds of the bare all-gather of the projected rows, per N."""
    import torch.distributed as dist

    out = {}
    for n in args.ingest_tokens:
        rows = -(-n // 2)  # L at TP=2
        local = torch.randn(rows, args.layers, args.dim)
        full = torch.empty(2 * rows, args.layers, args.dim)
        samples = []
        for i in range(args.repeats + 1):
            dist.barrier(group)
            start = time.perf_counter()
            pp._all_gather_rows(full, local, group)
            if i:
                samples.append(time.perf_counter() - start)
        out[n] = statistics.median(samples)
    return out


def _tp2_worker(rank: int, port: int, args, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    pin_to_cpu(rank)
    if os.path.isdir("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        times = time_ingest(2, rank, dist.group.WORLD, args, barrier=dist.barrier)
        gather = time_gather(args, dist.group.WORLD)
        if rank == 0:
            for n, seconds in gather.items():
                times[n]["gather"] = seconds
            queue.put(times)
    finally:
        dist.destroy_process_group()


def bench_ingest_tp2(args) -> dict[int, float]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_tp2_worker, args=(r, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        times = queue.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return times


# ---------------------------------------------------------------------------


def plot(result: dict, path: Path) -> None:
    fig, ax2 = subplots(figsize=(6, 4))
    ing = result["ingestion"]
    ns = [row["N"] for row in ing]
    xs = range(len(ns))
    for shift, tp, color in ((-0.2, 1, "tab:blue"), (0.2, 2, "tab:orange")):
        pos = [x + shift for x in xs]
        ax2.bar(
            pos,
            [row[f"tp{tp}_s"] * 1e3 for row in ing],
            0.4,
            color=color,
            alpha=0.45,
            label=f"TP={tp} total",
        )
        ax2.bar(
            pos,
            [row[f"tp{tp}_project_s"] * 1e3 for row in ing],
            0.4,
            color=color,
            label=f"TP={tp} projection",
        )
    ax2.set_xticks(list(xs), [str(n) for n in ns])
    ax2.set(
        xlabel="packed tokens N",
        ylabel="median ms per chunk",
        yscale="log",
        title="context-KV ingestion",
    )
    ax2.legend()
    save_png(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ingest-tokens", type=int, nargs="+", default=[512, 2048, pp.MAX_PACKED_TOKENS])
    parser.add_argument("--ingest-requests", type=int, default=16)
    parser.add_argument("--taps", type=int, default=3, help="target layers tapped (DSV4: 3)")
    parser.add_argument("--hidden", type=int, default=512, help="scaled down from 4096")
    parser.add_argument("--layers", type=int, default=3, help="draft layers (DSV4: 3)")
    parser.add_argument("--dim", type=int, default=512, help="context KV width (DSV4: 512)")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--out", type=Path, default=OUT_DIR / "packed_prefill.json")
    args = parser.parse_args()

    print(
        f"ingestion: {args.ingest_requests} requests, taps={args.taps} hidden={args.hidden} "
        f"layers={args.layers} D={args.dim} W={args.window}, fp32, 1 thread per rank pinned "
        f"to its own core; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    torch.set_num_threads(1)
    pin_to_cpu(0)
    tp1 = time_ingest(1, 0, None, args)
    pin_to_cpu(None)
    tp2 = bench_ingest_tp2(args)
    ingestion = []
    for n in args.ingest_tokens:
        one, two = tp1[n], tp2[n]
        row = {
            "N": n,
            "tp1_s": one["total"],
            "tp2_s": two["total"],
            "speedup_tp2": one["total"] / two["total"],
            "tp1_project_s": one["project"],
            "tp2_project_s": two["project"],
            "tp1_overhead_s": one["total"] - one["project"],
            "tp2_overhead_s": two["total"] - two["project"],
            "tp2_gather_s": two["gather"],
        }
        ingestion.append(row)
        print(
            f"  N={n:5d}: TP=1 {one['total'] * 1e3:8.2f} ms | TP=2 {two['total'] * 1e3:8.2f} ms "
            f"({one['total'] / two['total']:.2f}x) | projection {one['project'] * 1e3:7.2f} -> "
            f"{two['project'] * 1e3:7.2f} ms ({one['project'] / two['project']:.2f}x) | "
            f"rest {row['tp1_overhead_s'] * 1e3:6.2f} -> {row['tp2_overhead_s'] * 1e3:6.2f} ms "
            f"(bare all-gather {two['gather'] * 1e3:.2f} ms)"
        )
    result = {
        "benchmark": "packed_prefill",
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
        "repeats": args.repeats,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "ingestion": ingestion,
    }
    write_json_png(args.out, result, plot)
    largest = ingestion[-1]
    print(
        f"packed_prefill: TP=2 ingests N={largest['N']} at {largest['speedup_tp2']:.2f}x "
        "the speed of TP=1"
    )


if __name__ == "__main__":
    main()
