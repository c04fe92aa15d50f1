"""Functions a test runs inside vLLM's TP worker processes (``engine.collective_rpc``).

They live in an importable module so the workers import them by name (a function of a
runner's ``__main__`` would travel by value).
"""

from __future__ import annotations

from tests.support.draft_hooks import replace_drafts
from tests.support.oracle_drafts import external_id


def install_scripted_drafts(worker, reference: dict[str, list[int]], scripted: list[str]) -> int:
    """Scripted drafts for ``scripted`` requests, and a recorder of packed ingests."""
    import torch
    from vllm.v1.spec_decode.dspark import proposer as proposer_module

    drafter = worker.model_runner.drafter
    calls = [0]

    def hook(*, req_ids, anchor_positions, anchor_tokens, drafts):
        k = drafts.shape[1]
        out = drafts.clone()
        for i, req_id in enumerate(req_ids):
            rid = external_id(req_id)
            seq, pos = reference[rid], int(anchor_positions[i])
            if rid not in scripted or pos + k >= len(seq) or seq[pos] != int(anchor_tokens[i]):
                continue
            cont = list(seq[pos + 1 : pos + 1 + k])
            cut = (calls[0] + i) % (k + 1)  # k: the whole block is right
            if cut < k:
                cont[cut] = (cont[cut] + 1) % 1000 + 9
            out[i] = torch.tensor(cont, dtype=drafts.dtype)
        calls[0] += 1
        return out

    replace_drafts(drafter, hook)
    ingest = proposer_module.ingest_packed_prefill
    worker._tp_packed_log = log = []

    def recording_ingest(plan, *args, **kwargs):
        log.append([plan.num_tokens, plan.num_padded, plan.rows_per_rank, plan.tp_size,
                    plan.rank, plan.rank_rows()[1]])
        return ingest(plan, *args, **kwargs)

    proposer_module.ingest_packed_prefill = recording_ingest
    drafter.reset_counters()
    return worker.rank


def rank_report(worker) -> dict:
    import hashlib

    import torch

    drafter = worker.model_runner.drafter
    rings = hashlib.sha256()
    for t in (drafter.kv_cache, drafter.kv_pos):
        rings.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return {
        "rank": worker.rank,
        "counters": drafter.counters.as_dict(),
        "packed": worker._tp_packed_log,
        "rings": rings.hexdigest(),
    }


# Served steps that take REFIT_A ms + REFIT_B x the table's time, fed to rank 0 alone.
REFIT_A, REFIT_B = 250.0, 0.5


def refit_from_rank_zero(worker) -> dict | None:
    """Rank 0 alone observes synthetic served steps, then every rank refits together (the
    proposer's own ``_refit``, as at every 64th step): the fit must reach every rank."""
    from vllm.distributed import get_tensor_model_parallel_rank

    drafter = worker.model_runner.drafter
    if drafter._base_ms is None:
        return None
    if get_tensor_model_parallel_rank() == 0:
        drafter.served = type(drafter.served)(clock=drafter.served.clock)  # synthetic steps only
        table = drafter._base_ms[1:, 1:]
        finite = table[table < float("inf")]  # over a row budget: inf
        low, high = float(finite.min()), float(finite.max())
        for i in range(64):
            x = low + (high - low) * (i % 8) / 7
            drafter.served.observe(x, REFIT_A + REFIT_B * x)
    drafter._refit()
    return {"fitted": drafter.served.fitted, "pinned": drafter.served.pinned,
            "step_ms": drafter._step_ms.tolist(),
            "rule_on": drafter.rule_on}
