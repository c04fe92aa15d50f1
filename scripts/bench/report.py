"""Views of a sweep result: the Markdown tables (levels, content types) and the PNG charts.

Timing columns are `vllm bench serve`'s own numbers for the level, unchanged; acceptance
and the server-counter decode rate come from the level's /metrics deltas.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
    return {"drafts": drafts, "acceptance_rate": accepted / sum(s["num_draft_tokens"] for s in spec),
            "mean_acceptance_length": 1.0 + accepted / drafts,
            "per_position": [x / drafts for x in per_pos]}


def roofline_cell(level: dict[str, Any]) -> tuple[str, str]:
    """(roofline tok/s, measured / roofline), both ranges for DSpark (module roofline)."""
    roof, measured = level.get("roofline"), level.get("server_decode_tok_s")
    if not roof:
        return "–", "–"
    if "tok_s_low" not in roof:
        ratio = f"{measured / roof['decode_tok_s']:.1%}" if measured else "–"
        return _f(roof["decode_tok_s"]), ratio
    cell = f"{roof['tok_s_low']:.1f} .. {roof['tok_s_high']:.1f}"
    if not measured:
        return cell, "–"
    return cell, f"{measured / roof['tok_s_high']:.1%} .. {measured / roof['tok_s_low']:.1%}"


def _level_row(lv: dict[str, Any]) -> str:
    v, acc = lv["vllm_bench"], acceptance([lv]) or {}
    roof, ratio = roofline_cell(lv)
    return (
        f"| {lv['content']} | {lv['prompt_len']} | {lv['concurrency']} "
        f"| {v['completed']}/{lv['num_requests']} "
        f"| {_f(v['p50_ttft_ms'])} / {_f(v['p99_ttft_ms'])} "
        f"| {_f(v['p50_itl_ms'])} / {_f(v['p99_itl_ms'])} | {_f(v['p50_tpot_ms'])} "
        f"| {_f(v['output_throughput'])} | {_f(lv['server_decode_tok_s'])} "
        f"| {_f(acc.get('acceptance_rate'), 3)} | {_f(acc.get('mean_acceptance_length'), 2)} "
        f"| {roof} | {ratio} |"
    )


def markdown(result: dict[str, Any]) -> str:
    p, cfg, levels = result["provenance"], result["config"], result["levels"]
    machine = p["gpu"] or f"{p['cpu']} ({p['cpu_count']} CPUs)"
    lines = [
        f"## Serving sweep: profile `{p['profile']}`, {p['created_utc']}",
        "",
        f"- commit {p['commit']}{' (dirty)' if p['dirty'] else ''}, vLLM server "
        f"{p['vllm_server'] or '?'} / client {p['vllm_client']}, client machine {machine}",
        f"- {cfg['endpoint']} API, output {cfg['output_len']} tokens (EOS ignored), "
        f"{cfg['rounds']} x concurrency requests per level, {cfg['warmup']} warm-up requests "
        f"excluded; roofline at {cfg['bandwidth_gbs']:g} GB/s per GPU",
    ]
    if result.get("note"):
        lines.append(f"- note: {result['note']}")
    lines += [
        "",
        "| content | prompt | C | ok | TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT p50 ms "
        "| output tok/s | server decode tok/s | accept rate | accept len | roofline tok/s "
        "| measured / roofline |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(_level_row(lv) for lv in levels),
    ]
    by_content = content_acceptance(levels)
    if by_content:
        lines += ["", "| content | drafts | accept rate | accept len | acceptance by draft position |",
                  "|---|---:|---:|---:|---|"]
        for kind, acc in by_content.items():
            lines.append(f"| {kind} | {acc['drafts']} | {acc['acceptance_rate']:.3f} "
                         f"| {acc['mean_acceptance_length']:.2f} | "
                         + " ".join(f"{x:.2f}" for x in acc["per_position"]) + " |")
    else:
        lines += ["", "No spec-decode counters on /metrics (speculation off)."]
    return "\n".join(lines) + "\n"


def content_acceptance(levels: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    kinds = dict.fromkeys(lv["content"] for lv in levels)
    out = {k: acceptance([lv for lv in levels if lv["content"] == k]) for k in kinds}
    return {k: v for k, v in out.items() if v}


def write_plots(result: dict[str, Any], stem: Path) -> list[Path]:
    """STEM-acceptance.png (acceptance by draft position, one line per content type) and
    STEM-decode.png (server-counter decode tok/s by concurrency, one line per content type
    and prompt length)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels, title = result["levels"], f"profile {result['provenance']['profile']}"
    written = []
    by_content = content_acceptance(levels)
    if by_content:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for kind, acc in by_content.items():
            xs = range(1, len(acc["per_position"]) + 1)
            ax.plot(xs, acc["per_position"], "o-",
                    label=f"{kind} (len {acc['mean_acceptance_length']:.2f})")
        ax.set(xlabel="draft position", ylabel="accepted / drafts", ylim=(0, 1.02),
               title=f"Acceptance by draft position, {title}")
        written.append(_save(fig, ax, stem.with_name(stem.name + "-acceptance.png")))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind in dict.fromkeys(lv["content"] for lv in levels):
        for plen in sorted({lv["prompt_len"] for lv in levels}):
            pts = sorted((lv["concurrency"], lv["server_decode_tok_s"]) for lv in levels
                         if lv["content"] == kind and lv["prompt_len"] == plen
                         and lv["server_decode_tok_s"] is not None)
            if pts:
                ax.plot([c for c, _ in pts], [v for _, v in pts], "o-",
                        label=f"{kind}, prompt {plen}")
    ax.set(xlabel="concurrent requests", ylabel="server-counter decode tok/s", ylim=(0, None),
           title=f"Decode throughput, {title}")
    written.append(_save(fig, ax, stem.with_name(stem.name + "-decode.png")))
    plt.close("all")
    return written


def _save(fig: Any, ax: Any, path: Path) -> Path:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
