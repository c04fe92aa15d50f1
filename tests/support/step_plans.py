"""Store plans made through the product's planner, for tests of the ring store and ingestion.

``plan_step`` is the one place a step is checked and laid out; a test that wants only the
store half of a step describes it here as the runner would (verified drafts bound the rows a
request may reject, nobody in chunked prefill, everyone greedy) and keeps ``plan.store``.
"""

from __future__ import annotations

import numpy as np

from tests.support.overlay import load_overlay_module

step_plan = load_overlay_module("vllm/v1/spec_decode/dspark/step_plan.py")


def plan_for_store(qsl, slots, max_rejected=None, *, window: int, num_slots: int, tp_size=1,
                   rank=0, group=None, device="cpu"):
    """``plan_step`` of a step whose request ``r`` verified ``max_rejected[r]`` drafts."""
    qsl = qsl if hasattr(qsl, "shape") else np.asarray(qsl)  # its dtype is checked there
    num_requests = len(slots)
    bound = np.zeros(num_requests, np.int64) if max_rejected is None else np.asarray(max_rejected)
    return step_plan.plan_step(
        qsl,
        slots.tolist() if hasattr(slots, "tolist") else list(slots),
        num_draft_tokens=bound,
        prefilling=np.zeros(num_requests, dtype=bool),
        temperature_cpu=None,
        never_cut=None,
        window=window,
        num_slots=num_slots,
        num_spec_tokens=max(int(bound.max(initial=0)), 1),
        draft_sizes=[max(num_requests, 1)],
        tp_size=tp_size,
        rank=rank,
        group=group,
        device=device,
    )


def store_plan(qsl, slots, max_rejected=None, *, window: int, num_slots: int, device="cpu"):
    """The ring-store half of :func:`plan_for_store`."""
    return plan_for_store(
        qsl, slots, max_rejected, window=window, num_slots=num_slots, device=device
    ).store
