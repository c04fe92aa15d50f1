"""The self-test's CUDA-only checks: the draft block's graph replay and a sync-free proposer.

Both run inside the engine's workers (``engine.collective_rpc``), on every TP rank:

- ``graph_replay``: for each draft size whose CUDA graph was captured, the replayed block
  (``DSparkProposer.graphs.run``) must draft what the eager block (``draft_block``) drafts
  on the same inputs: greedy and sampled rows, slots and anchor positions spread over the
  rings the batch before left filled. Same kernels at the same shapes, so the drafts must
  agree and the float outputs agree to bf16 rounding (``GRAPH_RTOL``).
- ``no_host_read``: the proposer's ``propose`` runs under CUDA's sync debug mode ("warn")
  for a whole batch mixing prefill chunks, verify rows, greedy and seeded sampled requests;
  any device-to-host synchronisation it makes is recorded with the Python line that made
  it (only from the thread running ``propose``: async scheduling's output thread copies
  the sampled tokens to the host, legitimately, at the same time).
"""

from __future__ import annotations

import threading
import warnings

import torch

GRAPH_RTOL = 1e-2  # bf16 rounding of the same kernels' outputs, relative to their largest value
_PROBE = "_selftest_sync_probe"


def _inputs(drafter, size: int, gen: torch.Generator) -> tuple:
    """Draft rows over live ring rows: anchors, positions, half sampled (when probabilistic)."""
    vocab = drafter.model.shape.vocab_size
    top = max(1, drafter.max_model_len - drafter.num_speculative_tokens - 1)
    slots = torch.randint(0, drafter.max_num_seqs, (size,), generator=gen)
    anchors = torch.randint(0, vocab, (size,), generator=gen)
    anchor_pos = torch.randint(0, top, (size,), generator=gen)
    temperature = noise = None
    dev = drafter.device
    if drafter.graphs.temperature is not None:
        temperature = torch.where(torch.arange(size) % 2 == 0, 0.0, 0.8).to(dev)
        noise = drafter.draw_race_noise(torch.randint(0, 2**31, (size,), generator=gen),
                                        anchor_pos.to(dev))
    return slots.to(dev), anchors.to(dev), anchor_pos.to(dev), temperature, noise


def graph_replay_on_worker(worker) -> dict:
    """Replay against eager on this rank; ``{"captured": [...], "sizes": {size: facts}}``."""
    from vllm.forward_context import set_forward_context

    drafter = worker.model_runner.drafter
    graphs = drafter.graphs
    report: dict = {"captured": sorted(graphs.captured) if graphs else [], "sizes": {}}
    gen = torch.Generator().manual_seed(0)
    for size in report["captured"]:
        inputs = _inputs(drafter, size, gen)
        with torch.inference_mode():
            with set_forward_context(None, graphs.vllm_config):
                eager = [t.clone() for t in drafter.draft_block(*inputs)]
            replay = [t.clone() for t in graphs.run(*inputs)]
        tokens_equal = int((eager[0] == replay[0]).sum())
        worst = 0.0
        for want, got in zip(eager[1:], replay[1:], strict=True):
            scale = float(want.float().abs().max().clamp_min(1e-6))
            worst = max(worst, float((want.float() - got.float()).abs().max()) / scale)
        report["sizes"][size] = {"tokens": eager[0].numel(), "tokens_equal": tokens_equal,
                                 "worst_relative_diff": worst}
    return report


def graph_replay(engine) -> tuple[str, str]:
    """PASS when every rank captured graphs and each replays what the eager block drafts."""
    ranks = engine.collective_rpc(graph_replay_on_worker)
    return judge_graph_replay(ranks)


def judge_graph_replay(ranks: list[dict]) -> tuple[str, str]:
    bad, sizes = [], set()
    for rank, rep in enumerate(ranks):
        if not rep["captured"]:
            bad.append(f"rank {rank}: no draft-block graph captured (eager fallback: see the "
                       "engine log's 'CUDA graph capture failed' line)")
        for size, facts in rep["sizes"].items():
            sizes.add(size)
            if facts["tokens_equal"] != facts["tokens"] or facts["worst_relative_diff"] > GRAPH_RTOL:
                bad.append(f"rank {rank} size {size}: {facts['tokens_equal']}/{facts['tokens']} "
                           f"drafts equal, outputs differ by {facts['worst_relative_diff']:.2e} "
                           f"(allowed {GRAPH_RTOL:.0e})")
    if bad:
        return "FAIL", "; ".join(bad)
    worst = max((f["worst_relative_diff"] for r in ranks for f in r["sizes"].values()), default=0)
    return "PASS", (f"draft sizes {sorted(sizes)} replay the eager block on {len(ranks)} "
                    f"rank(s): drafts equal, outputs within {worst:.1e}")


def arm_sync_probe(worker) -> None:
    """Wrap this rank's ``propose`` so it runs under CUDA's sync debug mode, recording syncs."""
    drafter = worker.model_runner.drafter
    original = drafter.propose
    probe = {"calls": 0, "syncs": [], "original": original}

    def propose(*args, **kwargs):
        me = threading.get_ident()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            passthrough = warnings.showwarning

            def show(message, category, filename, lineno, file=None, line=None):
                if threading.get_ident() == me and "synchroniz" in str(message):
                    probe["syncs"].append(f"{filename}:{lineno}")
                else:
                    passthrough(message, category, filename, lineno, file, line)

            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return original(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                probe["calls"] += 1

    drafter.propose = propose
    setattr(drafter, _PROBE, probe)


def disarm_sync_probe(worker) -> dict:
    """Restore ``propose``; the probe's calls and the distinct lines that synchronised."""
    drafter = worker.model_runner.drafter
    probe = drafter.__dict__.pop(_PROBE)
    drafter.propose = probe["original"]
    return {"calls": probe["calls"], "syncs": sorted(set(probe["syncs"])),
            "count": len(probe["syncs"])}


def no_host_read(engine, run_batch) -> tuple[str, str]:
    """``run_batch()`` (the caller's mixed batch) with every rank's proposer probed."""
    engine.collective_rpc(arm_sync_probe)
    try:
        run_batch()
    finally:
        ranks = engine.collective_rpc(disarm_sync_probe)
    calls = sum(r["calls"] for r in ranks)
    syncs = [f"rank {i}: {r['count']} at {', '.join(r['syncs'])}"
             for i, r in enumerate(ranks) if r["count"]]
    if calls == 0:
        return "FAIL", "the proposer was never called (no DSpark step ran)"
    if syncs:
        return "FAIL", "device-to-host syncs inside propose: " + "; ".join(syncs)
    return "PASS", f"{calls} propose calls on {len(ranks)} rank(s), no device-to-host sync"
