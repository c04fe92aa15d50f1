"""DSpark step counters: exact reads for reports, lagged reads (no device read) for metrics.

The oracle is a plain-Python tally of the same steps: the exact read must equal it now,
the lagged read must equal it as of the previous read (on CPU the copy completes at once),
and no field of the lagged read may ever go down (Prometheus counters only go up).
"""

from __future__ import annotations

import random
from dataclasses import fields

import torch
from vllm.v1.spec_decode.dspark.counters import DSparkCounters, StepCounters

from tests.support.host_reads import HostReadGuard


def _step(counters: StepCounters, tally: dict, rng: random.Random, num_rows: int) -> None:
    """One step's host counts and device rejections, mirrored in ``tally``."""
    slots = rng.sample(range(num_rows), rng.randint(1, num_rows))
    verified = [rng.randint(0, 4) for _ in slots]
    rejected = [rng.randint(0, v) for v in verified]
    rows = sum(verified) + len(slots)
    counters.host.steps += 1
    counters.host.ingested_rows += rows
    counters.host.verified_tokens += sum(verified)
    counters.host.accepted_tokens += sum(verified)
    counters.add_rejected(torch.tensor(slots), torch.tensor(rejected, dtype=torch.int32))
    tally["steps"] += 1
    tally["ingested_rows"] += rows - sum(rejected)
    tally["verified_tokens"] += sum(verified)
    tally["accepted_tokens"] += sum(verified) - sum(rejected)
    tally["rejected_rows"] += sum(rejected)


def test_exact_now_lagged_one_read_behind_never_decreasing():
    rng = random.Random(0)
    counters = StepCounters(num_rows=5, device="cpu")
    tally = dict.fromkeys((f.name for f in fields(DSparkCounters)), 0)
    previous = DSparkCounters()
    for _ in range(30):
        _step(counters, tally, rng, num_rows=5)
        assert counters.exact() == DSparkCounters(**tally)
        with HostReadGuard() as guard:
            lagged = counters.lagged()
        assert guard.reads == []
        assert lagged == previous
        assert all(getattr(lagged, f.name) >= getattr(previous, f.name) for f in fields(lagged))
        previous = DSparkCounters(**tally)
    # An idle step: the lagged read catches up, nothing moves backwards.
    assert counters.lagged() == DSparkCounters(**tally) == counters.exact()


def test_reset_starts_from_zero():
    counters = StepCounters(num_rows=3, device="cpu")
    _step(counters, dict.fromkeys((f.name for f in fields(DSparkCounters)), 0),
          random.Random(1), num_rows=3)  # fmt: skip
    counters.lagged()
    counters.reset()
    assert counters.exact() == DSparkCounters() == counters.lagged()
    assert counters.lagged() == DSparkCounters()
