#!/usr/bin/env python3
"""Micro-benchmark of the DSpark context-KV store (overlay ``context_store``).

Four implementations get the same inputs in the same run:

- ``ours``: the product's ``plan_step`` (host plan, all checks, one copy) +
  ``store_context_kv`` (vectorised device store, flat or ragged path), timed together;
- ``loop``: the public recipes' per-request Python loop (slice, keep the last W, keep
  old ring values for rejected rows, ``index_copy_``);
- ``loop_lean``: the leanest per-request loop we could write (a stricter baseline);
- ``padded``: pad the step to a rectangle ``[R, max_len, D]``, then one masked store.

Every implementation's result is checked bitwise against the others before timing.
Batches of 6, 16 and 64 requests in three mixes (decode-only verify rows, chunked
prefill + decode, one long prefill + decodes), D=512, W=128, bf16, CPU, one thread.
Prints median time per call, speed-up vs both loops, the bytes each call allocates
(measured with the torch profiler) and the padding bytes of the rectangle; writes
``bench-results/bench_ragged.json`` and ``.png``. Usage::

    .venv/bin/python -m scripts.bench.ragged [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from scripts.bench.figures import save_png, subplots
from scripts.dev.overlay_source import load_overlay_module

ROOT = Path(__file__).resolve().parents[2]
OUT_DIR = ROOT / "bench-results"
VERIFY_ROWS = 6  # anchor + 5 drafts

dr = load_overlay_module("vllm/v1/spec_decode/dspark/context_store.py")
step_plan = load_overlay_module("vllm/v1/spec_decode/dspark/step_plan.py")
# One engine step carries at most the packed prefill cap (the overlay's constant, one source).
MAX_TOKENS = load_overlay_module(
    "vllm/v1/spec_decode/dspark/packed_prefill.py"
).MAX_PACKED_TOKENS


# ---------------------------------------------------------------------------
# Baselines
# ---------------------------------------------------------------------------


def store_loop(cache, cache_pos, kv, positions, qsl, slots, num_rejected):
    """The public recipes' per-request loop (see shared/research/anchor_recipes.md 3.4).

    Per request: slice its rows, keep the last W, keep the old ring values where a row
    was rejected (``where`` with the old cells), then ``index_copy_`` into its ring row.
    Equal to the contract on these workloads (rejections only on short verify rows).
    """
    window = cache.shape[1]
    starts, slot_list = qsl.tolist(), slots.tolist()  # host lists, as the recipes pass them
    for r, slot in enumerate(slot_list):
        start, end = starts[r], starts[r + 1]
        if end == start:
            continue
        start = max(start, end - window)
        pos = positions[start:end]
        cols = pos % window
        valid = torch.arange(end - start) < (end - start - num_rejected[r])
        ring, ring_pos = cache[slot], cache_pos[slot]
        new_kv = torch.where(valid[:, None], kv[start:end], ring.index_select(0, cols))
        new_pos = torch.where(valid, pos, ring_pos.index_select(0, cols))
        ring.index_copy_(0, cols, new_kv)
        ring_pos.index_copy_(0, cols, new_pos)


def store_loop_lean(cache, cache_pos, kv, positions, qsl, slots, num_rejected):
    """The leanest per-request loop we could write: host lists once, two copies each."""
    window = cache.shape[1]
    starts, rej, slot_list = qsl.tolist(), num_rejected.tolist(), slots.tolist()
    for r, slot in enumerate(slot_list):
        end = starts[r + 1] - rej[r]
        begin = max(starts[r], end - window)  # contiguous positions: last W rows = window
        if end <= begin:
            continue
        pos = positions[begin:end]
        cols = pos % window
        cache[slot].index_copy_(0, cols, kv[begin:end])
        cache_pos[slot].index_copy_(0, cols, pos)


def store_padded(cache, cache_pos, kv, positions, qsl, slots, num_rejected):
    """Pad the step to ``[R, max_len, D]``, then mask and store the rectangle at once."""
    window = cache.shape[1]
    lengths = qsl[1:] - qsl[:-1]
    num_requests, num_rows = lengths.numel(), kv.shape[0]
    max_len = int(lengths.max())
    req = torch.repeat_interleave(torch.arange(num_requests), lengths, output_size=num_rows)
    col = torch.arange(num_rows) - qsl[:-1][req]
    padded_kv = kv.new_zeros(num_requests, max_len, kv.shape[1])
    padded_pos = positions.new_zeros(num_requests, max_len)
    padded_kv[req, col] = kv
    padded_pos[req, col] = positions
    accepted = lengths - num_rejected
    last = padded_pos.gather(1, (accepted - 1).clamp(min=0)[:, None])
    cols = torch.arange(max_len)
    keep = (cols[None, :] < accepted[:, None]) & (padded_pos > last - window)
    r_idx, c_idx = keep.nonzero(as_tuple=True)
    pos = padded_pos[r_idx, c_idx]
    cells = (slots[r_idx], pos % window)
    cache.index_put_(cells, padded_kv[r_idx, c_idx])
    cache_pos.index_put_(cells, pos)


def padding_bytes(qsl, dim, elem_size):
    """Bytes of the rectangle that hold no real row (kv + int64 position per cell)."""
    lengths = qsl[1:] - qsl[:-1]
    pad_cells = int(lengths.numel() * lengths.max() - lengths.sum())
    return pad_cells * (dim * elem_size + 8)


def store_ours(cache, cache_pos, kv, positions, qsl, slots, num_rejected):
    """Plan on the host, then the device store; the cache's last row is the scratch row."""
    bound = num_rejected.numpy()
    plan = step_plan.plan_step(
        qsl.numpy(),
        slots.tolist(),
        num_draft_tokens=bound,
        prefilling=np.zeros(bound.size, dtype=bool),
        temperature_cpu=None,
        never_cut=None,
        window=cache.shape[1],
        num_slots=cache.shape[0] - 1,
        num_spec_tokens=max(int(bound.max()), 1),
        draft_sizes=[bound.size],
    ).store
    accepted = dr.last_accepted(plan, positions, num_rejected)
    dr.store_context_kv(cache, cache_pos, kv, positions, plan, accepted)


IMPLS = {
    "ours": store_ours,
    "loop": store_loop,
    "loop_lean": store_loop_lean,
    "padded": store_padded,
}


# ---------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------


def make_step(mix, num_requests, dim, window, dtype, seed):
    """One engine step: lengths, rejections and positions for a batch mix."""
    gen = torch.Generator().manual_seed(seed)
    verify = [VERIFY_ROWS] * num_requests
    if mix == "decode":
        lengths = verify
    elif mix == "chunked":
        # A few requests prefill a chunk, the rest verify drafts.
        num_prefill = max(1, num_requests // 8)
        budget = MAX_TOKENS - VERIFY_ROWS * (num_requests - num_prefill)
        chunk = torch.randint(128, 1025, (num_prefill,), generator=gen)
        chunk = (chunk * min(1.0, budget / float(chunk.sum()))).long().clamp(min=VERIFY_ROWS + 1)
        lengths = chunk.tolist() + verify[num_prefill:]
    elif mix == "long_prefill":
        # One long prefill chunk fills the token budget; everyone else verifies.
        lengths = [MAX_TOKENS - VERIFY_ROWS * (num_requests - 1)] + verify[1:]
    else:
        raise ValueError(f"unknown mix {mix!r}")
    lengths_t = torch.tensor(lengths)
    is_verify = lengths_t == VERIFY_ROWS
    rej = torch.where(is_verify, torch.randint(0, VERIFY_ROWS, (num_requests,), generator=gen), 0)
    starts = torch.randint(0, 100_000, (num_requests,), generator=gen)
    positions = torch.cat(
        [torch.arange(s, s + n) for s, n in zip(starts.tolist(), lengths, strict=True)]
    )
    qsl = torch.zeros(num_requests + 1, dtype=torch.int64)
    qsl[1:] = lengths_t.cumsum(0)
    num_slots = max(64, num_requests)
    slots = torch.randperm(num_slots, generator=gen)[:num_requests]
    kv = torch.randn(positions.numel(), dim, generator=gen).to(dtype)
    # One more row than slots: the scratch row of ``ours`` (compared only on live rows).
    cache = torch.randn(num_slots + 1, window, dim, generator=gen).to(dtype)
    cache_pos = torch.randint(-1, 100_000, (num_slots + 1, window), generator=gen)
    return {
        "cache": cache,
        "cache_pos": cache_pos,
        "args": (kv, positions, qsl, slots, rej),
    }


# ---------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------


def time_calls(calls, min_runs, budget_s, separate=("padded",)):
    """Median and min seconds per call for each implementation (the store is idempotent).

    The in-place implementations run round-robin, so load from other processes on a
    shared machine hits them alike. The padded path runs in its own block: its huge
    temporaries would evict the caches of whichever call came next.
    """
    times = {name: [] for name in calls}

    def run(name):
        t0 = time.perf_counter()
        calls[name]()
        times[name].append(time.perf_counter() - t0)

    together = [n for n in calls if n not in separate]
    for name in together:
        calls[name]()  # warm-up
    deadline = time.perf_counter() + budget_s
    while min(len(times[n]) for n in together) < min_runs or (
        time.perf_counter() < deadline and len(times[together[0]]) < 300
    ):
        for name in together:
            run(name)
    for name in (n for n in calls if n in separate):
        calls[name]()  # warm-up
        deadline = time.perf_counter() + budget_s
        while len(times[name]) < 3 or (
            time.perf_counter() < deadline and len(times[name]) < min_runs
        ):
            run(name)
    return {name: (statistics.median(ts), min(ts), len(ts)) for name, ts in times.items()}


@contextlib.contextmanager
def quiet_stderr():
    """Hide the profiler's C++ start/stop log lines (written straight to fd 2)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def allocated_bytes(fn):
    """Total bytes allocated during one call (sum of the profiler's per-op allocations)."""
    from torch.profiler import ProfilerActivity, profile

    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(e.self_cpu_memory_usage, 0) for e in prof.events())


def bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def run_case(mix, num_requests, dim, window, dtype, min_runs, budget_s):
    step = make_step(mix, num_requests, dim, window, dtype, seed=num_requests)
    args = step["args"]
    kv, _, qsl, _, _ = args
    # Correctness first: every implementation on its own copy, compared bitwise.
    stored = {}
    for name, impl in IMPLS.items():
        cache, cache_pos = step["cache"].clone(), step["cache_pos"].clone()
        impl(cache, cache_pos, *args)
        stored[name] = (cache, cache_pos)
    ref_cache, ref_pos = stored["loop"]
    for name, (cache, cache_pos) in stored.items():
        live = (bits(cache[:-1]), cache_pos[:-1])
        if not (torch.equal(live[0], bits(ref_cache[:-1])) and torch.equal(live[1], ref_pos[:-1])):
            raise SystemExit(f"{name} disagrees with the loop on {mix} R={num_requests}")

    # The results are equal, so the timed calls share one cache: separate 8 MB copies
    # would mostly measure the benchmark evicting its own copies from the CPU caches.
    timed = {
        name: functools.partial(impl, ref_cache, ref_pos, *args) for name, impl in IMPLS.items()
    }
    timings = time_calls(timed, min_runs, budget_s)

    lengths = qsl[1:] - qsl[:-1]
    row = {
        "mix": mix,
        "requests": num_requests,
        "rows": int(qsl[-1]),
        "ragged": bool((qsl[1:] - qsl[:-1]).unique().numel() > 1),
        "max_len": int(lengths.max()),
        "cells_changed": int((ref_pos != step["cache_pos"]).sum()),
    }
    for name in IMPLS:
        median, best, runs = timings[name]
        row[name] = {
            "median_s": median,
            "min_s": best,
            "runs": runs,
            "speedup_vs_loop": timings["loop"][0] / median,
            "speedup_vs_loop_lean": timings["loop_lean"][0] / median,
            "alloc_bytes": allocated_bytes(timed[name]),
            # Only the padded path builds an [R, max_len] rectangle; every other
            # temporary is sized by T rows, R requests or the rows written.
            "padding_bytes": padding_bytes(qsl, dim, kv.element_size()) if name == "padded" else 0,
        }
    return row


def plot(rows, path):
    mixes = list(dict.fromkeys(r["mix"] for r in rows))
    fig, axes = subplots(1, len(mixes), figsize=(4.2 * len(mixes), 3.8), sharey=True)
    axes = axes if len(mixes) > 1 else [axes]
    width = 0.8 / len(IMPLS)
    for ax, mix in zip(axes, mixes, strict=True):
        sub = [r for r in rows if r["mix"] == mix]
        xs = range(len(sub))
        for k, name in enumerate(IMPLS):
            ax.bar(
                [x + (k - (len(IMPLS) - 1) / 2) * width for x in xs],
                [r[name]["median_s"] * 1e3 for r in sub],
                width,
                label=name,
            )
        ax.set_xticks(list(xs), [f"R={r['requests']}\n{r['rows']} rows" for r in sub])
        ax.set_yscale("log")
        ax.set_title(mix)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("median ms per store call (log)")
    axes[0].legend()
    fig.suptitle("DSpark context-KV store: ours vs per-request loops vs padded rectangle")
    save_png(fig, path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[6, 16, 64])
    parser.add_argument("--mixes", nargs="+", default=["decode", "chunked", "long_prefill"])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="fewer runs (smoke test)")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    min_runs, budget_s = (3, 0.05) if args.quick else (15, 0.4)
    dtype = torch.bfloat16
    rows = []
    header = (
        f"{'mix':<13}{'R':>4}{'rows':>6}{'path':>7} |{'ours':>8}{'loop':>8}{'lean':>8}{'padded':>9}"
        f" |{'vs loop':>8}{'vs lean':>8}{'padded':>8} |{'pad bytes':>11}{'alloc ours':>11}"
        f"{'alloc pad':>11}"
    )
    print(f"D={args.dim} W={args.window} {dtype} threads={args.threads} torch {torch.__version__}")
    print("median ms per call; speed-up = median loop time / median time (higher is faster)")
    print(header)
    print("-" * len(header))
    for mix in args.mixes:
        for num_requests in args.requests:
            r = run_case(mix, num_requests, args.dim, args.window, dtype, min_runs, budget_s)
            rows.append(r)
            ms = {name: r[name]["median_s"] * 1e3 for name in IMPLS}
            print(
                f"{mix:<13}{num_requests:>4}{r['rows']:>6}{'ragged' if r['ragged'] else 'flat':>7} |"
                f"{ms['ours']:>8.3f}{ms['loop']:>8.3f}{ms['loop_lean']:>8.3f}{ms['padded']:>9.3f} |"
                f"{r['ours']['speedup_vs_loop']:>7.1f}x{r['ours']['speedup_vs_loop_lean']:>7.1f}x"
                f"{r['padded']['speedup_vs_loop']:>7.2f}x |{r['padded']['padding_bytes']:>11}"
                f"{r['ours']['alloc_bytes']:>11}{r['padded']['alloc_bytes']:>11}",
                flush=True,
            )
    print(
        "vs loop / vs lean: ours against the recipes' loop and the leanest loop; padded: the "
        "padded path against the recipes' loop. pad bytes: rectangle cells with no real row "
        "(ours: 0). alloc: bytes allocated per call (torch profiler)."
    )

    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "dim": args.dim,
        "window": args.window,
        "dtype": str(dtype),
        "threads": args.threads,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "quick": args.quick,
    }
    json_path, png_path = args.out / "bench_ragged.json", args.out / "bench_ragged.png"
    json_path.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    plot(rows, png_path)
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
