"""What a node's /metrics page says: vLLM's spec-decode counters and DSpark's own series.

The page is parsed by ``prometheus_client`` (installed with vLLM, in the image too); this
module only picks the series: ``spec_decode_delta(spec_decode_counters(before), ...)`` and
``dspark_delta(dspark_snapshot(before), dspark_snapshot(after))``, printed with
``format_dspark``. The smoke check (the container's health check), the rehearsal and the
benchmark sweep share it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Sample = tuple[str, dict[str, str], float]

# vLLM's speculative-decoding counters (Prometheus names as exposed on /metrics).
SPEC_COUNTERS = {
    "num_drafts": "vllm:spec_decode_num_drafts_total",
    "num_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
}
SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"

STEPS = "vllm:dspark_steps_total"
CONTEXT_ROWS = "vllm:dspark_context_rows_total"
DRAFTS_DISCARDED = "vllm:dspark_drafts_discarded_total"
SLOTS_IN_USE = "vllm:dspark_ring_slots_in_use"
SLOTS_TOTAL = "vllm:dspark_ring_slots_total"

PATHS = ("flat", "ragged", "packed")
KINDS = ("stored", "rejected")
_LABELLED = {STEPS: ("path", PATHS), CONTEXT_ROWS: ("kind", KINDS)}


def parse_prometheus(text: str) -> list[Sample]:
    """A /metrics page as (name, labels, value) samples; a malformed page raises ValueError
    naming its first bad line."""
    try:
        return [
            (s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text)
            for s in family.samples
        ]
    except ValueError as exc:
        for line_no, line in enumerate(text.splitlines(), start=1):
            try:
                list(text_string_to_metric_families(line + "\n"))
            except ValueError:
                raise ValueError(
                    f"/metrics line {line_no}: not in the Prometheus text format: {line[:120]!r}"
                ) from exc
        raise


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


def dspark_snapshot(text: str) -> dict[str, Any] | None:
    """The DSpark drafter's series of a /metrics page (see ``dspark_from_samples``)."""
    return dspark_from_samples(parse_prometheus(text))


def dspark_from_samples(samples: Iterable[Sample]) -> dict[str, Any] | None:
    """The DSpark series of one parsed /metrics page, summed over engines and model names.

    Returns ``{"steps": {path: n}, "context_rows": {kind: n}, "drafts_discarded": n,
    "ring_slots_in_use": n, "ring_slots_total": n}``, or None when the page has no DSpark
    series (speculation off, or the server was started without PROMETHEUS_MULTIPROC_DIR).
    A sample with a missing or unknown path/kind label raises ValueError naming it.
    """
    snap: dict[str, Any] = {
        "steps": dict.fromkeys(PATHS, 0.0),
        "context_rows": dict.fromkeys(KINDS, 0.0),
        "drafts_discarded": 0.0,
        "ring_slots_in_use": 0.0,
        "ring_slots_total": 0.0,
    }
    seen = False
    for name, labels, value in samples:
        if name in _LABELLED:
            label, allowed = _LABELLED[name]
            if labels.get(label) not in allowed:
                raise ValueError(
                    f"{name} sample with {label}={labels.get(label)!r}; expected one of {allowed}"
                )
            group = snap["steps" if name == STEPS else "context_rows"]
            group[labels[label]] += value
        elif name == DRAFTS_DISCARDED:
            snap["drafts_discarded"] += value
        elif name == SLOTS_IN_USE:
            snap["ring_slots_in_use"] += value
        elif name == SLOTS_TOTAL:
            snap["ring_slots_total"] += value
        else:
            continue
        seen = True
    return snap if seen else None


def dspark_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict | None:
    """What happened between two snapshots: counter increments, gauges as of ``after``.

    ``ragged_share`` = ragged / (flat + ragged) steps (None when no step ran). A counter
    that went down raises ValueError (the server restarted between the snapshots).
    """
    if after is None:
        return None
    if before is None:
        before = {"steps": {}, "context_rows": {}, "drafts_discarded": 0.0}
    steps = {p: after["steps"][p] - before["steps"].get(p, 0.0) for p in PATHS}
    rows = {k: after["context_rows"][k] - before["context_rows"].get(k, 0.0) for k in KINDS}
    discarded = after["drafts_discarded"] - before["drafts_discarded"]
    if min(*steps.values(), *rows.values(), discarded) < 0:
        raise ValueError("DSpark counters went backwards: was the server restarted mid-run?")
    flat_ragged = steps["flat"] + steps["ragged"]
    return {
        "steps": {p: int(round(v)) for p, v in steps.items()},
        "context_rows": {k: int(round(v)) for k, v in rows.items()},
        "drafts_discarded": int(round(discarded)),
        "ragged_share": steps["ragged"] / flat_ragged if flat_ragged > 0 else None,
        "ring_slots_in_use": int(round(after["ring_slots_in_use"])),
        "ring_slots_total": int(round(after["ring_slots_total"])),
    }


def format_dspark(delta: dict[str, Any]) -> str:
    """One line for logs and reports."""
    share = delta["ragged_share"]
    steps, rows = delta["steps"], delta["context_rows"]
    return (
        f"{steps['flat']} flat / {steps['ragged']} ragged / {steps['packed']} packed steps "
        f"(ragged share {'n/a' if share is None else f'{share:.2f}'}), "
        f"{rows['stored']} context rows stored, {rows['rejected']} rejected, "
        f"{delta['drafts_discarded']} draft tokens discarded, ring slots "
        f"{delta['ring_slots_in_use']}/{delta['ring_slots_total']} in use"
    )
