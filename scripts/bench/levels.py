"""The series a sweep level records from vLLM's /metrics page, and their deltas.

`LEVEL_SERIES` says which series a level records: each is read from the page before and
after the level, and its delta is stored under its own key of the level. Parsing and the
spec-decode and DSpark series live beside the node code (`scripts/node/metrics.py`), which
the container's health check uses too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from scripts.node.metrics import (
    Sample,
    dspark_delta,
    dspark_from_samples,
    parse_prometheus,
    spec_counters_from_samples,
    spec_decode_delta,
)

# vLLM's token counters: the server-side decode rate (what vLLM's own log line reports).
TOKEN_COUNTERS = {"generation": "vllm:generation_tokens_total",
                  "prompt": "vllm:prompt_tokens_total"}


def tokens_from_samples(samples: list[Sample]) -> dict[str, float] | None:
    """Generated and prompt tokens so far, summed over engines; None if the page has neither."""
    names = {name: key for key, name in TOKEN_COUNTERS.items()}
    found = [(names[n], v) for n, _, v in samples if n in names]
    if not found:
        return None
    return {key: sum(v for k, v in found if k == key) for key in TOKEN_COUNTERS}


def tokens_delta(before: Mapping[str, float] | None, after: Mapping[str, float] | None):
    if after is None:
        return None
    delta = {k: int(round(after[k] - (before or {}).get(k, 0.0))) for k in TOKEN_COUNTERS}
    if min(delta.values()) < 0:
        raise ValueError("token counters went backwards: was the server restarted mid-run?")
    return delta


# level key -> (parsed page -> snapshot or None, (before, after) -> the level's value)
LEVEL_SERIES = {
    "spec_decode": (spec_counters_from_samples, spec_decode_delta),
    "dspark": (dspark_from_samples, dspark_delta),
    "tokens": (tokens_from_samples, tokens_delta),
}


def read_level_snapshot(text: str | None) -> dict[str, Any]:
    """Snapshot of every LEVEL_SERIES entry from a /metrics page (None where it is absent)."""
    samples = parse_prometheus(text) if text is not None else []
    return {key: read(samples) for key, (read, _) in LEVEL_SERIES.items()}


def level_deltas(before: Mapping[str, Any], after: Mapping[str, Any]) -> tuple[dict, list[str]]:
    """(the level's value of every series, problems): a series absent before the level, or
    whose counters went backwards (a restarted server), is None (the latter with a problem)."""
    out: dict[str, Any] = {}
    problems: list[str] = []
    for key, (_, delta) in LEVEL_SERIES.items():
        try:
            out[key] = delta(before[key], after[key]) if before.get(key) is not None else None
        except ValueError as exc:
            out[key] = None
            problems.append(f"{key}: {exc}")
    return out, problems
