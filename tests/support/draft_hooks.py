"""Replace the drafts a real DSpark proposer hands to vLLM, from the test side.

Oracle drafts (the plain target's own continuation), replayed outputs and corrupted drafts
make acceptance-dependent paths run on purpose. The proposer has no hook for this: the
harness wraps the instance's ``_draft`` (the step's draft block) and ``plan`` (which sees
the step's request ids in batch order) and restores both after.

``hook(req_ids=, anchor_positions=, anchor_tokens=, drafts=)`` gets the step's ``[R]``
anchor positions and tokens and the ``[R, k]`` drafts, and returns replacement drafts or
None (keep them). Replaced drafts carry no draft probabilities (the rejection sampler then
verifies them as it verifies n-gram drafts).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Hook = Callable[..., "torch.Tensor | None"]


def replace_drafts(drafter, hook: Hook) -> None:
    """From the next step on, ``hook`` may replace ``drafter``'s drafts."""
    block = type(drafter)._draft.__get__(drafter)
    planner = type(drafter).plan.__get__(drafter)
    step_ids: list = []

    def plan_remembering_ids(req_ids, step):
        step_ids[:] = req_ids
        return planner(req_ids, step)

    def _draft(plan, anchors, anchor_pos, temperature, noise):
        drafts = block(plan, anchors, anchor_pos, temperature, noise)
        num_reqs = plan.num_requests
        replaced = hook(
            req_ids=list(step_ids),
            anchor_positions=anchor_pos[:num_reqs],
            anchor_tokens=anchors[:num_reqs],
            drafts=drafts,
        )
        if replaced is None:
            return drafts
        drafter._last_probs = None
        return replaced.to(drafts.device, drafts.dtype)

    drafter.plan, drafter._draft = plan_remembering_ids, _draft


def restore_drafts(drafter) -> None:
    """The draft model's own drafts again."""
    drafter.__dict__.pop("plan", None)
    drafter.__dict__.pop("_draft", None)
