"""Per-request KV rings of the DSpark draft and the host table that assigns them.

Each draft layer keeps a ring of the last ``W`` context positions per live request; row ``S``
is scratch: stores of rejected rows land there and nothing reads it. Pure torch + stdlib:
unit-tested without vLLM.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Sequence

import torch

__all__ = ["EMPTY_POS", "SlotTable", "SlotTableFullError", "allocate_rings", "clear_slots"]

EMPTY_POS = -1  # ``cache_pos`` of a cell that holds no context


def allocate_rings(
    num_slots: int, window: int, dim: int, dtype: torch.dtype, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache [S+1, W, D]`` (zeros) and ``cache_pos [S+1, W]`` (empty); row S is scratch."""
    cache = torch.zeros((num_slots + 1, window, dim), dtype=dtype, device=device)
    cache_pos = torch.full((num_slots + 1, window), EMPTY_POS, dtype=torch.int64, device=device)
    return cache, cache_pos


def clear_slots(cache_pos: torch.Tensor, slots: Iterable[int]) -> None:
    """Mark ring rows empty so a reused row exposes no old context; ``slots`` are host ints
    (from :meth:`SlotTable.release`): one fill per row, no index tensor to copy to the device."""
    for slot in slots:
        cache_pos[slot].fill_(EMPTY_POS)


class SlotTableFullError(RuntimeError):
    """More live requests than ring rows; raise max_num_seqs or the table size."""


class SlotTable:
    """Stable ring row per request id, on the host: vLLM reorders and condenses its persistent
    batch, so the ring follows the id. New ids get the lowest free row (a lone one: row 0)."""

    def __init__(self, num_slots: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        self.num_slots = num_slots
        self._slot_of: dict[Hashable, int] = {}
        self._free: list[int] = list(range(num_slots))  # heap: lowest free row first

    @property
    def held_ids(self):
        """The request ids holding a ring row (a live view)."""
        return self._slot_of.keys()

    def assign(self, req_ids: Sequence[Hashable]) -> list[int]:
        """Ring row per batch row; known ids keep theirs, new ids get one (all or nothing)."""
        req_ids = list(req_ids)
        if len(set(req_ids)) != len(req_ids):
            raise ValueError("req_ids must be distinct (one batch row per request)")
        new_ids = [r for r in req_ids if r not in self._slot_of]
        if len(new_ids) > len(self._free):
            raise SlotTableFullError(
                f"SlotTable is full: {len(new_ids)} new requests, {len(self._free)} free of "
                f"{self.num_slots} rows; release finished requests or size the table to "
                "max_num_seqs"
            )
        for req_id in new_ids:
            self._slot_of[req_id] = heapq.heappop(self._free)
        return [self._slot_of[r] for r in req_ids]

    def release(self, req_ids: Iterable[Hashable]) -> list[int]:
        """Free and return the rows of finished requests (ids without one skip); the caller
        clears them (:func:`clear_slots`) so a later owner cannot attend this context."""
        freed = []
        for req_id in req_ids:
            slot = self._slot_of.pop(req_id, None)
            if slot is not None:
                heapq.heappush(self._free, slot)
                freed.append(slot)
        return freed
