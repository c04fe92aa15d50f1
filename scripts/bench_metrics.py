"""Pure helpers for the serving benchmark: statistics, Prometheus parsing, result schema.

No network and no third-party imports, so `compare_bench.py` and the tests can use it
without a server. `bench_serving.py` documents the result schema that
`validate_result` checks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

SCHEMA_VERSION = 1
RESULT_KIND = "bench_serving"

# vLLM's speculative-decoding counters (Prometheus names as exposed on /metrics).
SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"

REQUEST_STATUSES = (
    "ok",
    "http_error",
    "truncated",
    "timeout",
    "stream_error",
    "bad_response",
    "connection_error",
    "client_error",
)

# ---------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (the same rule as numpy's default), q in [0, 100]."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Iterable[float | None]) -> dict[str, float | int] | None:
    """{n, mean, min, max, p50, p90, p99} of the non-None values, or None if there are none."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return None
    return {
        "n": len(xs),
        "mean": sum(xs) / len(xs),
        "min": min(xs),
        "max": max(xs),
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
    }


# ---------------------------------------------------------------------------------------
# Prometheus text exposition
# ---------------------------------------------------------------------------------------

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


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Parse Prometheus text format into (name, labels, value) samples.

    Comments (# HELP / # TYPE) and blank lines are skipped; values may be floats,
    exponents, NaN or +Inf. A line that is not a valid sample raises ValueError naming it.
    """
    samples: list[tuple[str, dict[str, str], float]] = []
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


def spec_decode_counters(text: str) -> dict[str, Any] | None:
    """Extract vLLM's spec-decode counters from a /metrics page.

    Sums over label sets (several engines / data-parallel ranks) and groups the
    per-position counter by its `position` label. Returns None when the server exposes
    none of the counters (speculative decoding off, or not a vLLM server).
    """
    totals = {SPEC_DRAFTS: 0.0, SPEC_DRAFT_TOKENS: 0.0, SPEC_ACCEPTED: 0.0}
    per_pos: dict[int, float] = {}
    seen = False
    for name, labels, value in parse_prometheus(text):
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


# ---------------------------------------------------------------------------------------
# Result schema validation
# ---------------------------------------------------------------------------------------

_NUM = (int, float)
_STATS_KEYS = ("n", "mean", "min", "max", "p50", "p90", "p99")


def _fail(path: str, msg: str) -> None:
    raise ValueError(f"bench result: {path}: {msg}")


def _check(obj: Mapping[str, Any], key: str, types: Any, path: str, nullable: bool = False) -> Any:
    if not isinstance(obj, Mapping):
        _fail(path, f"expected an object, got {type(obj).__name__}")
    if key not in obj:
        _fail(f"{path}.{key}", "missing")
    value = obj[key]
    if value is None:
        if not nullable:
            _fail(f"{path}.{key}", "must not be null")
        return None
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        _fail(f"{path}.{key}", "expected a number, got a boolean")
    if not isinstance(value, types):
        _fail(f"{path}.{key}", f"expected {types}, got {type(value).__name__}")
    return value


def _check_stats(obj: Mapping[str, Any], key: str, path: str) -> None:
    stats = _check(obj, key, dict, path, nullable=True)
    if stats is None:
        return
    for k in _STATS_KEYS:
        _check(stats, k, _NUM, f"{path}.{key}")
    if not stats["min"] <= stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"]:
        _fail(f"{path}.{key}", "percentiles not ordered min <= p50 <= p90 <= p99 <= max")


def _check_spec(spec: Mapping[str, Any] | None, path: str) -> None:
    if spec is None:
        return
    for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        if _check(spec, k, int, path) < 0:
            _fail(f"{path}.{k}", "must be >= 0")
    _check(spec, "accepted_per_position", list, path)
    _check(spec, "acceptance_rate", _NUM, path, nullable=True)
    _check(spec, "mean_acceptance_length", _NUM, path, nullable=True)
    _check(spec, "acceptance_per_position", list, path, nullable=True)


def validate_result(result: Mapping[str, Any]) -> Mapping[str, Any]:
    """Check a bench_serving result against schema version 1; return it unchanged.

    Raises ValueError naming the first offending field (e.g. `runs[2].ttft_s.p50`).
    """
    p = "$"
    if _check(result, "schema_version", int, p) != SCHEMA_VERSION:
        _fail(f"{p}.schema_version", f"expected {SCHEMA_VERSION}, got {result['schema_version']}")
    if _check(result, "kind", str, p) != RESULT_KIND:
        _fail(f"{p}.kind", f"expected {RESULT_KIND!r}")
    _check(result, "created_utc", str, p)
    _check(result, "run_id", str, p)
    _check(result, "note", str, p, nullable=True)

    recipe = _check(result, "recipe", dict, p)
    _check(recipe, "profile", str, f"{p}.recipe")
    _check(recipe, "profile_source", str, f"{p}.recipe")
    _check(recipe, "profile_config", dict, f"{p}.recipe", nullable=True)
    _check(recipe, "pins", dict, f"{p}.recipe", nullable=True)

    machine = _check(result, "machine", dict, p)
    client = _check(machine, "client", dict, f"{p}.machine")
    for k in ("hostname", "platform", "python"):
        _check(client, k, str, f"{p}.machine.client")
    _check(client, "cpu_count", int, f"{p}.machine.client", nullable=True)
    server = _check(machine, "server", dict, f"{p}.machine")
    _check(server, "base_url", str, f"{p}.machine.server")
    _check(server, "model", str, f"{p}.machine.server")
    _check(server, "version", str, f"{p}.machine.server", nullable=True)
    _check(server, "max_model_len", int, f"{p}.machine.server", nullable=True)

    config = _check(result, "config", dict, p)
    for k in ("concurrency", "prompt_lens"):
        levels = _check(config, k, list, f"{p}.config")
        if not levels or not all(isinstance(x, int) and x >= 1 for x in levels):
            _fail(f"{p}.config.{k}", "expected a non-empty list of positive integers")
    for k in ("output_len", "rounds", "warmup", "seed"):
        _check(config, k, int, f"{p}.config")
    _check(config, "endpoint", str, f"{p}.config")

    warm = _check(result, "warmup", dict, p)
    _check(warm, "num_requests", int, f"{p}.warmup")
    _check(warm, "num_ok", int, f"{p}.warmup")
    _check(result, "metrics_available", bool, p)

    runs = _check(result, "runs", list, p)
    for i, run in enumerate(runs):
        rp = f"{p}.runs[{i}]"
        for k in ("concurrency", "prompt_len", "output_len"):
            if _check(run, k, int, rp) < 1:
                _fail(f"{rp}.{k}", "must be >= 1")
        n_req = _check(run, "num_requests", int, rp)
        n_ok = _check(run, "num_ok", int, rp)
        n_err = _check(run, "num_errors", int, rp)
        if n_ok + n_err != n_req:
            _fail(rp, f"num_ok ({n_ok}) + num_errors ({n_err}) != num_requests ({n_req})")
        errors = _check(run, "errors", dict, rp)
        if sum(errors.values()) != n_err:
            _fail(f"{rp}.errors", "counts do not add up to num_errors")
        for kind in errors:
            if kind not in REQUEST_STATUSES or kind == "ok":
                _fail(f"{rp}.errors", f"unknown error kind {kind!r}")
        _check(run, "duration_s", _NUM, rp)
        _check(run, "total_output_tokens", int, rp)
        _check(run, "prompt_len_mismatches", int, rp)
        for k in ("output_tok_s", "aggregate_decode_tok_s"):
            _check(run, k, _NUM, rp, nullable=True)
        for k in ("ttft_s", "itl_s", "chunk_gap_s", "decode_tok_s_per_stream", "e2e_s"):
            _check_stats(run, k, rp)
        _check(run, "itl_basis", str, rp)
        _check_spec(_check(run, "spec_decode", dict, rp, nullable=True), f"{rp}.spec_decode")
        reqs = _check(run, "requests", list, rp)
        if len(reqs) != n_req:
            _fail(f"{rp}.requests", f"has {len(reqs)} entries, num_requests is {n_req}")
        statuses = []
        for j, req in enumerate(reqs):
            qp = f"{rp}.requests[{j}]"
            status = _check(req, "status", str, qp)
            if status not in REQUEST_STATUSES:
                _fail(f"{qp}.status", f"unknown status {status!r}")
            statuses.append(status)
            _check(req, "error", str, qp, nullable=(status == "ok"))
            _check(req, "http_status", int, qp, nullable=True)
            for k in ("prompt_tokens", "output_tokens", "num_chunks"):
                _check(req, k, int, qp, nullable=True)
            for k in ("ttft_s", "decode_tok_s", "e2e_s"):
                _check(req, k, _NUM, qp, nullable=True)
        if statuses.count("ok") != n_ok:
            _fail(f"{rp}.requests", "number of ok requests differs from num_ok")
    return result
