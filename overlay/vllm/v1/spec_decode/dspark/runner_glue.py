"""V1 runner glue for DSpark, called from the overlay's runner patch: the only code that
knows the runner's internals. Host facts come from the runner's host copies; rejection
counts and anchors are computed on the device from the sampled tokens and never read back.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.v1.outputs import AsyncModelRunnerOutput
from vllm.v1.spec_decode.dspark.step_plan import DSparkStepInput

__all__ = ["before_step", "propose_from_runner", "with_draft_budgets"]


def before_step(runner: Any, scheduler_output: Any) -> None:
    """Every step, scheduled or not (an idle server must hold no ring rows): get the cost
    table (once), release every request that left, reported by the scheduler or no longer
    held by the runner, and publish DSpark's metrics."""
    from vllm.v1.spec_decode.dspark.metrics import publish_dspark_metrics

    drafter = runner.drafter
    drafter.prepare_cost_table(runner)
    departed = set(scheduler_output.finished_req_ids)
    departed |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
    departed |= {rid for rid in drafter.live_request_ids if rid not in runner.requests}
    drafter.release(departed)
    publish_dspark_metrics(drafter, runner.vllm_config)


def _sampled_tensor(sampled_token_ids: torch.Tensor | list[list[int]], num_reqs: int, device):
    """The sampled tokens as a ``[R, k+1]`` device tensor, -1 where nothing was sampled."""
    if isinstance(sampled_token_ids, torch.Tensor):
        return sampled_token_ids[:num_reqs]
    # Host lists (the runner's padded drafter batch disabled): one copy.
    width = max((len(t) for t in sampled_token_ids[:num_reqs]), default=1) or 1
    padded = np.full((num_reqs, width), -1, dtype=np.int64)
    for i, toks in enumerate(sampled_token_ids[:num_reqs]):
        padded[i, : len(toks)] = toks
    return torch.from_numpy(padded).to(device, non_blocking=True)


def propose_from_runner(
    runner: Any, scheduler_output: Any, sampled_token_ids: torch.Tensor | list[list[int]],
    sampling_metadata: Any, aux_hidden_states: list[torch.Tensor] | None,
    spec_decode_metadata: Any, common_attn_metadata: Any,
) -> torch.Tensor:
    """The step's state (``sampled_token_ids [R, k+1]``, -1 = rejected) as one
    ``DSparkStepInput``, proposed: ``[R, k]`` int32 drafts."""
    drafter = runner.drafter
    if aux_hidden_states is None:
        raise RuntimeError("DSpark needs the target's aux hidden states (runner did not emit them)")
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    req_ids = list(batch.req_ids[:num_reqs])
    num_rows = int(scheduler_output.total_num_scheduled_tokens)
    device = drafter.device

    discard_np = runner.discard_request_mask.np[:num_reqs].copy()
    discard = runner.discard_request_mask.gpu[:num_reqs]
    if spec_decode_metadata is not None:
        num_drafts = np.asarray(spec_decode_metadata.num_draft_tokens, dtype=np.int64)
        cu = spec_decode_metadata.cu_num_draft_tokens[:num_reqs].long()
        drafts_dev = torch.diff(cu, prepend=cu.new_zeros(1))
    else:
        num_drafts = np.zeros(num_reqs, dtype=np.int64)
        drafts_dev = torch.zeros(num_reqs, dtype=torch.int64, device=device)

    sampled = _sampled_tensor(sampled_token_ids, num_reqs, device)
    valid = ((sampled >= 0) & (sampled < batch.vocab_size)).sum(dim=1)
    valid = torch.where(discard, 0, valid)
    # Rows of request r: its new tokens, the last of which is followed by its drafts;
    # of the d verified drafts, valid - 1 were accepted, the rest rejected.
    num_rejected = torch.where(valid > 0, drafts_dev + 1 - valid, 0)
    anchors = sampled.gather(1, (valid - 1).clamp(min=0)[:, None]).squeeze(1).long()
    if discard_np.any():
        # The next prompt token of a request still in chunked prefill (host state).
        backup = np.zeros(num_reqs, dtype=np.int64)
        for i in np.flatnonzero(discard_np):
            state = runner.requests[req_ids[i]]
            nxt = state.num_computed_tokens + scheduler_output.num_scheduled_tokens[req_ids[i]]
            backup[i] = state.get_token_id(nxt)
        anchors = torch.where(
            discard, torch.from_numpy(backup).to(device, non_blocking=True), anchors
        )
    runner._copy_valid_sampled_token_count(anchors.to(torch.int32), valid.to(torch.int32))

    temperature = temperature_cpu = None
    if not sampling_metadata.all_greedy and sampling_metadata.temperature is not None:
        temperature = sampling_metadata.temperature[:num_reqs]
        temperature_cpu = batch.temperature_cpu[:num_reqs]
    seeds = None
    if drafter.probabilistic or drafter.adaptive:
        seeds = [runner.requests[rid].sampling_params.seed for rid in req_ids]
    # The runner's numpy view of query_start_loc_cpu: read without a conversion.
    step = DSparkStepInput(
        req_ids=req_ids, query_start_loc_cpu=runner.query_start_loc.np[: num_reqs + 1],
        num_draft_tokens=num_drafts, prefilling=discard_np,
        positions=runner._get_positions(num_rows),
        aux_hidden_states=torch.cat([h[:num_rows] for h in aux_hidden_states], dim=-1),
        num_rejected=num_rejected, next_token_ids=anchors, temperature=temperature,
        temperature_cpu=temperature_cpu, request_seeds=seeds,
    )
    return drafter.propose(step)


class _OutputWithDraftBudgets(AsyncModelRunnerOutput):
    """An async step output that also carries adaptive verification's draft budgets: their
    copy is queued next to the sampled tokens' and read in ``get_output``, off the step's
    critical path, so the step never waits for it."""

    def __init__(self, inner: AsyncModelRunnerOutput, budgets: torch.Tensor) -> None:
        self._inner = inner
        self._budgets_cpu = budgets.to("cpu", non_blocking=True)
        self._copied = None
        if budgets.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def __getattr__(self, name: str) -> Any:
        # Later readers (sampled_token_ids_cpu, ...) still get the inner's attributes.
        return getattr(self._inner, name)

    def get_output(self):
        output = self._inner.get_output()
        if self._copied is not None:
            self._copied.synchronize()
        budgets = self._budgets_cpu.tolist()  # a host copy, read in the output thread
        output.dspark_draft_budgets = {
            rid: b for rid, b in zip(output.req_ids, budgets, strict=True) if b >= 0
        }
        return output


def with_draft_budgets(async_output: Any, drafter: Any) -> Any:
    """``async_output`` carrying the drafter's budgets of this step, when it made any."""
    budgets = drafter.take_draft_budgets()
    return async_output if budgets is None else _OutputWithDraftBudgets(async_output, budgets)
