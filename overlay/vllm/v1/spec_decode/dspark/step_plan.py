"""One DSpark engine step as a host plan plus device work that trusts it (overlay/README.md).

:func:`plan_step` reads the step's host metadata once, does every check, picks the layout (flat
or ragged store, packed prefill, the padded draft batch) and ships its index tensors to the
device in one copy; the device half never reads device data back. Pure torch + numpy:
importable without vLLM (``scripts/dev/gpu_check.py`` runs it on a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .context_store import AcceptedRows, StorePlan, ship, store_layout
from .packed_prefill import MAX_PACKED_TOKENS, PackedPrefill, plan_packed_prefill

__all__ = ["DSparkStepInput", "StepPlan", "capture_sizes", "draft_anchor_positions", "plan_step"]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded draft batch sizes: powers of two up to ``max_num_seqs``, then it."""
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return [*sizes, max_num_seqs]


@dataclass(frozen=True, eq=False)
class DSparkStepInput:
    """One engine step as the runner glue hands it to ``DSparkProposer.propose``.

    Host (read by the plan): ``req_ids [R]`` in batch-row order, ``num_draft_tokens [R]``
    drafts verified (bounds the rejections), ``prefilling [R]`` (drafts discarded, nothing
    rejected), ``temperature_cpu`` (None: all greedy), ``request_seeds [R]`` (None entries: one
    drawn; a seed keys the draft noise and keeps adaptive verification from cutting it).
    Device (never read back): ``aux_hidden_states [T, m*H]`` (concatenated target aux hidden
    states), ``num_rejected [R]`` rejected rows at each segment's end, ``next_token_ids`` anchors.
    """

    req_ids: Sequence[str]
    query_start_loc_cpu: np.ndarray
    num_draft_tokens: np.ndarray
    prefilling: np.ndarray
    positions: torch.Tensor
    aux_hidden_states: torch.Tensor
    num_rejected: torch.Tensor
    next_token_ids: torch.Tensor
    temperature: torch.Tensor | None = None
    temperature_cpu: np.ndarray | None = None
    request_seeds: Sequence[int | None] | None = None


@dataclass(frozen=True, eq=False)
class StepPlan:
    """Everything the device half of one step needs; host numbers and device tensors."""

    store: StorePlan  # ring store of the step's context rows (flat or ragged)
    packed: PackedPrefill | None  # set when a prefill chunk goes through packed prefill
    draft_rows: int  # R padded to a capture size; pad rows draft from the scratch row
    draft_slots: torch.Tensor  # [draft_rows] ring row per draft row (pads: scratch row S)
    drafting: torch.Tensor  # [draft_rows] 1 where the drafts reach the scheduler, else 0
    never_cut: torch.Tensor  # [draft_rows] 1 where adaptive verification keeps all k drafts
    verified: torch.Tensor  # [R] drafts the target verified this step (0 while prefilling)
    num_discarded: int  # requests still in chunked prefill (their drafts are dropped)
    num_never_cut: int  # drafting requests whose drafts are never cut (seeded sampled ones)
    num_verified: int  # draft tokens the target verified this step
    num_sampled: int  # requests drafting at temperature > 0

    @property
    def num_requests(self) -> int:
        return self.store.num_requests

    @property
    def num_rows(self) -> int:
        return self.store.num_rows


def plan_step(
    query_start_loc_cpu: np.ndarray, slots: Sequence[int], *, num_draft_tokens: np.ndarray,
    prefilling: np.ndarray, temperature_cpu: np.ndarray | None, never_cut: np.ndarray | None,
    window: int, num_slots: int, num_spec_tokens: int, draft_sizes: Sequence[int],
    tp_size: int = 1, rank: int = 0, group=None, device: torch.device | str = "cpu",
) -> StepPlan:
    """Check the step's host metadata and plan it; raises ValueError before any device work.

    Request ``r`` rejects at most ``num_draft_tokens[r]`` rows, none while ``prefilling[r]``,
    and keeps its anchor row. ``never_cut[r]``: adaptive verification keeps all its drafts.
    """
    num_requests = len(slots)
    qsl = _host_ints("query_start_loc_cpu", query_start_loc_cpu, num_requests + 1)
    if qsl[0] != 0:
        raise ValueError(f"query_start_loc_cpu[0] must be 0, got {qsl[0]}")
    lengths = np.diff(qsl)
    ring_rows = _host_ints("slots", slots, num_requests)
    if num_requests and (ring_rows.min() < 0 or ring_rows.max() >= num_slots):
        raise ValueError(f"slots must be in [0, S={num_slots})")
    if np.unique(ring_rows).size != num_requests:
        raise ValueError("slots must be distinct (one ring row per request)")
    discard = _flags("prefilling", prefilling, num_requests)
    drafts = _host_ints("num_draft_tokens", num_draft_tokens, num_requests)
    if (drafts < 0).any() or (drafts > num_spec_tokens).any():
        raise ValueError(f"num_draft_tokens must be in [0, k={num_spec_tokens}]")
    bound = np.where(discard, 0, drafts)
    if (bound >= lengths).any():
        r = int((bound >= lengths).argmax())
        raise ValueError(
            f"request {r} has {lengths[r]} rows (query_start_loc_cpu[{r + 1}] - "
            f"query_start_loc_cpu[{r}]) but {bound[r]} verified drafts: every request "
            "keeps its anchor row, so num_draft_tokens[r] must be < its row count"
        )
    arrays, store = store_layout(qsl, lengths, ring_rows, bound, window, num_slots)
    draft_rows = next((size for size in draft_sizes if size >= num_requests), None)
    if draft_rows is None:
        raise ValueError(f"R={num_requests} requests exceed the largest draft size {draft_sizes}")
    pad = np.zeros(draft_rows - num_requests, dtype=bool)
    arrays["draft_slots"] = np.concatenate([ring_rows, np.full(pad.size, num_slots)])
    arrays["drafting"] = np.concatenate([~discard, pad])
    keep_whole = _flags("never_cut", never_cut, num_requests) & ~discard
    arrays["never_cut"] = np.concatenate([keep_whole, pad])
    arrays["verified"] = bound

    packed = None
    if num_requests * (num_spec_tokens + 1) < store["num_rows"] <= MAX_PACKED_TOKENS:
        # A prefill chunk is in this step: packed multi-request prefill.
        packed = plan_packed_prefill(store["num_rows"], tp_size, rank, group)
    num_sampled = 0
    if temperature_cpu is not None:
        temperature = np.asarray(temperature_cpu)
        if temperature.shape != (num_requests,):
            raise ValueError(f"temperature_cpu must have shape [R] with R={num_requests}, "
                             f"got {temperature.shape}")
        num_sampled = int((temperature > 0).sum())
    tensors = ship(arrays, device)
    return StepPlan(
        store=StorePlan(**store, **{k: tensors[k] for k in ("slots", "seg_end", "cand_rows", "cand_req")}),
        packed=packed,
        draft_rows=draft_rows,
        draft_slots=tensors["draft_slots"],
        drafting=tensors["drafting"],
        never_cut=tensors["never_cut"],
        verified=tensors["verified"],
        num_discarded=int(discard.sum()),
        num_never_cut=int(keep_whole.sum()),
        num_verified=int(drafts.sum()),
        num_sampled=num_sampled,
    )


def _host_ints(name: str, values, size: int) -> np.ndarray:
    """A host ``[size]`` int64 array (from numpy, a CPU tensor or a sequence of ints)."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(f"{name} must be a host (CPU) array [{size}], got {values.device}")
        values = values.numpy()
    array = np.asarray(values)
    if array.shape != (size,):
        raise ValueError(f"{name} must have shape [{size}], got {array.shape}")
    if size and array.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got {array.dtype}")
    return array.astype(np.int64, copy=False)


def _flags(name: str, values, num_requests: int) -> np.ndarray:
    """Per-request host booleans as numpy ``[R]`` (all False when None)."""
    if values is None:
        return np.zeros(num_requests, dtype=bool)
    array = np.asarray(values, dtype=bool)
    if array.shape != (num_requests,):
        raise ValueError(f"{name} must have shape [R] with R={num_requests}, got {array.shape}")
    return array


def draft_anchor_positions(plan: StepPlan, accepted: AcceptedRows) -> torch.Tensor:
    """``[draft_rows]`` position after each request's last accepted row, where its draft block
    starts; 0 (attends no context) for pad rows. Device work, no host read."""
    return torch.nn.functional.pad(accepted.last_pos + 1, (0, plan.draft_rows - plan.num_requests))
