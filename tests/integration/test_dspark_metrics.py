"""DSpark's Prometheus series: the worker-side exporter (overlay ``dspark_metrics``) and the
client-side parser (``scripts/node/metrics.py``), checked against the counters fed in.

The exporter is driven with the proposer's own ``DSparkCounters``; the oracle for every
published value is the snapshot that was fed, read back through prometheus_client's text
exposition (in-process registry, or the multiprocess collector vLLM's /metrics uses).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import fields

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from vllm.v1.spec_decode.dspark.counters import DSparkCounters
from vllm.v1.spec_decode.dspark.metrics import CONTEXT_ROWS, STEPS, DSparkMetrics

from scripts.node.metrics import dspark_delta, dspark_snapshot, format_dspark

PUBLISHED = [*STEPS.values(), *CONTEXT_ROWS.values(), "discarded_drafts"]


def expected_snapshot(totals: dict[str, int], in_use: int, total: int) -> dict:
    """What /metrics must say, written from DSparkCounters field names."""
    return {
        "steps": {path: float(totals[field]) for path, field in STEPS.items()},
        "context_rows": {kind: float(totals[field]) for kind, field in CONTEXT_ROWS.items()},
        "drafts_discarded": float(totals["discarded_drafts"]),
        "ring_slots_in_use": float(in_use),
        "ring_slots_total": float(total),
    }


def page(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def test_published_fields_exist_on_the_proposers_counters():
    names = {f.name for f in fields(DSparkCounters)}
    assert set(PUBLISHED) <= names


# A run = epochs (one drafter each: a new drafter's counters restart from zero, and may
# climb past the old ones before the next scrape), each a list of per-field increments
# applied one step at a time; the published series add up over all epochs.
steps_strategy = st.lists(
    st.lists(
        st.fixed_dictionaries({f: st.integers(0, 50) for f in PUBLISHED}), min_size=1, max_size=6
    ),
    min_size=1,
    max_size=3,
)


@settings(max_examples=40, deadline=None)
@given(epochs=steps_strategy, in_use=st.integers(0, 8))
def test_counters_become_monotone_series(epochs, in_use):
    registry = CollectorRegistry()
    metrics = DSparkMetrics("m", "0", registry)
    published = dict.fromkeys(PUBLISHED, 0)  # what Prometheus must have counted in all
    for epoch in epochs:
        counters = DSparkCounters()
        for increments in epoch:
            for field, inc in increments.items():
                setattr(counters, field, getattr(counters, field) + inc)
                published[field] += inc
            metrics.observe(counters, in_use, 8)
            # Each step's page must equal the running total (so a scrape at any time is right).
            assert dspark_snapshot(page(registry)) == expected_snapshot(published, in_use, 8)


def test_series_carry_vllm_labels():
    registry = CollectorRegistry()
    DSparkMetrics("tiny", "3", registry).observe(DSparkCounters(flat_steps=2), 1, 8)
    text = page(registry)
    assert 'vllm:dspark_steps_total{engine="3",model_name="tiny",path="flat"} 2.0' in text
    assert 'vllm:dspark_ring_slots_in_use{engine="3",model_name="tiny"} 1.0' in text


# The worker: the exporter module only (no proposer import, which takes a minute to load);
# its counters are a stand-in with DSparkCounters' field names, checked above.
CHILD = textwrap.dedent(
    """
    import sys
    from types import SimpleNamespace
    import vllm.v1.spec_decode.dspark.metrics as dm

    dm._tp_rank = lambda: int(sys.argv[1])
    config = SimpleNamespace(
        model_config=SimpleNamespace(served_model_name="tiny"),
        parallel_config=SimpleNamespace(data_parallel_rank=0),
    )
    counters = SimpleNamespace(flat_steps=3, ragged_steps=2, packed_steps=1, ingested_rows=40,
                               rejected_rows=7, discarded_drafts=12)
    drafter = SimpleNamespace(metrics_counters=lambda: counters, live_request_ids={"a", "b"}, max_num_seqs=8)
    dm.publish_dspark_metrics(drafter, config)
    counters.ragged_steps += 5
    drafter.live_request_ids.clear()  # released: the idle server's gauge must read 0
    dm.publish_dspark_metrics(drafter, config)
    """
)


def run_worker(tmp_path, tp_rank: int, multiproc_dir: str | None) -> str:
    """Publish from a separate process (as a vLLM worker does); return the /metrics text."""
    env = {"PATH": "/usr/bin:/bin"}
    if multiproc_dir is not None:
        env["PROMETHEUS_MULTIPROC_DIR"] = multiproc_dir
    subprocess.run([sys.executable, "-c", CHILD, str(tp_rank)], check=True, env=env, timeout=300)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    return page(registry)


@pytest.mark.timeout(600)
def test_worker_series_reach_the_multiprocess_collector(tmp_path):
    text = run_worker(tmp_path, tp_rank=0, multiproc_dir=str(tmp_path))
    totals = dict.fromkeys(PUBLISHED, 0) | dict(
        flat_steps=3,
        ragged_steps=7,
        packed_steps=1,
        ingested_rows=40,
        rejected_rows=7,
        discarded_drafts=12,
    )
    assert dspark_snapshot(text) == expected_snapshot(totals, in_use=0, total=8)
    assert 'model_name="tiny"' in text and 'engine="0"' in text


@pytest.mark.timeout(600)
def test_other_tp_ranks_and_unset_directory_export_nothing(tmp_path):
    rank1 = tmp_path / "rank1"
    rank1.mkdir()
    assert dspark_snapshot(run_worker(rank1, tp_rank=1, multiproc_dir=str(rank1))) is None
    assert list(rank1.iterdir()) == []
    unset = tmp_path / "unset"
    unset.mkdir()
    assert dspark_snapshot(run_worker(unset, tp_rank=0, multiproc_dir=None)) is None
    assert list(unset.iterdir()) == []


# ---- scripts/node/metrics.py -----------------------------------------------------------


def snapshot_text(flat, ragged, stored=10, in_use=0, engine="0") -> str:
    return "\n".join(
        [
            "# TYPE vllm:dspark_steps_total counter",
            f'vllm:dspark_steps_total{{engine="{engine}",model_name="m",path="flat"}} {flat}',
            f'vllm:dspark_steps_total{{engine="{engine}",model_name="m",path="ragged"}} {ragged}',
            f'vllm:dspark_context_rows_total{{engine="{engine}",model_name="m",kind="stored"}} '
            f"{stored}",
            f'vllm:dspark_ring_slots_in_use{{engine="{engine}",model_name="m"}} {in_use}',
            f'vllm:dspark_ring_slots_total{{engine="{engine}",model_name="m"}} 8',
        ]
    )


def test_delta_reports_ragged_share_and_sums_engines():
    before = dspark_snapshot(snapshot_text(4, 1))
    two_engines = snapshot_text(10, 4, in_use=3) + "\n" + snapshot_text(2, 6, engine="1")
    delta = dspark_delta(before, dspark_snapshot(two_engines))
    assert delta["steps"] == {"flat": 8, "ragged": 9, "packed": 0}
    assert delta["ragged_share"] == pytest.approx(9 / 17)
    assert delta["context_rows"] == {"stored": 10, "rejected": 0}
    assert (delta["ring_slots_in_use"], delta["ring_slots_total"]) == (3, 16)
    assert "ragged share 0.53" in format_dspark(delta)


def test_parser_refuses_bad_pages():
    assert dspark_snapshot("vllm:spec_decode_num_drafts_total 3\n") is None
    assert dspark_delta(None, None) is None
    with pytest.raises(ValueError, match="path='diagonal'"):
        dspark_snapshot('vllm:dspark_steps_total{path="diagonal"} 1\n')
    with pytest.raises(ValueError, match="went backwards"):
        dspark_delta(dspark_snapshot(snapshot_text(5, 5)), dspark_snapshot(snapshot_text(4, 5)))


# ---- scripts/serve.py: the server's multiprocess directory --------------------------------


def test_serve_gives_each_server_an_empty_directory_and_sweeps_dead_ones(tmp_path, monkeypatch):
    from scripts import serve

    monkeypatch.setattr(serve.tempfile, "gettempdir", lambda: str(tmp_path))
    root = tmp_path / f"vllm-metrics-{os.getuid()}"
    for name in ("999999999", str(os.getpid()), str(os.getppid()), "notes"):
        (root / name).mkdir(parents=True)
        (root / name / "counter_1.db").write_bytes(b"x")
    path = serve.fresh_metrics_dir()
    assert path == root / str(os.getpid()) and list(path.iterdir()) == []  # this server's
    assert not (root / "999999999").exists()  # no such process: swept
    assert (root / str(os.getppid()) / "counter_1.db").exists()  # a live server's: kept
    assert (root / "notes" / "counter_1.db").exists()  # not ours to judge: kept
