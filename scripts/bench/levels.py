"""vLLM's /metrics page: Prometheus text parsing and the series a sweep level records.

Standard library only: `scripts/smoke.py` (also the container's healthcheck) imports it.
`LEVEL_SERIES` says which series a level records: each is read from the page before and
after the level, and its delta is stored under its own key of the level.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .dspark import dspark_delta, dspark_from_samples

Sample = tuple[str, dict[str, str], float]

# vLLM's speculative-decoding counters (Prometheus names as exposed on /metrics).
SPEC_COUNTERS = {
    "num_drafts": "vllm:spec_decode_num_drafts_total",
    "num_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
}
SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
# vLLM's token counters: the server-side decode rate (what vLLM's own log line reports).
TOKEN_COUNTERS = {"generation": "vllm:generation_tokens_total",
                  "prompt": "vllm:prompt_tokens_total"}

_SAMPLE_RE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+-?\d+)?\s*$"
)
_LABEL_RE = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _parse_labels(text: str, line_no: int) -> dict[str, str]:
    labels, pos, text = {}, 0, text.strip()
    while pos < len(text):
        m = _LABEL_RE.match(text, pos)
        if not m:
            raise ValueError(f"/metrics line {line_no}: cannot parse labels {{{text}}}")
        labels[m.group(1)] = re.sub(r"\\[\\\"n]", lambda e: _UNESCAPE[e.group(0)], m.group(2))
        pos = m.end()
    return labels


def parse_prometheus(text: str) -> list[Sample]:
    """Prometheus text format as (name, labels, value) samples; comments and blank lines are
    skipped, values may be exponents, NaN or +Inf; a line that is no sample raises naming it."""
    samples: list[Sample] = []
    for line_no, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if not m:
            raise ValueError(f"/metrics line {line_no}: not a Prometheus sample: {line[:120]!r}")
        try:
            value = float(m.group("value"))
        except ValueError as exc:
            raise ValueError(f"/metrics line {line_no}: bad sample value {m.group('value')!r}") \
                from exc
        samples.append((m.group("name"), _parse_labels(m.group("labels") or "", line_no), value))
    return samples


def spec_counters_from_samples(samples: list[Sample]) -> dict[str, Any] | None:
    """vLLM's spec-decode counters summed over label sets (engines, data-parallel ranks), the
    per-position one by its `position` label; None when the page has none (speculation off)."""
    names = {name: key for key, name in SPEC_COUNTERS.items()}
    totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
    per_pos: dict[int, float] = {}
    seen = False
    for name, labels, value in samples:
        if name in names:
            totals[names[name]] += value
        elif name == SPEC_ACCEPTED_PER_POS:
            if "position" not in labels:
                raise ValueError(f"{SPEC_ACCEPTED_PER_POS} sample without a position label")
            per_pos[int(labels["position"])] = per_pos.get(int(labels["position"]), 0.0) + value
        else:
            continue
        seen = True
    if not seen:
        return None
    width = max(per_pos) + 1 if per_pos else 0
    return {**totals, "accepted_per_position": [per_pos.get(i, 0.0) for i in range(width)]}


def dspark_snapshot(text: str) -> dict[str, Any] | None:
    """The DSpark drafter's series of a /metrics page (see ``dspark.dspark_from_samples``)."""
    return dspark_from_samples(parse_prometheus(text))


def spec_decode_counters(text: str) -> dict[str, Any] | None:
    """Spec-decode counters of a /metrics page (see `spec_counters_from_samples`)."""
    return spec_counters_from_samples(parse_prometheus(text))


def spec_decode_delta(
    before: Mapping[str, Any] | None, after: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """Counter increments between two snapshots, with the derived acceptance figures:
    mean_acceptance_length = 1 + accepted / drafts (tokens per verify step, bonus included, as
    vLLM's log line), acceptance_rate = accepted / draft tokens, acceptance_per_position[k] =
    accepted at draft position k / drafts; ratios are None when nothing was drafted."""
    if after is None:
        return None
    before = before or {**dict.fromkeys(SPEC_COUNTERS, 0.0), "accepted_per_position": []}
    d = {key: after[key] - before[key] for key in SPEC_COUNTERS}
    if min(d.values()) < 0:
        raise ValueError("spec-decode counters went backwards: was the server restarted mid-run?")
    b_pos = list(before["accepted_per_position"])
    per_pos = [a - (b_pos[i] if i < len(b_pos) else 0.0)
               for i, a in enumerate(after["accepted_per_position"])]
    drafts, accepted = d["num_drafts"], d["num_accepted_tokens"]
    return {
        **{key: int(round(v)) for key, v in d.items()},
        "accepted_per_position": [int(round(x)) for x in per_pos],
        "acceptance_rate": accepted / d["num_draft_tokens"] if d["num_draft_tokens"] > 0 else None,
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
