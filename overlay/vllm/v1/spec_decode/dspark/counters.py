"""DSpark's step counters: host bookkeeping of the step plan, except rejected rows, which
only the device knows (summed per ring row, one ``index_add_`` a step).

``exact()`` reads the device once (end-of-run reports); ``lagged()`` reads nothing back (the
per-step metrics): each call queues a non-blocking copy of the device total into pinned
memory, paired with the host counters of that moment, and returns the newest pair whose
copy has landed, an exact snapshot of an earlier step, so the series never go backwards.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

__all__ = ["DSparkCounters", "StepCounters"]


@dataclass
class DSparkCounters:
    """Cumulative step statistics; tests, the demo and the metrics read these, not logs."""

    steps: int = 0
    flat_steps: int = 0  # every request carried the same number of rows
    ragged_steps: int = 0  # rows per request differed (prefill chunks + verify rows)
    packed_steps: int = 0  # context went through the packed multi-request prefill
    ingested_rows: int = 0  # accepted context rows handed to the ring store
    rejected_rows: int = 0  # verify rows not stored because the target rejected them
    drafted_tokens: int = 0  # k per request past its prefill, before adaptive verification's cut
    sampled_draft_tokens: int = 0  # of all drafts, those sampled at temperature > 0
    discarded_drafts: int = 0  # drafts of requests still in chunked prefill
    verified_tokens: int = 0  # draft tokens the target verified this run
    accepted_tokens: int = 0  # of those, accepted
    released_slots: int = 0  # ring rows freed (finished / preempted requests)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def with_rejected(self, rejected: int) -> DSparkCounters:
        """A copy with ``rejected`` verify rows moved from stored and accepted to rejected."""
        return replace(
            self,
            rejected_rows=self.rejected_rows + rejected,
            ingested_rows=self.ingested_rows - rejected,
            accepted_tokens=self.accepted_tokens - rejected,
        )


class StepCounters:
    """The host counters plus the device's rejected-row total per ring row."""

    def __init__(self, num_rows: int, device: torch.device | str) -> None:
        device = torch.device(device)
        self.host = DSparkCounters()
        self.rejected_per_row = torch.zeros(num_rows, dtype=torch.int64, device=device)
        on_cuda = device.type == "cuda"
        self._mirror = torch.zeros(1, dtype=torch.int64, pin_memory=on_cuda)
        self._mirror_np = self._mirror.numpy()  # read without a torch op: host memory
        self._copy_done = torch.cuda.Event() if on_cuda else None
        self._in_flight: DSparkCounters | None = None  # host counters paired with the copy
        self._published = DSparkCounters()

    def add_rejected(self, slots: torch.Tensor, num_rejected: torch.Tensor) -> None:
        self.rejected_per_row.index_add_(0, slots, num_rejected.long())

    def exact(self) -> DSparkCounters:
        """Snapshot now (reads the device total once: not for per-step paths)."""
        return self.host.with_rejected(int(self.rejected_per_row.sum()))

    def lagged(self) -> DSparkCounters:
        """The newest completed snapshot; starts the next copy. No device read."""
        if self._copy_done is not None and self._in_flight is not None:
            if not self._copy_done.query():
                return self._published
        if self._in_flight is not None:
            self._published = self._in_flight.with_rejected(int(self._mirror_np[0]))
        self._in_flight = replace(self.host)
        self._mirror.copy_(self.rejected_per_row.sum().view(1), non_blocking=True)
        if self._copy_done is not None:
            self._copy_done.record()
        return self._published

    def reset(self) -> None:
        """Back to zero (a new measurement phase); waits for a copy still in flight."""
        if self._copy_done is not None:
            self._copy_done.synchronize()
        self.host = DSparkCounters()
        self.rejected_per_row.zero_()
        self._in_flight, self._published = None, DSparkCounters()
