"""DSpark's Prometheus series (listed in README.md, "Operating"), written by the worker.

Why not vLLM's stats path (runner output -> scheduler stats -> frontend): the step that
tells the runner its last requests finished schedules nothing and returns vLLM's shared
empty output, so an idle server's freed ring rows would never arrive. Instead TP rank 0 of
each engine writes with prometheus_client's multiprocess mode into ``PROMETHEUS_MULTIPROC_DIR``,
which vLLM's ``/metrics`` aggregates when it is set; without it nothing is exported (logged).
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from vllm.logger import init_logger

logger = init_logger(__name__)

__all__ = ["DSparkMetrics", "publish_dspark_metrics"]

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
LABELS = ("model_name", "engine")

# (series, extra label value or None) <- cumulative field of the drafter's DSparkCounters.
STEPS = {"flat": "flat_steps", "ragged": "ragged_steps", "packed": "packed_steps"}
CONTEXT_ROWS = {"stored": "ingested_rows", "rejected": "rejected_rows"}
DRAFTS_DISCARDED = "discarded_drafts"


class DSparkMetrics:
    """One engine's DSpark series; ``observe`` adds what the cumulative counters gained since
    its last call. A different counters object or a smaller count means they restarted."""

    def __init__(self, model_name: str, engine: str, registry: CollectorRegistry | None):
        labels = dict(model_name=model_name, engine=engine)
        steps = Counter(
            "vllm:dspark_steps",
            "DSpark context-ingestion steps by path (packed steps are also flat or ragged).",
            [*LABELS, "path"], registry=registry,
        )
        rows = Counter(
            "vllm:dspark_context_rows",
            "Context rows of DSpark steps: stored in a request's ring, or rejected verify "
            "rows that were never written.",
            [*LABELS, "kind"], registry=registry,
        )
        discarded = Counter(
            "vllm:dspark_drafts_discarded",
            "Draft tokens proposed for requests still in chunked prefill (the scheduler "
            "discards them).",
            list(LABELS), registry=registry,
        )
        in_use = Gauge(
            "vllm:dspark_ring_slots_in_use",
            "DSpark ring rows held by requests (0 on an idle server).",
            list(LABELS), registry=registry, multiprocess_mode="mostrecent",
        )
        total = Gauge(
            "vllm:dspark_ring_slots_total",
            "DSpark ring rows (max_num_seqs).",
            list(LABELS), registry=registry, multiprocess_mode="mostrecent",
        )
        self._counters = {field: steps.labels(**labels, path=path) for path, field in STEPS.items()}
        self._counters |= {
            field: rows.labels(**labels, kind=kind) for kind, field in CONTEXT_ROWS.items()
        }
        self._counters[DRAFTS_DISCARDED] = discarded.labels(**labels)
        self._slots_in_use = in_use.labels(**labels)
        self._slots_total = total.labels(**labels)
        self._last = dict.fromkeys(self._counters, 0)
        self._source: Any = None

    def observe(self, counters: Any, slots_in_use: int, slots_total: int) -> None:
        """Publish a DSparkCounters snapshot and the ring occupancy."""
        now = {field: int(getattr(counters, field)) for field in self._counters}
        if counters is not self._source or any(now[f] < self._last[f] for f in now):
            self._source, self._last = counters, dict.fromkeys(now, 0)
        for field, series in self._counters.items():
            series.inc(now[field] - self._last[field])
        self._last = now
        self._slots_in_use.set(slots_in_use)
        self._slots_total.set(slots_total)


_exporter: DSparkMetrics | None = None
_checked = False


def _tp_rank() -> int:
    from vllm.distributed import parallel_state as ps

    return ps.get_tensor_model_parallel_rank() if ps.model_parallel_is_initialized() else 0


def publish_dspark_metrics(drafter: Any, vllm_config: Any) -> None:
    """Runner hook, once per engine step: export the drafter's state (TP rank 0 only)."""
    global _exporter, _checked
    if not _checked:
        _checked = True
        if _tp_rank() != 0:
            return
        if not os.environ.get(MULTIPROC_ENV):
            logger.info(
                "DSpark metrics are not exported: set %s to an empty directory before "
                "starting the server (scripts/serve.py does) to see vllm:dspark_* on /metrics",
                MULTIPROC_ENV,
            )
            return
        _exporter = DSparkMetrics(
            model_name=str(vllm_config.model_config.served_model_name),
            engine=str(vllm_config.parallel_config.data_parallel_rank),
            registry=None,  # multiprocess mode: values go to files, /metrics reads them
        )
    if _exporter is not None:
        _exporter.observe(
            drafter.metrics_counters(), len(drafter.live_request_ids), drafter.max_num_seqs
        )
