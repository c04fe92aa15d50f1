"""DSpark's series on a vLLM server's /metrics (the overlay's ``dspark_metrics``), parsed:
``dspark_delta(dspark_from_samples(before), dspark_from_samples(after))``, printed with
``format_dspark``. Standard library only: the smoke check and the sweep share it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

STEPS = "vllm:dspark_steps_total"
CONTEXT_ROWS = "vllm:dspark_context_rows_total"
DRAFTS_DISCARDED = "vllm:dspark_drafts_discarded_total"
SLOTS_IN_USE = "vllm:dspark_ring_slots_in_use"
SLOTS_TOTAL = "vllm:dspark_ring_slots_total"

PATHS = ("flat", "ragged", "packed")
KINDS = ("stored", "rejected")
_LABELLED = {STEPS: ("path", PATHS), CONTEXT_ROWS: ("kind", KINDS)}


def dspark_from_samples(
    samples: Iterable[tuple[str, dict[str, str], float]],
) -> dict[str, Any] | None:
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
