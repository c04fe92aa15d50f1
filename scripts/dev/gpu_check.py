#!/usr/bin/env python3
"""The DSpark step's pure-torch half on a device, with torch alone (no vLLM).

Loads the overlay's pure-torch modules from ``overlay/`` (``overlay_source``) and runs, on
``--device``:

- ``store_flat`` / ``store_ragged``: host plan + ring store of a uniform and a mixed step
  (rejections on the device, bounds from the plan), against a per-request Python reference;
- ``window_mask`` and ``anchor_positions`` against plain Python;
- ``packed_ingest_tp1``: packed-prefill ingestion at TP=1 with a row-local projection,
  against the reference store;
- ``markov_greedy``: Markov block sampling against a step-by-step Python loop;
- ``adaptive_rule``: adaptive verification's cut and budgets (whole rows included) on the
  device against the same rule on the CPU, on confidences whose products and sums are
  exact in float32, under the sync debug mode on CUDA;
- ``sync_free``: the device half under ``torch.cuda.set_sync_debug_mode("error")`` (CUDA;
  any device-to-host sync raises);
- ``graph_replay``: the device half captured as one CUDA graph and replayed on new inputs
  equals the eager run (CUDA);
- ``flat_vs_ragged_ms``: the two store paths at equal rows (reported, not asserted).

On ``--device cpu`` the CUDA-only checks are reported as skipped. Writes JSON with what
passed; exits 1 if anything failed. Runs on Python 3.12 + torch 2.11 as well::

    python -m scripts.dev.gpu_check --device cuda --out gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from scripts.dev.overlay_source import load_overlay_module

dr = load_overlay_module("vllm/v1/spec_decode/dspark/context_store.py")
rings = load_overlay_module("vllm/v1/spec_decode/dspark/rings.py")
pp = load_overlay_module("vllm/v1/spec_decode/dspark/packed_prefill.py")
step_mod = load_overlay_module("vllm/v1/spec_decode/dspark/step_plan.py")
markov = load_overlay_module("vllm/models/deepseek_v4/common/dspark/markov.py")
adaptive = load_overlay_module("vllm/v1/spec_decode/dspark/adaptive.py")

WINDOW, DIM, SLOTS, K = 16, 64, 64, 4


def reference_store(cache, cache_pos, kv, positions, qsl, slots, rejected, window=WINDOW):
    """The ring-store contract, one request and one row at a time (host tensors): each
    request's accepted rows, only the last ``window`` positions, at cell ``pos % window``.
    Also the oracle of the packed-prefill tests."""
    for r in range(len(qsl) - 1):
        end = qsl[r + 1] - rejected[r]
        if end <= qsl[r]:
            continue
        last = positions[end - 1]
        for row in range(qsl[r], end):
            if positions[row] > last - window:
                cell = positions[row] % window
                cache[slots[r], cell] = kv[row]
                cache_pos[slots[r], cell] = positions[row]


def make_step(lengths, rejected, seed):
    gen = torch.Generator().manual_seed(seed)
    qsl = [0]
    positions = []
    for n in lengths:
        start = int(torch.randint(0, 500, (1,), generator=gen))
        positions += range(start, start + n)
        qsl.append(qsl[-1] + n)
    return {
        "qsl": qsl,
        "positions": positions,
        "slots": torch.randperm(SLOTS, generator=gen)[: len(lengths)].tolist(),
        "rejected": rejected,
        "bound": [
            min(n - 1, K) if n <= K + 1 else r for n, r in zip(lengths, rejected, strict=True)
        ],
        "kv": torch.randn(qsl[-1], DIM, generator=gen).to(torch.bfloat16),
    }


def plan_for(step, device, ragged_forced=False):
    """The product's step plan of ``step`` (every request greedy, nobody in prefill)."""
    if ragged_forced:  # the ragged path on a uniform step: compare it with the flat one
        with mock.patch.object(dr, "is_flat_step", lambda lengths: False):
            return plan_for(step, device)
    num_requests = len(step["slots"])
    return step_mod.plan_step(
        np.array(step["qsl"]),
        step["slots"],
        num_draft_tokens=np.array(step["bound"]),
        prefilling=np.zeros(num_requests, dtype=bool),
        temperature_cpu=None,
        never_cut=None,
        window=WINDOW,
        num_slots=SLOTS,
        num_spec_tokens=K,
        draft_sizes=[num_requests],
        device=device,
    )


def store(cache, cache_pos, kv, positions, plan, rejected):
    """The device half of the ring store: accepted rows from the rejection counts, then store."""
    dr.store_context_kv(cache, cache_pos, kv, positions, plan, dr.last_accepted(plan, positions, rejected))


def device_store(step, device, ragged_forced=False):
    cache, cache_pos = rings.allocate_rings(SLOTS, WINDOW, DIM, torch.bfloat16, device)
    plan = plan_for(step, device, ragged_forced).store
    args = (
        step["kv"].to(device),
        torch.tensor(step["positions"], device=device),
        plan,
        torch.tensor(step["rejected"], device=device),
    )
    store(cache, cache_pos, *args)
    return cache, cache_pos, plan, args


def check_store(step, device, ragged_forced=False):
    cache, cache_pos, plan, _ = device_store(step, device, ragged_forced)
    ref_c, ref_p = rings.allocate_rings(SLOTS, WINDOW, DIM, torch.bfloat16, "cpu")
    reference_store(
        ref_c, ref_p, step["kv"], step["positions"], step["qsl"], step["slots"], step["rejected"]
    )
    same = torch.equal(cache[:SLOTS].cpu().view(torch.int16), ref_c[:SLOTS].view(torch.int16))
    same = same and torch.equal(cache_pos[:SLOTS].cpu(), ref_p[:SLOTS])
    return {"passed": bool(same), "path": "flat" if plan.uniform else "ragged"}


def check_mask_and_anchors(step, device):
    cache, cache_pos, plan, (_, positions, _, rejected) = device_store(step, device)
    qsl, pos = step["qsl"], step["positions"]
    anchors = [pos[qsl[r + 1] - 1 - step["rejected"][r]] + 1 for r in range(len(qsl) - 1)]
    accepted = dr.last_accepted(plan, positions, rejected)
    got = step_mod.draft_anchor_positions(plan_for(step, device), accepted).cpu().tolist()
    mask = dr.window_mask(cache_pos, plan.slots, torch.tensor(anchors, device=device), WINDOW)
    held = cache_pos.cpu()
    want = [
        [0 <= int(p) and a - WINDOW <= int(p) < a for p in held[s]]
        for s, a in zip(step["slots"], anchors, strict=True)
    ]
    return {"passed": got == anchors and mask.cpu().tolist() == want}


def check_packed(device):
    step = make_step([70, 3, 40, 5], [0, 0, 0, 2], seed=3)
    weight = torch.randn(2 * DIM, DIM, generator=torch.Generator().manual_seed(1))

    def project(x, pos):  # row-local, exact in float32 then rounded: batching-independent
        return ((x.float() @ weight.to(x.device)) + pos[:, None].float()).to(torch.bfloat16)

    features = torch.randn(step["qsl"][-1], 2 * DIM, generator=torch.Generator().manual_seed(2))
    cache, cache_pos = rings.allocate_rings(SLOTS, WINDOW, DIM, torch.bfloat16, device)
    positions = torch.tensor(step["positions"], device=device)
    plan = plan_for(step, device)
    rejected = torch.tensor(step["rejected"], device=device)
    pp.ingest_packed_prefill(
        plan.packed,
        plan.store,
        features.to(device),
        positions,
        project,
        (cache, cache_pos),
        max_model_len=4096,
        accepted=dr.last_accepted(plan.store, positions, rejected),
    )
    ref_c, ref_p = rings.allocate_rings(SLOTS, WINDOW, DIM, torch.bfloat16, "cpu")
    # The device's own projection of the same N rows: this checks routing, not matmul.
    kv = project(features.to(device), positions).cpu()
    reference_store(
        ref_c, ref_p, kv, step["positions"], step["qsl"], step["slots"], step["rejected"]
    )
    same = torch.equal(cache_pos[:SLOTS].cpu(), ref_p[:SLOTS])
    same = same and torch.equal(
        cache[:SLOTS].cpu().view(torch.int16), ref_c[:SLOTS].view(torch.int16)
    )
    return {"passed": bool(same)}


def markov_inputs(device, rows=4, vocab=50, rank=8):
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(rows, K, vocab, generator=gen).to(device)
    w1 = torch.randn(vocab, rank, generator=gen).to(device)
    w2 = torch.randn(rank, vocab, generator=gen).to(device)
    anchor = torch.randint(0, vocab, (rows,), generator=gen).to(device)
    return logits, anchor, w1, w2


def check_markov(device):
    logits, anchor, w1, w2 = markov_inputs(device)
    out = markov.markov_block_sample(logits, anchor, lambda t: w1[t], lambda e: e @ w2)
    want = []
    for r in range(logits.shape[0]):
        prev, row = int(anchor[r]), []
        for k in range(K):
            z = logits[r, k].float().cpu() + w1[prev].cpu() @ w2.cpu()
            prev = int(z.argmax())
            row.append(prev)
        want.append(row)
    return {"passed": out.tokens.cpu().tolist() == want}


def device_half(step, device, cache, cache_pos, plan, kv, positions, rejected, markov_args):
    """Store + anchors + window mask + Markov sampling: what a captured step replays."""
    accepted = dr.last_accepted(plan, positions, rejected)
    dr.store_context_kv(cache, cache_pos, kv, positions, plan, accepted)
    anchor_pos = accepted.last_pos + 1
    mask = dr.window_mask(cache_pos, plan.slots, anchor_pos, WINDOW)
    logits, anchor, w1, w2 = markov_args
    tokens = markov.markov_block_sample(logits, anchor, lambda t: w1[t], lambda e: e @ w2).tokens
    return mask, tokens


def check_sync_free(device):
    if device.type != "cuda":
        return {"passed": None, "skipped": "sync debug mode needs CUDA"}
    step = make_step([K + 1, 9, 2, 30], [1, 0, 1, 0], seed=5)
    cache, cache_pos, plan, (kv, positions, _, rejected) = device_store(step, device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        device_half(
            step, device, cache, cache_pos, plan, kv, positions, rejected, markov_inputs(device)
        )
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        return {"passed": True}
    except RuntimeError as err:
        return {"passed": False, "error": str(err)[:300]}
    finally:
        torch.cuda.set_sync_debug_mode("default")


def check_adaptive_rule(device):
    gen = torch.Generator().manual_seed(7)
    rows, k = 6, K
    # Multiples of 1/4: survivals (at most 4 factors) and their sums are exact in float32.
    confidence = torch.randint(0, 5, (rows, k), generator=gen).float() / 4
    eligible = torch.tensor([True, True, False, True, True, True])
    whole = torch.tensor([False, True, False, False, False, False])
    competing = eligible & ~whole
    # A measured-looking step time: a fixed part plus 5% of it per verify row.
    max_drafts = int((competing | whole).sum()) * k
    step_ms = 1.0 + 0.05 * (rows + torch.arange(max_drafts + 1, dtype=torch.float32))

    def rule(dev):
        keep = adaptive.draft_budget_mask(
            confidence.to(dev), competing.to(dev), num_ranked=int((competing | whole).sum()),
            num_whole_drafts=k * int(whole.sum()), max_drafts=max_drafts,
            step_ms=step_ms.to(dev), min_gain=0.04, whole=whole.to(dev),
            cutting=torch.zeros((), dtype=torch.bool, device=dev),
        )
        return keep, adaptive.draft_budgets(keep, (competing | whole).to(dev))

    want_keep, want_budgets = rule(torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        keep, budgets = rule(device)
    except RuntimeError as err:
        return {"passed": False, "error": str(err)[:300]}
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    same = torch.equal(keep.cpu(), want_keep) and torch.equal(budgets.cpu(), want_budgets)
    return {"passed": bool(same), "budgets": want_budgets.tolist()}


def check_graph_replay(device):
    if device.type != "cuda":
        return {"passed": None, "skipped": "CUDA-graph capture needs CUDA"}
    step = make_step([K + 1] * 4, [1, 0, 2, 4], seed=6)
    cache, cache_pos, plan, (kv, positions, _, rejected) = device_store(step, device)
    markov_args = markov_inputs(device)
    eager = [t.clone() for t in (cache, cache_pos)]
    static = [t.clone() for t in (cache, cache_pos)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph, as capture requires
        device_half(
            step, device, *[t.clone() for t in static], plan, kv, positions, rejected, markov_args
        )
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_mask, g_tokens = device_half(
            step, device, *static, plan, kv, positions, rejected, markov_args
        )
    new_rej = torch.tensor([0, 3, 1, 2], device=device)
    rejected.copy_(new_rej)
    graph.replay()
    e_mask, e_tokens = device_half(step, device, *eager, plan, kv, positions, new_rej, markov_args)
    torch.cuda.synchronize()
    same = torch.equal(g_mask, e_mask) and torch.equal(g_tokens, e_tokens)
    same = same and all(torch.equal(a, b) for a, b in zip(static, eager, strict=True))
    return {"passed": bool(same)}


def time_paths(device, repeats=20):
    lengths = [K + 1] * 64
    step = make_step(lengths, [i % (K + 1) for i in range(64)], seed=7)
    out = {}
    for name, flat in (("flat", True), ("ragged", False)):
        cache, cache_pos, plan, args = device_store(step, device, flat)
        samples = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            store(cache, cache_pos, *args)
            if device.type == "cuda":
                torch.cuda.synchronize()
            samples.append((time.perf_counter() - start) * 1e3)
        out[name] = sorted(samples)[len(samples) // 2]
    return {"passed": None, "rows": sum(lengths), **{f"{k}_ms": v for k, v in out.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--out", type=Path, required=True, help="JSON report")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible to torch", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    uniform = make_step([K + 1] * 6, [0, 1, 2, 3, 4, 0], seed=1)
    mixed = make_step([K + 1, 40, 1, 200, 3], [2, 0, 0, 0, 1], seed=2)
    checks = {
        "store_flat": check_store(uniform, device),
        "store_ragged": check_store(mixed, device),
        "store_ragged_forced_on_uniform": check_store(uniform, device, ragged_forced=True),
        "window_mask_and_anchors": check_mask_and_anchors(mixed, device),
        "packed_ingest_tp1": check_packed(device),
        "markov_greedy": check_markov(device),
        "adaptive_rule": check_adaptive_rule(device),
        "sync_free": check_sync_free(device),
        "graph_replay": check_graph_replay(device),
        "flat_vs_ragged_ms": time_paths(device),
    }
    failed = [name for name, c in checks.items() if c["passed"] is False]
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "checks": checks,
        "failed": failed,
        "passed": not failed,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for name, c in checks.items():
        state = {True: "ok", False: "FAILED", None: c.get("skipped", "reported")}[c["passed"]]
        print(f"{name:32s} {state}")
    print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
