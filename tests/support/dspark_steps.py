"""Observe DSpark proposer steps from the outside (the product keeps no observer seam).

``observe_steps(drafter, callback)`` wraps one proposer's ``propose`` so that after each
step ``callback`` gets a :class:`DSparkStepRecord`: what went in, the KV every row
projected to (recomputed here with the draft's own projection on the same rows, so the
same shapes and kernels), and the requests' rings after the store. Reading device
tensors here is fine: this is test code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class DSparkStepRecord:
    """What one step did."""

    req_ids: list[str]
    slots: torch.Tensor  # [R] ring rows
    query_start_loc: torch.Tensor  # [R+1]
    positions: torch.Tensor  # [T]
    input_ids: torch.Tensor | None  # [T] target input tokens of the rows, if known
    context_kv: torch.Tensor  # [T, K, D] projected KV of every row (stored or not)
    num_rejected: torch.Tensor  # [R]
    anchor_positions: torch.Tensor  # [R]
    anchor_tokens: torch.Tensor  # [R]
    draft_tokens: torch.Tensor  # [R, num_speculative_tokens]
    ring: torch.Tensor  # [R, W, K, D] the requests' rings after the store
    ring_pos: torch.Tensor  # [R, W]
    window: torch.Tensor  # [R, W] the cells the block attended


def observe_steps(
    drafter,
    callback: Callable[[DSparkStepRecord], None] | None,
    input_ids: Callable[[int], torch.Tensor] | None = None,
) -> None:
    """Call ``callback(record)`` after every ``drafter.propose``; ``None`` stops observing.

    ``input_ids(num_rows)`` gives the step's target input tokens (e.g. from the runner).
    """
    drafter.__dict__.pop("propose", None)
    if callback is None:
        return
    propose = drafter.propose

    def observed(step):
        drafts = propose(step)
        callback(_record(drafter, step, drafts, input_ids))
        return drafts

    drafter.propose = observed


def _record(drafter, step, drafts, input_ids) -> DSparkStepRecord:
    from vllm.forward_context import set_forward_context
    from vllm.v1.spec_decode.dspark.context_store import window_mask

    qsl = torch.as_tensor(step.query_start_loc_cpu).long()
    num_rows = int(qsl[-1])
    req_ids = list(step.req_ids)
    # Every request of the step holds a row now: ``assign`` hands back the ones they hold.
    slots = torch.tensor(drafter.slot_table.assign(req_ids), dtype=torch.int64)
    positions = step.positions[:num_rows].long().cpu()
    rej = step.num_rejected.long().cpu()
    layers, dim = drafter.num_layers, drafter.head_dim
    with torch.inference_mode(), set_forward_context(None, drafter.vllm_config):
        kv = drafter._project(step.aux_hidden_states[:num_rows], step.positions[:num_rows])
    anchor = positions[qsl[1:] - 1 - rej] + 1
    kv_pos = drafter.kv_pos.cpu()
    ring = drafter.kv_cache.cpu()[slots].view(len(req_ids), drafter.window, layers, dim)
    return DSparkStepRecord(
        req_ids=req_ids,
        slots=slots,
        query_start_loc=qsl.clone(),
        positions=positions.clone(),
        input_ids=None if input_ids is None else input_ids(num_rows).cpu().clone(),
        context_kv=kv.view(num_rows, layers, dim).cpu().clone(),
        num_rejected=rej.clone(),
        anchor_positions=anchor,
        anchor_tokens=step.next_token_ids.cpu().clone(),
        draft_tokens=drafts.cpu().clone(),
        ring=ring.clone(),
        ring_pos=kv_pos[slots].clone(),
        window=window_mask(kv_pos, slots, anchor, drafter.window),
    )


def dspark_counters(worker) -> dict[str, int]:
    """``LLM.collective_rpc(dspark_counters)``: the drafter's counters on a worker."""
    return worker.model_runner.drafter.counters.as_dict()
