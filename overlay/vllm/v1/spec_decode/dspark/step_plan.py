"""One DSpark engine step as a host plan plus device work that trusts it.

:func:`plan_step` looks at the step's host metadata once (``query_start_loc`` on the
CPU, the ring rows, the drafts each request verified, which requests are still in
chunked prefill, their temperatures), does every check there, decides the layout
(flat or ragged store, packed prefill or not, the padded draft batch) and ships all its
index tensors to the device in one copy. The device half (the store, the window mask,
the draft block) reads the plan's tensors and never reads device data back: the
rejection counts, positions and hidden states stay on the device.

Pure torch + numpy: importable without vLLM (``scripts/dev/gpu_check.py`` runs it on a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .context_store import AcceptedRows, StorePlan, last_accepted, ship, store_plan_arrays
from .packed_prefill import (
    MAX_PACKED_TOKENS,
    PackedPrefill,
    plan_packed_prefill,
)

__all__ = ["StepPlan", "capture_sizes", "draft_anchor_positions", "plan_step"]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded draft batch sizes: powers of two up to ``max_num_seqs``, then it."""
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return [*sizes, max_num_seqs]


@dataclass(frozen=True, eq=False)
class StepPlan:
    """Everything the device half of one step needs; host numbers and device tensors."""

    store: StorePlan  # ring store of the step's context rows (flat or ragged)
    packed: PackedPrefill | None  # set when a prefill chunk goes through packed prefill
    draft_rows: int  # R padded to a capture size; pad rows draft from the scratch row
    draft_slots: torch.Tensor  # [draft_rows] ring row per draft row (pads: scratch row S)
    drafting: torch.Tensor  # [draft_rows] 1 where the drafts reach the scheduler, else 0
    whole: torch.Tensor  # [draft_rows] 1 where adaptive verification must keep all k drafts
    num_discarded: int  # requests still in chunked prefill (their drafts are dropped)
    num_whole: int  # drafting requests whose drafts are never cut (seeded sampled ones)
    num_verified: int  # draft tokens the target verified this step
    num_sampled: int  # requests drafting at temperature > 0

    @property
    def num_requests(self) -> int:
        return self.store.num_requests

    @property
    def num_rows(self) -> int:
        return self.store.num_rows


def plan_step(
    query_start_loc_cpu: torch.Tensor | np.ndarray,
    slots: Sequence[int],
    *,
    num_draft_tokens: Sequence[int] | np.ndarray | None,
    prefilling: Sequence[bool] | np.ndarray | None,
    temperature_cpu: torch.Tensor | np.ndarray | None,
    window: int,
    whole: Sequence[bool] | np.ndarray | None = None,
    num_slots: int,
    num_spec_tokens: int,
    draft_sizes: Sequence[int],
    tp_size: int = 1,
    rank: int = 0,
    group=None,
    device: torch.device | str = "cpu",
) -> StepPlan:
    """Check the step's host metadata and plan it; raises ValueError before any device work.

    ``num_draft_tokens[r]`` drafts of request ``r`` were verified, so at most that many
    of its rows can be rejected; a request in chunked prefill (``prefilling[r]``)
    rejects none. Every request keeps at least one row (its anchor). ``whole[r]``: request
    ``r``'s drafts are never cut by adaptive verification (a seeded sampled request).
    """
    # One host read: the step's layout (none when the runner hands its numpy view).
    num_requests = len(slots)
    qsl = query_start_loc_cpu
    if isinstance(qsl, torch.Tensor) and qsl.device.type == "cpu":
        qsl = qsl.numpy()
    if not isinstance(qsl, np.ndarray) or qsl.shape != (num_requests + 1,):
        got = query_start_loc_cpu
        got = (
            f"shape {tuple(got.shape)} on {getattr(got, 'device', 'cpu')}"
            if hasattr(got, "shape")
            else type(got).__name__
        )
        raise ValueError(
            f"query_start_loc_cpu must be a host tensor or numpy array [R+1] with "
            f"R={num_requests}, got {got}"
        )
    discard = _flags("prefilling", prefilling, num_requests)
    drafts = _flags("num_draft_tokens", num_draft_tokens, num_requests, np.int64)
    if (drafts < 0).any() or (drafts > num_spec_tokens).any():
        raise ValueError(f"num_draft_tokens must be in [0, k={num_spec_tokens}]")
    bound = np.where(discard, 0, drafts)
    if num_requests and (bound >= np.diff(qsl)).any():
        raise ValueError(
            "num_draft_tokens[r] must be < segment length qsl[r+1] - qsl[r] "
            "(each request keeps its anchor row)"
        )
    arrays, store = store_plan_arrays(qsl, slots, bound, window, num_slots)
    draft_rows = next((size for size in draft_sizes if size >= num_requests), None)
    if draft_rows is None:
        raise ValueError(f"R={num_requests} requests exceed the largest draft size {draft_sizes}")
    pad = np.full(draft_rows - num_requests, num_slots, dtype=np.int64)
    arrays["draft_slots"] = np.concatenate([arrays["slots"], pad])
    arrays["drafting"] = np.concatenate([~discard, np.zeros(pad.size, dtype=bool)])
    whole_rows = _flags("whole", whole, num_requests) & ~discard
    arrays["whole"] = np.concatenate([whole_rows, np.zeros(pad.size, dtype=bool)])

    packed = None
    if num_requests * (num_spec_tokens + 1) < store["num_rows"] <= MAX_PACKED_TOKENS:
        # A prefill chunk is in this step: packed multi-request prefill.
        packed = plan_packed_prefill(qsl, tp_size, rank=rank, group=group)
    num_sampled = 0
    if temperature_cpu is not None:
        temperature = np.asarray(temperature_cpu)
        if temperature.shape != (num_requests,):
            raise ValueError(
                f"temperature_cpu must have shape [R] with R={num_requests}, "
                f"got {temperature.shape}"
            )
        num_sampled = int((temperature > 0).sum())
    tensors = ship(arrays, device)
    draft_slots = tensors.pop("draft_slots")
    drafting = tensors.pop("drafting")
    whole_dev = tensors.pop("whole")
    return StepPlan(
        store=StorePlan(**store, **tensors),
        packed=packed,
        draft_rows=draft_rows,
        draft_slots=draft_slots,
        drafting=drafting,
        whole=whole_dev,
        num_discarded=int(discard.sum()),
        num_whole=int(whole_rows.sum()),
        num_verified=int(drafts.sum()),
        num_sampled=num_sampled,
    )


def _flags(name: str, values, num_requests: int, dtype=bool) -> np.ndarray:
    """Per-request host values as numpy ``[R]`` (zeros when None)."""
    if values is None:
        return np.zeros(num_requests, dtype=dtype)
    array = np.asarray(values, dtype=dtype)
    if array.shape != (num_requests,):
        raise ValueError(f"{name} must have shape [R] with R={num_requests}, got {array.shape}")
    return array


def draft_anchor_positions(
    plan: StepPlan,
    positions: torch.Tensor,
    num_rejected: torch.Tensor,
    accepted: AcceptedRows | None = None,
) -> torch.Tensor:
    """``[draft_rows]`` position after each request's last accepted row; 0 for pad rows.

    The draft block of request ``r`` starts there; an anchor of 0 attends no context,
    so pad rows read nothing live. Device work on the plan's tensors, no host read.
    ``accepted``: :func:`last_accepted` of this step, when the caller already has it.
    """
    if accepted is None:
        accepted = last_accepted(plan.store, positions, num_rejected)
    last_pos = accepted.last_pos
    return torch.nn.functional.pad(last_pos + 1, (0, plan.draft_rows - plan.num_requests))
