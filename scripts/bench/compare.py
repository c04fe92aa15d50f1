"""Put two sweep result files side by side, with B/A ratios: `python -m scripts.bench.compare A B`.

Runs are matched by (prompt length, concurrency). For each matched run the table shows
A, B and B/A for the headline metrics; a ratio above 1 means B is larger (better for
tok/s and acceptance, worse for latencies). Runs present in only one file are listed.

  python -m scripts.bench.compare bench-results/nospec.json bench-results/dspark.json
  python -m scripts.bench.compare A.json B.json --labels flat ragged --out bench-results/ragged-vs-flat.md

Exit codes: 0 done; 2 a file is missing or is not a valid bench_serving result.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .schema import validate_result


def _stat(key: str, q: str) -> Callable[[Mapping[str, Any]], float | None]:
    return lambda run: (run.get(key) or {}).get(q)


def _spec(key: str) -> Callable[[Mapping[str, Any]], float | None]:
    return lambda run: (run.get("spec_decode") or {}).get(key)


# (name, label for the table, getter, higher is better)
METRICS: list[tuple[str, str, Callable[[Mapping[str, Any]], Any], bool]] = [
    ("aggregate_decode_tok_s", "aggregate decode tok/s", lambda r: r["aggregate_decode_tok_s"], True),
    ("output_tok_s", "output tok/s", lambda r: r["output_tok_s"], True),
    ("stream_decode_p50_tok_s", "stream decode p50 tok/s", _stat("decode_tok_s_per_stream", "p50"), True),
    ("ttft_p50_s", "TTFT p50 s", _stat("ttft_s", "p50"), False),
    ("ttft_p90_s", "TTFT p90 s", _stat("ttft_s", "p90"), False),
    ("itl_p50_s", "ITL p50 s", _stat("itl_s", "p50"), False),
    ("itl_p99_s", "ITL p99 s", _stat("itl_s", "p99"), False),
    ("mean_acceptance_length", "mean acceptance length", _spec("mean_acceptance_length"), True),
    ("acceptance_rate", "acceptance rate", _spec("acceptance_rate"), True),
    ("num_errors", "failed requests", lambda r: r["num_errors"], False),
]  # fmt: skip


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or a == 0:
        return None
    return b / a


def compare(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Match runs by (prompt_len, concurrency) and compute B/A for each metric."""
    runs_a = {(r["prompt_len"], r["concurrency"]): r for r in a["runs"]}
    runs_b = {(r["prompt_len"], r["concurrency"]): r for r in b["runs"]}
    rows = []
    for key in sorted(runs_a.keys() & runs_b.keys()):
        ra, rb = runs_a[key], runs_b[key]
        metrics = {}
        for name, _label, get, higher in METRICS:
            va, vb = get(ra), get(rb)
            metrics[name] = {"a": va, "b": vb, "ratio": _ratio(va, vb), "higher_is_better": higher}
        rows.append({"prompt_len": key[0], "concurrency": key[1], "metrics": metrics})
    return {
        "a": {"profile": a["recipe"]["profile"], "run_id": a["run_id"]},
        "b": {"profile": b["recipe"]["profile"], "run_id": b["run_id"]},
        "rows": rows,
        "only_in_a": sorted(runs_a.keys() - runs_b.keys()),
        "only_in_b": sorted(runs_b.keys() - runs_a.keys()),
    }


def _fmt(x: Any) -> str:
    if x is None:
        return "–"
    if isinstance(x, int):
        return str(x)
    return f"{x:.4g}"


def format_markdown(cmp: Mapping[str, Any], label_a: str, label_b: str) -> str:
    lines = [
        f"## {label_b} vs {label_a}",
        "",
        "B/A > 1: B is larger (better for tok/s and acceptance, worse for latency and errors).",
        "",
        f"| prompt | conc | metric | {label_a} (A) | {label_b} (B) | B/A |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    labels = {name: label for name, label, _, _ in METRICS}
    for row in cmp["rows"]:
        for name, m in row["metrics"].items():
            ratio = "–" if m["ratio"] is None else f"{m['ratio']:.2f}x"
            lines.append(
                f"| {row['prompt_len']} | {row['concurrency']} | {labels[name]} "
                f"| {_fmt(m['a'])} | {_fmt(m['b'])} | {ratio} |"
            )
    for side, label in (("only_in_a", label_a), ("only_in_b", label_b)):
        if cmp[side]:
            levels = ", ".join(f"len={p} c={c}" for p, c in cmp[side])
            lines += ["", f"Only in {label} ({side[-1].upper()}): {levels}"]
    if not cmp["rows"]:
        lines += ["", "No (prompt length, concurrency) level is present in both files."]
    return "\n".join(lines) + "\n"


def load_result(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read JSON: {exc}") from exc
    try:
        validate_result(data)
    except ValueError as exc:
        raise ValueError(f"{path}: not a bench_serving result: {exc}") from exc
    return data


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m scripts.bench.compare",
        description="Compare two serving sweep result files (B relative to A).",
    )
    ap.add_argument("a", type=Path, help="baseline result JSON (A), e.g. without speculation")
    ap.add_argument("b", type=Path, help="result JSON to compare (B), e.g. with DSpark")
    ap.add_argument(
        "--labels",
        nargs=2,
        metavar=("A", "B"),
        help="column names (default: the recipe profile names, or file names if equal)",
    )
    ap.add_argument("--out", type=Path, help="also write the Markdown table to this file")
    ap.add_argument("--json", type=Path, help="also write the comparison as JSON to this file")
    args = ap.parse_args(argv)
    try:
        a, b = load_result(args.a), load_result(args.b)
    except ValueError as exc:
        print(f"compare: error: {exc}", file=sys.stderr)
        return 2
    cmp = compare(a, b)
    if args.labels:
        label_a, label_b = args.labels
    else:
        label_a, label_b = a["recipe"]["profile"], b["recipe"]["profile"]
        if label_a == label_b:
            label_a, label_b = args.a.stem, args.b.stem
    report = format_markdown(cmp, label_a, label_b)
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report, encoding="utf-8")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(cmp, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
