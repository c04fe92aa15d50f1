"""Real torch.distributed ranks (gloo on 127.0.0.1) for tests of the TP row split.

``spawn_ranks`` starts one process per rank, each running ``target(rank, port, out_dir)``,
retries once if another test took the port, and returns what each rank saved. A target calls
``run_rank`` with its own work: the rank joins the group, does the work, saves the result as
``rank{r}.pt``, and on any error writes its traceback beside it for the parent to report.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.support.net import free_port


def run_rank(rank: int, world_size: int, port: int, out_dir: str,
             work: Callable[[object], object], timeout_s: float = 90) -> None:
    """Join the gloo group, ``torch.save(work(group))``, leave; inside a spawned rank."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    if os.path.isdir("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        torch.save(work(dist.group.WORLD), os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def spawn_ranks(target: Callable[[int, int, str], None], world_size: int,
                tmp_path_factory, join_s: float) -> list:
    """What each of ``world_size`` spawned ranks saved; fails the test with their errors."""
    ctx = multiprocessing.get_context("spawn")
    for attempt in range(2):  # a second try if another test grabbed the port
        out = tmp_path_factory.mktemp(f"tp{world_size}_{attempt}")
        port = free_port()
        procs = [ctx.Process(target=target, args=(r, port, str(out)), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=join_s)
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
            p.join(5)
        errors = "\n".join(f.read_text() for f in sorted(out.glob("*.err")))
        if not hung and all(p.exitcode == 0 for p in procs):
            return [torch.load(out / f"rank{r}.pt") for r in range(world_size)]
        if "ddress already in use" not in errors or attempt:
            pytest.fail(f"TP={world_size} ranks failed (hung={len(hung)}):\n{errors}")
    raise AssertionError("unreachable")
