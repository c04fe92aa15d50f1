"""The result format of the serving sweep, written once: validation and `--schema` derive from it.

A result is JSON. `RESULT` below declares every field that must be present, its type, whether
it may be null and what it means; objects may carry more keys than declared (they are kept,
not checked). `validate_result` walks the declaration and then checks the facts that tie
fields together (ok + errors = requests, ordered percentiles, one entry per request).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .stats import STATS_KEYS

SCHEMA_VERSION = 1
RESULT_KIND = "bench_serving"

# Request status: ok, or why it failed. Statistics use ok requests only.
REQUEST_STATUSES = (
    "ok",
    "http_error",  # the server answered with a non-200 status
    "truncated",  # the stream ended or dropped before data: [DONE]
    "timeout",  # no complete response within --request-timeout
    "stream_error",  # an error object inside the stream
    "bad_response",  # an unparseable chunk
    "connection_error",
    "client_error",  # anything else the client hit; the sweep goes on
)


@dataclass(frozen=True)
class Value:
    """A leaf: one of `types` (never a bool unless bool is listed), optionally >= `min`."""

    types: tuple[type, ...]
    doc: str = ""
    nullable: bool = False
    min: int | None = None


@dataclass(frozen=True)
class Obj:
    fields: dict[str, Any]
    doc: str = ""
    nullable: bool = False


@dataclass(frozen=True)
class ListOf:
    item: Any = None  # None: any items
    doc: str = ""
    nullable: bool = False
    non_empty: bool = False
    choices: tuple = field(default=())


INT, NUM, STR, BOOL = (int,), (int, float), (str,), (bool,)


def stats(doc: str) -> Obj:
    return Obj({k: Value(NUM) for k in STATS_KEYS}, doc + " {n, mean, min, max, p50, p90, p99}",
               nullable=True)


SPEC_DECODE = Obj(
    {
        "num_drafts": Value(INT, "verify steps with a draft, over the level", min=0),
        "num_draft_tokens": Value(INT, "draft tokens proposed", min=0),
        "num_accepted_tokens": Value(INT, "draft tokens accepted", min=0),
        "accepted_per_position": ListOf(doc="accepted at draft position k"),
        "acceptance_rate": Value(NUM, "accepted / draft tokens", nullable=True),
        "mean_acceptance_length": Value(NUM, "1 + accepted / drafts", nullable=True),
        "acceptance_per_position": ListOf(doc="accepted at k / drafts", nullable=True),
    },
    "vLLM's spec-decode counter deltas over the level (null: no counters on /metrics); "
    "other traffic on the server during the level is counted too",
    nullable=True,
)

DSPARK = Obj(
    {
        "steps": Obj({p: Value(INT, min=0) for p in ("flat", "ragged", "packed")},
                     "engine steps by context path (packed steps are also flat or ragged)"),
        "context_rows": Obj({k: Value(INT, min=0) for k in ("stored", "rejected")},
                            "context rows written to rings / rejected rows never written"),
        "drafts_discarded": Value(INT, "draft tokens of requests still in chunked prefill",
                                  min=0),
        "ragged_share": Value(NUM, "ragged / (flat + ragged) steps", nullable=True),
        "ring_slots_in_use": Value(INT, "ring rows held at the end of the level", min=0),
        "ring_slots_total": Value(INT, "ring rows (max_num_seqs)", min=0),
    },
    "the DSpark drafter's series over the level (null: the server exports none)",
    nullable=True,
)

REQUEST = Obj(
    {
        "status": Value(STR, "one of REQUEST_STATUSES"),
        "error": Value(STR, "what went wrong (null when ok)", nullable=True),
        "http_status": Value(INT, nullable=True),
        "prompt_tokens": Value(INT, "usage.prompt_tokens", nullable=True),
        "output_tokens": Value(INT, "completion tokens", nullable=True),
        "num_chunks": Value(INT, "token-bearing stream chunks", nullable=True),
        "ttft_s": Value(NUM, "request sent -> first chunk carrying a token", nullable=True),
        "decode_tok_s": Value(NUM, "(tokens after the first chunk) / (last - first chunk time)",
                              nullable=True),
        "e2e_s": Value(NUM, "request sent -> stream closed", nullable=True),
    },
    "also index, expected_prompt_tokens, finish_reason, token_count_source",
)

RUN = Obj(
    {
        "concurrency": Value(INT, "streams kept in flight (closed loop)", min=1),
        "prompt_len": Value(INT, "exact prompt tokens", min=1),
        "output_len": Value(INT, "completion tokens per request", min=1),
        "num_requests": Value(INT, "rounds x concurrency"),
        "num_ok": Value(INT),
        "num_errors": Value(INT),
        "errors": Obj({}, "failed requests by status, e.g. {\"timeout\": 1}"),
        "duration_s": Value(NUM, "level wall time"),
        "total_output_tokens": Value(INT, "completion tokens of ok requests"),
        "prompt_len_mismatches": Value(INT, "ok requests whose usage.prompt_tokens differs"),
        "output_tok_s": Value(NUM, "total output tokens / level wall time (incl. prefill and "
                              "queueing)", nullable=True),
        "aggregate_decode_tok_s": Value(NUM, "min(concurrency, requests) x mean per-stream "
                                        "decode tok/s", nullable=True),
        "itl_basis": Value(STR, "where per-chunk token counts came from: chunk_usage, "
                           "token_ids, chunks (one sample per chunk), mixed or none"),
        "ttft_s": stats("time to first token (s)"),
        "itl_s": stats("inter-token latency (s): each chunk gap / tokens in the later chunk, "
                       "one sample per token"),
        "chunk_gap_s": stats("raw gaps between token-bearing chunks (s)"),
        "decode_tok_s_per_stream": stats("per-request decode tok/s (excludes TTFT)"),
        "e2e_s": stats("request latency (s)"),
        "spec_decode": SPEC_DECODE,
        "dspark": DSPARK,
        "requests": ListOf(REQUEST, "one entry per request, in send order"),
    }
)

_STATS_FIELDS = tuple(k for k, v in RUN.fields.items() if isinstance(v, Obj) and "p50" in v.fields)

RESULT = Obj(
    {
        "schema_version": Value(INT, f"{SCHEMA_VERSION}"),
        "kind": Value(STR, f"{RESULT_KIND!r}"),
        "created_utc": Value(STR, "YYYY-mm-ddTHH:MM:SSZ"),
        "run_id": Value(STR, "the id in every prompt's unique prefix"),
        "note": Value(STR, "--note", nullable=True),
        "recipe": Obj(
            {
                "profile": Value(STR, "recipe profile name, or 'unspecified'"),
                "profile_source": Value(STR, "cli, served model name or none"),
                "profile_config": Obj({}, "the profile YAML", nullable=True),
                "pins": Obj({}, "recipe/pins.yaml", nullable=True),
            }
        ),
        "machine": Obj(
            {
                "client": Obj(
                    {
                        "hostname": Value(STR),
                        "platform": Value(STR),
                        "python": Value(STR),
                        "cpu_count": Value(INT, nullable=True),
                    },
                    "also machine, aiohttp, git_commit, git_dirty",
                ),
                "server": Obj(
                    {
                        "base_url": Value(STR),
                        "model": Value(STR, "served model name"),
                        "version": Value(STR, "GET /version", nullable=True),
                        "max_model_len": Value(INT, nullable=True),
                    }
                ),
            }
        ),
        "config": Obj(
            {
                "endpoint": Value(STR, "completions or chat"),
                "concurrency": ListOf(Value(INT, min=1), non_empty=True),
                "prompt_lens": ListOf(Value(INT, min=1), non_empty=True),
                "output_len": Value(INT),
                "rounds": Value(INT),
                "warmup": Value(INT),
                "seed": Value(INT),
            },
            "also skipped_prompt_lens, temperature, ignore_eos, request_timeout_s, ramp_s, "
            "extra_body",
        ),
        "warmup": Obj({"num_requests": Value(INT), "num_ok": Value(INT)}, "excluded requests"),
        "metrics_available": Value(BOOL, "any level got spec-decode counters"),
        "runs": ListOf(RUN, "one per (prompt length, concurrency) level"),
    }
)


def _fail(path: str, msg: str) -> None:
    raise ValueError(f"bench result: {path}: {msg}")


def _type_names(types: tuple[type, ...]) -> str:
    return "/".join(t.__name__ for t in types)


def _walk(node: Any, value: Any, path: str) -> None:
    if value is None:
        if not node.nullable:
            _fail(path, "must not be null")
        return
    if isinstance(node, Obj):
        if not isinstance(value, Mapping):
            _fail(path, f"expected an object, got {type(value).__name__}")
        for key, child in node.fields.items():
            if key not in value:
                _fail(f"{path}.{key}", "missing")
            _walk(child, value[key], f"{path}.{key}")
    elif isinstance(node, ListOf):
        if not isinstance(value, list):
            _fail(path, f"expected a list, got {type(value).__name__}")
        if node.non_empty and not value:
            _fail(path, "expected a non-empty list")
        for i, item in enumerate(value):
            if node.item is not None:
                _walk(node.item, item, f"{path}[{i}]")
    else:
        if isinstance(value, bool) and bool not in node.types:
            _fail(path, f"expected {_type_names(node.types)}, got a boolean")
        if not isinstance(value, node.types):
            _fail(path, f"expected {_type_names(node.types)}, got {type(value).__name__}")
        if node.min is not None and value < node.min:
            _fail(path, f"must be >= {node.min}")


def _check_run(run: Mapping[str, Any], rp: str) -> None:
    n_req, n_ok, n_err = run["num_requests"], run["num_ok"], run["num_errors"]
    if n_ok + n_err != n_req:
        _fail(rp, f"num_ok ({n_ok}) + num_errors ({n_err}) != num_requests ({n_req})")
    if sum(run["errors"].values()) != n_err:
        _fail(f"{rp}.errors", "counts do not add up to num_errors")
    for kind in run["errors"]:
        if kind not in REQUEST_STATUSES or kind == "ok":
            _fail(f"{rp}.errors", f"unknown error kind {kind!r}")
    for key in _STATS_FIELDS:
        st = run[key]
        if st and not st["min"] <= st["p50"] <= st["p90"] <= st["p99"] <= st["max"]:
            _fail(f"{rp}.{key}", "percentiles not ordered min <= p50 <= p90 <= p99 <= max")
    reqs = run["requests"]
    if len(reqs) != n_req:
        _fail(f"{rp}.requests", f"has {len(reqs)} entries, num_requests is {n_req}")
    for j, req in enumerate(reqs):
        if req["status"] not in REQUEST_STATUSES:
            _fail(f"{rp}.requests[{j}].status", f"unknown status {req['status']!r}")
        if req["status"] != "ok" and req["error"] is None:
            _fail(f"{rp}.requests[{j}].error", "must not be null for a failed request")
    if sum(req["status"] == "ok" for req in reqs) != n_ok:
        _fail(f"{rp}.requests", "number of ok requests differs from num_ok")


def validate_result(result: Mapping[str, Any]) -> Mapping[str, Any]:
    """Check a sweep result against RESULT; return it unchanged.

    Raises ValueError naming the first offending field (e.g. `$.runs[2].ttft_s.p50`).
    """
    if isinstance(result, Mapping) and result.get("schema_version") not in (None, SCHEMA_VERSION):
        _fail("$.schema_version", f"expected {SCHEMA_VERSION}, got {result['schema_version']}")
    if isinstance(result, Mapping) and result.get("kind") not in (None, RESULT_KIND):
        _fail("$.kind", f"expected {RESULT_KIND!r}")
    _walk(RESULT, result, "$")
    for i, run in enumerate(result["runs"]):
        _check_run(run, f"$.runs[{i}]")
    return result


def outline(node: Any = RESULT, name: str = "result", depth: int = 0) -> list[str]:
    """The schema as indented text lines (what `python -m scripts.bench --schema` prints)."""
    pad = "  " * depth
    null = " | null" if node.nullable else ""
    if isinstance(node, Obj):
        head = f"{pad}{name}: object{null}" + (f"  -- {node.doc}" if node.doc else "")
        if "p50" in node.fields:
            return [head]
        return [head] + [line for k, v in node.fields.items() for line in outline(v, k, depth + 1)]
    if isinstance(node, ListOf):
        head = f"{pad}{name}: list{null}" + (f"  -- {node.doc}" if node.doc else "")
        if isinstance(node.item, Obj):
            return [head] + [
                line for k, v in node.item.fields.items() for line in outline(v, k, depth + 1)
            ]
        return [head]
    return [f"{pad}{name}: {_type_names(node.types)}{null}" + (f"  -- {node.doc}" if node.doc else "")]
