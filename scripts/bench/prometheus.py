"""vLLM's /metrics page: Prometheus text parsing and the series the sweep reads per level.

Standard library only: `scripts/smoke.py` (also the container's healthcheck) imports it.
`LEVEL_SERIES` is the one place that says which series a sweep level records: each entry
reads a snapshot from the parsed page before and after the level and stores the delta under
its own key of the level.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .dspark import dspark_delta, dspark_from_samples

Sample = tuple[str, dict[str, str], float]

# vLLM's speculative-decoding counters (Prometheus names as exposed on /metrics).
SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
# vLLM's token counters: the server-side decode rate (what vLLM's own log line reports).
TOKEN_COUNTERS = {"generation": "vllm:generation_tokens_total", "prompt": "vllm:prompt_tokens_total"}

_SAMPLE_RE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)"
    r"(?:\{(?P<labels>.*)\})?"
    r"\s+(?P<value>\S+)"
    r"(?:\s+(?P<ts>-?\d+))?\s*$"
)
_LABEL_RE = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _parse_labels(text: str, line_no: int) -> dict[str, str]:
    labels: dict[str, str] = {}
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _LABEL_RE.match(text, pos)
        if not m:
            raise ValueError(f"/metrics line {line_no}: cannot parse labels {{{text}}}")
        labels[m.group(1)] = re.sub(r"\\[\\\"n]", lambda e: _UNESCAPE[e.group(0)], m.group(2))
        pos = m.end()
    return labels


def parse_prometheus(text: str) -> list[Sample]:
    """Parse Prometheus text format into (name, labels, value) samples.

    Comments (# HELP / # TYPE) and blank lines are skipped; values may be floats,
    exponents, NaN or +Inf. A line that is not a valid sample raises ValueError naming it.
    """
    samples: list[Sample] = []
    for line_no, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if not m:
            raise ValueError(f"/metrics line {line_no}: not a Prometheus sample: {line[:120]!r}")
        labels = _parse_labels(m.group("labels") or "", line_no)
        try:
            value = float(m.group("value"))
        except ValueError as exc:
            raise ValueError(
                f"/metrics line {line_no}: bad sample value {m.group('value')!r}"
            ) from exc
        samples.append((m.group("name"), labels, value))
    return samples


def spec_counters_from_samples(samples: list[Sample]) -> dict[str, Any] | None:
    """vLLM's spec-decode counters, summed over label sets (engines, data-parallel ranks).

    The per-position counter is grouped by its `position` label. None when the server
    exposes none of the counters (speculative decoding off, or not a vLLM server).
    """
    totals = {SPEC_DRAFTS: 0.0, SPEC_DRAFT_TOKENS: 0.0, SPEC_ACCEPTED: 0.0}
    per_pos: dict[int, float] = {}
    seen = False
    for name, labels, value in samples:
        if name in totals:
            totals[name] += value
            seen = True
        elif name == SPEC_ACCEPTED_PER_POS:
            if "position" not in labels:
                raise ValueError(f"{SPEC_ACCEPTED_PER_POS} sample without a position label")
            pos = int(labels["position"])
            per_pos[pos] = per_pos.get(pos, 0.0) + value
            seen = True
    if not seen:
        return None
    n_pos = max(per_pos) + 1 if per_pos else 0
    return {
        "num_drafts": totals[SPEC_DRAFTS],
        "num_draft_tokens": totals[SPEC_DRAFT_TOKENS],
        "num_accepted_tokens": totals[SPEC_ACCEPTED],
        "accepted_per_position": [per_pos.get(i, 0.0) for i in range(n_pos)],
    }


def dspark_snapshot(text: str) -> dict[str, Any] | None:
    """The DSpark drafter's series of a /metrics page (see ``dspark.dspark_from_samples``)."""
    return dspark_from_samples(parse_prometheus(text))


def spec_decode_counters(text: str) -> dict[str, Any] | None:
    """Spec-decode counters of a /metrics page (see `spec_counters_from_samples`)."""
    return spec_counters_from_samples(parse_prometheus(text))


def spec_decode_delta(
    before: Mapping[str, Any] | None, after: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """Counter increments between two snapshots, with the derived acceptance figures.

    mean_acceptance_length = 1 + accepted / drafts (tokens emitted per verify step,
    counting the bonus token; vLLM's own log line uses the same definition);
    acceptance_rate = accepted / draft tokens; acceptance_per_position[k] = accepted at
    draft position k / drafts. Ratios are None when nothing was drafted.
    """
    if after is None:
        return None
    if before is None:
        before = {
            "num_drafts": 0.0,
            "num_draft_tokens": 0.0,
            "num_accepted_tokens": 0.0,
            "accepted_per_position": [],
        }
    drafts = after["num_drafts"] - before["num_drafts"]
    draft_tokens = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    a_pos, b_pos = list(after["accepted_per_position"]), list(before["accepted_per_position"])
    b_pos += [0.0] * (len(a_pos) - len(b_pos))
    per_pos = [a - b for a, b in zip(a_pos, b_pos, strict=False)]
    if drafts < 0 or draft_tokens < 0 or accepted < 0:
        raise ValueError("spec-decode counters went backwards: was the server restarted mid-run?")
    return {
        "num_drafts": int(round(drafts)),
        "num_draft_tokens": int(round(draft_tokens)),
        "num_accepted_tokens": int(round(accepted)),
        "accepted_per_position": [int(round(x)) for x in per_pos],
        "acceptance_rate": accepted / draft_tokens if draft_tokens > 0 else None,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts > 0 else None,
        "acceptance_per_position": [x / drafts for x in per_pos] if drafts > 0 else None,
    }


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


@dataclass(frozen=True)
class LevelSeries:
    """A group of /metrics series recorded per sweep level under the run's key `field`."""

    field: str
    read: Callable[[list[Sample]], Any]  # parsed page -> snapshot, or None if absent
    delta: Callable[[Any, Any], dict[str, Any] | None]  # (before, after) -> run[field]


LEVEL_SERIES: tuple[LevelSeries, ...] = (
    LevelSeries("spec_decode", spec_counters_from_samples, spec_decode_delta),
    LevelSeries("dspark", dspark_from_samples, dspark_delta),
    LevelSeries("tokens", tokens_from_samples, tokens_delta),
)


def read_level_snapshot(text: str | None) -> dict[str, Any]:
    """Snapshot of every LEVEL_SERIES entry from a /metrics page (None where it is absent)."""
    samples = parse_prometheus(text) if text is not None else []
    return {series.field: series.read(samples) for series in LEVEL_SERIES}


def level_deltas(
    before: Mapping[str, Any], after: Mapping[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """(run[field] for every LEVEL_SERIES entry, problems). A series missing before the level,
    or one whose delta is refused (counters went backwards), is None with a problem line."""
    out: dict[str, Any] = {}
    problems: list[str] = []
    for series in LEVEL_SERIES:
        start, end = before.get(series.field), after.get(series.field)
        try:
            out[series.field] = series.delta(start, end) if start is not None else None
        except ValueError as exc:
            out[series.field] = None
            problems.append(f"{series.field}: {exc}")
    return out, problems
