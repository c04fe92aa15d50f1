"""Micro-benchmark of keyed draft noise (overlay ``common/dspark/noise.py``) against memory passes.

At the Spark's draft shapes (R requests, k slots, vocabulary V) one step draws ``[R, k, V]``
float32 ``Exp(1)`` noise. Measured in one run, medians of repeats:

- ``fused``: the product's ``keyed_race_noise`` (one pass; Numba on the host);
- ``elementwise``: the same formula one torch op at a time in int64 lanes, then float64, stack,
  log: how the product computed it before (its values are the oracle: ``fused`` must equal it
  bit for bit, checked before timing);
- ``float32 pass``: one out-of-place elementwise float32 op over ``[R*k, V]``
  (``torch.neg(x, out=y)``, both buffers preallocated and warm): the unit the cost is given in.

Writes ``bench-results/noise.json`` and ``.png``; the last line is
``noise: X.X float32 passes (R=10, V=129280, k=5), values identical``. Usage::

    .venv/bin/python -m scripts.bench.noise [--rows 10 --vocab 129280 --slots 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

from scripts.bench.figures import cpu_name, save_png, subplots, write_json_png
from scripts.dev.overlay_source import load_overlay_module

noise = load_overlay_module("vllm/models/deepseek_v4/common/dspark/noise.py")

OUT_DIR = Path("bench-results")
U32 = 0xFFFFFFFF


def _rotl(x, r):
    return ((x << r) | (x >> (32 - r))) & U32


def _mix(h, key):
    key = _rotl((key * 0xCC9E2D51) & U32, 15)
    key = (key * 0x1B873593) & U32
    return (_rotl(h ^ key, 13) * 5 + 0xE6546B64) & U32


def _uniform(seeds, positions, vocab):
    h = _mix(_mix(_mix(torch.zeros_like(seeds), seeds & U32), (seeds >> 32) & U32), positions & U32)
    h = _mix(h[:, None], torch.arange(vocab, dtype=torch.int64)[None, :]) ^ 16
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & U32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & U32
    h = h ^ (h >> 16)
    return (h.to(torch.float64) + 0.5) * 2.0**-32


def elementwise_race_noise(seeds, anchor_pos, slots, vocab):
    """The formula one torch op at a time (int64 lanes, float64 log): the oracle and 'before'."""
    keys = anchor_pos + noise.DRAFT_NOISE_SALT
    u = torch.stack([_uniform(seeds, keys + k, vocab) for k in range(slots)], dim=1)
    return (-torch.log(u)).to(torch.float32)


def interleaved_seconds(cases: dict, repeats: int, slow: dict[str, int]) -> dict[str, list[float]]:
    """Wall seconds per call, the cases taking turns (a shared machine's load drifts over all
    of them alike); each case warmed once (compilation, first-touch pages)."""
    for fn in cases.values():
        fn()
    runs: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(repeats):
        for name, fn in cases.items():
            if i < slow.get(name, repeats):
                t0 = time.perf_counter()
                fn()
                runs[name].append(time.perf_counter() - t0)
    return runs


def plot(result: dict, path: Path) -> None:
    names = ["float32 pass", "fused", "elementwise"]
    ms = [result["timings"][n]["median_s"] * 1e3 for n in names]
    fig, ax = subplots(figsize=(6, 3.4))
    bars = ax.bar(names, ms, color=["grey", "tab:green", "tab:red"])
    for bar, n in zip(bars, names, strict=True):
        ax.annotate(f"{result['timings'][n]['float32_passes']:.1f} passes",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=9)
    ax.set_yscale("log")
    ax.set_ylabel("median ms per step (log)")
    s = result["shape"]
    ax.set_title(f"draft race noise [R={s['rows']}, k={s['slots']}, V={s['vocab']}] float32")
    save_png(fig, path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10, help="requests R")
    parser.add_argument("--slots", type=int, default=5, help="draft slots k")
    parser.add_argument("--vocab", type=int, default=129280, help="vocabulary V")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    r, k, v = args.rows, args.slots, args.vocab

    g = torch.Generator().manual_seed(0)
    seeds = torch.randint(-(2**63), 2**63 - 1, (r,), generator=g)
    anchor_pos = torch.randint(0, 2**17, (r,), generator=g)
    identical = torch.equal(noise.keyed_race_noise(seeds, anchor_pos, k, v),
                            elementwise_race_noise(seeds, anchor_pos, k, v))
    x = torch.rand(r * k, v, generator=g)
    y = torch.empty_like(x)
    cases = {
        "float32 pass": lambda: torch.neg(x, out=y),
        "fused": lambda: noise.keyed_race_noise(seeds, anchor_pos, k, v),
        "elementwise": lambda: elementwise_race_noise(seeds, anchor_pos, k, v),
    }
    runs = interleaved_seconds(cases, args.repeats, slow={"elementwise": 5})
    timings = {name: {"median_s": statistics.median(r), "runs_s": r} for name, r in runs.items()}
    unit = timings["float32 pass"]["median_s"]
    for t in timings.values():
        t["float32_passes"] = t["median_s"] / unit
    for name, t in timings.items():
        print(f"{name:<14}{t['median_s'] * 1e3:>9.2f} ms {t['float32_passes']:>7.1f} float32 passes")
    print(f"fused vs elementwise: {timings['elementwise']['median_s'] / timings['fused']['median_s']:.1f}x faster")

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    result = {
        "shape": {"rows": r, "slots": k, "vocab": v},
        "values_identical": identical,
        "timings": timings,
        "meta": {"commit": commit, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                 "threads": torch.get_num_threads(), "cpu": cpu_name(),
                 "load_average": os.getloadavg()},
    }
    write_json_png(args.out / "noise.json", result, plot)
    print(f"noise: {timings['fused']['float32_passes']:.1f} float32 passes (R={r}, V={v}, k={k}), "
          f"values {'identical' if identical else 'DIFFERENT'}")
    if not identical:
        raise SystemExit("fused noise differs from the elementwise formula")


if __name__ == "__main__":
    main()
