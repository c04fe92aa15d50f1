"""A guard that fails on every device-to-host read a GPU step would block on.

On a GPU, ``.item()``, ``int(t)``, ``bool(t)``, ``nonzero`` and boolean-mask indexing of a
device tensor wait for the device. On CPU there is no device to wait for, so the guard
catches the operators those calls dispatch to (``aten._local_scalar_dense``,
``aten.nonzero``) on any tensor: code that reads host metadata through numpy views and
host lists, as a GPU step must, passes; code that pulls a value out of a tensor fails.
(``.tolist()`` of a CPU tensor dispatches nothing; the meta-device tests cover it.)
"""

from __future__ import annotations

import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.nonzero_static.default,
    torch.ops.aten.masked_select.default,
}


class HostReadGuard(TorchDispatchMode):
    """Records every host read while active; ``reads`` lists (operator, where)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            where = traceback.extract_stack(limit=12)[:-1]
            frames = [f for f in where if "torch/" not in f.filename]
            self.reads.append((str(func), "".join(traceback.format_list(frames[-3:]))))
        return func(*args, **(kwargs or {}))
