"""The DSpark / plain speed bound from measured cost curves instead of assumed bytes.

`roofline.py` bounds a step by the bytes it reads at an assumed bandwidth, with the routed
experts of the verify rows as a range. This reads what `step_cost.py` measured on the same
engine instead (``bench-results/step_cost.json``): for every verify width ``w`` (``1 + w``
rows per request) the target forward's ms, the draft forward's ms, the rest of the step, the
tokens each request gained per step, and the distinct experts per MoE layer by rows. Per
width it splits the DSpark step into what plain decoding also pays and three extra terms:

- verify rows: target forward at ``1 + w`` rows minus at 1 row (dense GEMM rows and the
  routed experts the extra rows add),
- draft: the draft forward (context projection and the block),
- host: the rest of the DSpark step minus the rest of the plain step,

and gives the speed ``L(w) x plain step / DSpark step`` (``L(w)``: tokens per request per
step at that width), the step a target speed-up needs (``L(w) x plain / target``) and the
term that overshoots it most. Writes JSON and PNG; the last line names the best width::

    .venv/bin/python -m scripts.bench.measured_roofline [--step-cost bench-results/step_cost.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from scripts.bench.figures import save_png, subplots

from .. import recipe

TERMS = ("verify rows", "draft", "host")


def width_table(result: dict[str, Any], concurrency: int, target: float) -> list[dict[str, Any]]:
    row = result["by_concurrency"][str(concurrency)]
    plain = row["plain"]
    plain_step = plain["step_ms"]
    plain_forward = plain["phases_ms"]["target forward"]
    plain_rest = plain_step - plain_forward
    widths = row.get("by_width") or {}
    base = widths.get("0", {}).get("target_forward_ms", plain_forward)
    out = []
    for w, v in widths.items():
        terms = {
            "verify rows": v["target_forward_ms"] - base,
            "draft": v["draft_forward_ms"],
            "host": v["step_ms"] - v["target_forward_ms"] - v["draft_forward_ms"] - plain_rest,
        }
        length = v["tokens_per_request_step"]
        budget = length * plain_step / target  # the DSpark step that gives `target`
        # what the step may add over a plain step at this width's acceptance length
        allowed = budget - (base + plain_rest)
        over = max(TERMS, key=lambda t: terms[t])
        out.append({
            "width": int(w), "rows_per_request": int(w) + 1, "acceptance_length": length,
            "terms_ms": terms, "plain_step_ms": plain_step, "dspark_step_ms": v["step_ms"],
            "speed_vs_plain": v["speed_vs_plain"], "step_budget_ms": budget,
            "extra_allowed_ms": allowed, "extra_ms": sum(terms.values()),
            "largest_term": over,
            "speed_if_rows_free": length * plain_step / (v["step_ms"] - terms["verify rows"]),
            "speed_if_draft_free": length * plain_step / (v["step_ms"] - terms["draft"]),
        })
    return out


def experts_table(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"rows": int(r), **v} for r, v in (result.get("experts_by_rows") or {}).items()]


def plot(tables: dict[int, list[dict[str, Any]]], experts: list[dict[str, Any]], path: Path,
         title: str) -> None:
    fig, axes = subplots(1, 3, figsize=(16, 4.2))
    for c, rows in tables.items():
        axes[0].plot([r["rows_per_request"] for r in rows], [r["speed_vs_plain"] for r in rows],
                     "o-", label=f"c={c} measured")
        axes[0].plot([r["rows_per_request"] for r in rows],
                     [r["speed_if_rows_free"] for r in rows], "x--", label=f"c={c} rows free")
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set_xlabel("verify rows per request (1 + width)")
    axes[0].set_ylabel("DSpark / plain tokens/s")
    axes[0].legend(fontsize=7)
    c, rows = next(iter(tables.items()))
    bottom = [0.0] * len(rows)
    for term in TERMS:
        vals = [r["terms_ms"][term] for r in rows]
        axes[1].bar([r["rows_per_request"] for r in rows], vals, bottom=bottom, label=term)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    axes[1].plot([r["rows_per_request"] for r in rows], [r["extra_allowed_ms"] for r in rows],
                 "k^-", label="allowed for the target")
    axes[1].set_xlabel(f"verify rows per request (c={c})")
    axes[1].set_ylabel("ms over a plain step")
    axes[1].legend(fontsize=7)
    if experts:
        axes[2].plot([e["rows"] for e in experts],
                     [e["distinct_experts_per_layer"] for e in experts], "o-")
    axes[2].set_xlabel("rows in the step")
    axes[2].set_ylabel("distinct routed experts per MoE layer")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    save_png(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step-cost", type=Path, default=recipe.REPO / "bench-results/step_cost.json")
    ap.add_argument("--target", type=float, default=1.3, help="DSpark / plain speed-up asked")
    ap.add_argument("--out", type=Path, default=recipe.REPO / "bench-results/measured_roofline")
    args = ap.parse_args(argv)
    result = json.loads(args.step_cost.read_text())
    tables = {c: width_table(result, c, args.target) for c in result["concurrency"]}
    tables = {c: t for c, t in tables.items() if t}
    if not tables:
        sys.exit(f"{args.step_cost}: no forced-width passes (run step_cost without --no-widths)")
    experts = experts_table(result)
    meta = result.get("meta", {})
    title = (f"{result['profile']}, T={result['temperature']}, {result['clock']} clock, "
             f"{meta.get('date')} {meta.get('commit')} {meta.get('cpu')}")
    print(title)
    best = {}
    for c, rows in tables.items():
        print(f"c={c}: plain step {rows[0]['plain_step_ms']:.1f} ms; ms over it by term, and "
              f"what {args.target:.2f}x allows")
        print(f"  {'rows':>4}{'accept len':>11}{'verify rows':>12}{'draft':>8}{'host':>8}"
              f"{'allowed':>9}{'speed':>7}{'rows free':>10}  largest")
        for r in rows:
            t = r["terms_ms"]
            print(f"  {r['rows_per_request']:>4}{r['acceptance_length']:>11.2f}"
                  f"{t['verify rows']:>12.1f}{t['draft']:>8.1f}{t['host']:>8.1f}"
                  f"{r['extra_allowed_ms']:>9.1f}{r['speed_vs_plain']:>6.2f}x"
                  f"{r['speed_if_rows_free']:>9.2f}x  {r['largest_term']}")
        best[c] = max(rows, key=lambda r: r["speed_vs_plain"])
    if experts:
        print("distinct experts per MoE layer by rows: " + ", ".join(
            f"{e['rows']}: {e['distinct_experts_per_layer']:.1f}" for e in experts))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = {"step_cost": str(args.step_cost), "target": args.target, "title": title,
           "by_concurrency": tables, "experts_by_rows": experts,
           "best_width": {c: b["width"] for c, b in best.items()}}
    args.out.with_suffix(".json").write_text(json.dumps(out, indent=2) + "\n")
    plot(tables, experts, args.out.with_suffix(".png"), title)
    print(f"wrote {args.out}.json and .png")
    print("measured_roofline: best width " + ", ".join(
        f"c={c} w={b['width']} ({b['speed_vs_plain']:.2f}x, largest term {b['largest_term']})"
        for c, b in best.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
