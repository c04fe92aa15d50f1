"""Views of a sweep result: Markdown tables (levels, content types) and PNG charts. Timings are
`vllm bench serve`'s own numbers; acceptance and server decode come from /metrics deltas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .figures import save_png, subplots


def _f(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def acceptance(levels: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Acceptance over levels from their summed counters: rate = accepted / draft tokens,
    length = 1 + accepted / drafts (tokens per verify step, bonus included, as vLLM's log),
    per position k = accepted at draft position k / drafts."""
    spec = [lv["spec_decode"] for lv in levels if lv.get("spec_decode")]
    drafts = sum(s["num_drafts"] for s in spec)
    if not drafts:
        return None
    width = max(len(s["accepted_per_position"]) for s in spec)
    per_pos = [sum((s["accepted_per_position"] + [0] * width)[k] for s in spec)
               for k in range(width)]
    accepted = sum(s["num_accepted_tokens"] for s in spec)
    draft_tokens = sum(s["num_draft_tokens"] for s in spec)
    return {"drafts": drafts, "acceptance_rate": accepted / draft_tokens,
            "mean_acceptance_length": 1.0 + accepted / drafts,
            "per_position": [x / drafts for x in per_pos]}


def content_acceptance(levels: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    kinds = dict.fromkeys(lv["content"] for lv in levels)
    out = {k: acceptance([lv for lv in levels if lv["content"] == k]) for k in kinds}
    return {k: v for k, v in out.items() if v}


def roofline_cells(level: dict[str, Any]) -> list[str]:
    """[roofline tok/s, measured / roofline]: ranges under DSpark (see module roofline)."""
    roof, got = level.get("roofline") or {}, level.get("server_decode_tok_s")
    if "tok_s_low" in roof:
        lo, hi = roof["tok_s_low"], roof["tok_s_high"]
        return [f"{lo:.1f} .. {hi:.1f}", f"{got / hi:.1%} .. {got / lo:.1%}" if got else "–"]
    if roof:
        return [_f(roof["decode_tok_s"]), f"{got / roof['decode_tok_s']:.1%}" if got else "–"]
    return ["–", "–"]


def _level_row(lv: dict[str, Any]) -> str:
    v, acc = lv["vllm_bench"], acceptance([lv]) or {}
    cells = [lv["content"], lv["prompt_len"], lv["concurrency"],
             f"{v['completed']}/{lv['num_requests']}",
             f"{_f(v['p50_ttft_ms'])} / {_f(v['p99_ttft_ms'])}",
             f"{_f(v['p50_itl_ms'])} / {_f(v['p99_itl_ms'])}", _f(v["p50_tpot_ms"]),
             _f(v["output_throughput"]), _f(lv["server_decode_tok_s"]),
             _f(acc.get("acceptance_rate"), 3), _f(acc.get("mean_acceptance_length"), 2),
             *roofline_cells(lv)]
    return "| " + " | ".join(map(str, cells)) + " |"


def markdown(result: dict[str, Any]) -> str:
    p, cfg, levels = result["provenance"], result["config"], result["levels"]
    lines = [
        f"## Serving sweep: profile `{p['profile']}`, {p['created_utc']}", "",
        f"- commit {p['commit']}{' (dirty)' if p['dirty'] else ''}, vLLM server "
        f"{p['vllm_server'] or '?'} / client {p['vllm_client']}, client machine "
        f"{p['gpu'] or p['cpu']} ({p['cpu_count']} CPUs)",
        f"- {cfg['endpoint']} API, output {cfg['output_len']} tokens (EOS ignored), "
        f"{cfg['rounds']} x concurrency requests per level, {cfg['warmup']} warm-up requests "
        f"excluded; roofline at {cfg['bandwidth_gbs']:g} GB/s per GPU",
        *([f"- note: {result['note']}"] if result.get("note") else []), "",
        "| content | prompt | C | ok | TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT p50 ms "
        "| output tok/s | server decode tok/s | accept rate | accept len | roofline tok/s "
        "| measured / roofline |",
        "|---|" + "---:|" * 12,
        *(_level_row(lv) for lv in levels), "",
    ]
    by_content = content_acceptance(levels)
    if not by_content:
        return "\n".join([*lines, "No spec-decode counters on /metrics (speculation off)."]) + "\n"
    lines += ["| content | drafts | accept rate | accept len | acceptance by draft position |",
              "|---|---:|---:|---:|---|"]
    lines += [f"| {kind} | {a['drafts']} | {a['acceptance_rate']:.3f} "
              f"| {a['mean_acceptance_length']:.2f} | "
              + " ".join(f"{x:.2f}" for x in a["per_position"]) + " |"
              for kind, a in by_content.items()]
    return "\n".join(lines) + "\n"


def write_plots(result: dict[str, Any], stem: Path) -> list[Path]:
    """STEM-acceptance.png (acceptance by draft position, one line per content type; with
    speculation) and STEM-decode.png (server decode tok/s by concurrency, one line per content
    type and prompt length)."""
    levels, title = result["levels"], f"profile {result['provenance']['profile']}"
    charts = []
    if by_content := content_acceptance(levels):
        lines = [(range(1, len(a["per_position"]) + 1), a["per_position"],
                  f"{kind} (len {a['mean_acceptance_length']:.2f})")
                 for kind, a in by_content.items()]
        charts.append(("acceptance", lines, "draft position", "accepted / drafts",
                       f"Acceptance by draft position, {title}"))
    lines = []
    for kind in dict.fromkeys(lv["content"] for lv in levels):
        for plen in sorted({lv["prompt_len"] for lv in levels}):
            pts = sorted((lv["concurrency"], lv["server_decode_tok_s"]) for lv in levels
                         if (lv["content"], lv["prompt_len"]) == (kind, plen)
                         and lv["server_decode_tok_s"] is not None)
            lines += [([c for c, _ in pts], [v for _, v in pts], f"{kind}, prompt {plen}")]
    charts.append(("decode", lines, "concurrent requests", "server decode tok/s",
                   f"Decode throughput, {title}"))
    written = []
    for suffix, series, xlabel, ylabel, chart_title in charts:
        fig, ax = subplots(figsize=(7, 4.5))
        for xs, ys, label in series:
            ax.plot(xs, ys, "o-", label=label)
        ax.set(xlabel=xlabel, ylabel=ylabel, title=chart_title, ylim=(0, None),
               xticks=sorted({x for xs, _, _ in series for x in xs}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        written.append(stem.with_name(f"{stem.name}-{suffix}.png"))
        save_png(fig, written[-1])
    return written
