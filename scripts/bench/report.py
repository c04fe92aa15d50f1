"""Human-readable views of a sweep result: a Markdown table and two PNG charts."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _f(x: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "–" if x is None else f"{x * scale:.{digits}f}"


def _p(stats: dict | None, key: str, scale: float = 1.0, digits: int = 1) -> str:
    return "–" if not stats else _f(stats[key], scale, digits)


def _level_row(r: dict[str, Any]) -> str:
    spec = r.get("spec_decode") or {}
    dspark = r.get("dspark") or {}
    ttft, itl = r["ttft_s"], r["itl_s"]
    return (
        f"| {r['prompt_len']} | {r['concurrency']} | {r['num_ok']}/{r['num_requests']} "
        f"| {_p(ttft, 'p50', 1e3, 0)} / {_p(ttft, 'p90', 1e3, 0)} / {_p(ttft, 'p99', 1e3, 0)} "
        f"| {_p(itl, 'p50', 1e3, 1)} / {_p(itl, 'p99', 1e3, 1)} "
        f"| {_p(r['decode_tok_s_per_stream'], 'p50')} "
        f"| {_f(r['aggregate_decode_tok_s'])} | {_f(r['output_tok_s'])} "
        f"| {_f(spec.get('mean_acceptance_length'), digits=2)} "
        f"| {_f(spec.get('acceptance_rate'), digits=3)} "
        f"| {_f(dspark.get('ragged_share'), digits=2)} |"
    )


def markdown_report(result: dict[str, Any]) -> str:
    srv = result["machine"]["server"]
    cfg = result["config"]
    pins = result["recipe"].get("pins") or {}
    vllm_pin = (pins.get("vllm") or {}).get("version", "?")
    lines = [
        f"## Serving benchmark — profile `{result['recipe']['profile']}`",
        "",
        f"- model `{srv['model']}` at {srv['base_url']}, server vLLM {srv.get('version') or '?'}"
        f" (pin {vllm_pin}), {result['created_utc']}, run `{result['run_id']}`",
        f"- {cfg['endpoint']} API, output {cfg['output_len']} tokens"
        f" (ignore_eos={cfg['ignore_eos']}), {cfg['rounds']} round(s) per level,"
        f" temperature {cfg['temperature']}, seed {cfg['seed']}",
    ]
    if result.get("note"):
        lines.append(f"- note: {result['note']}")
    lines += [
        "",
        "| prompt | conc | ok/n | TTFT p50 / p90 / p99 (ms) | ITL p50 / p99 (ms) "
        "| stream decode p50 (tok/s) | aggregate decode (tok/s) | output (tok/s) "
        "| accept len | accept rate | ragged share |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [_level_row(r) for r in result["runs"]]
    per_pos = [
        (r["prompt_len"], r["concurrency"], r["spec_decode"]["acceptance_per_position"])
        for r in result["runs"]
        if r.get("spec_decode") and r["spec_decode"].get("acceptance_per_position")
    ]
    if per_pos:
        lines += ["", "Per-position acceptance (accepted at draft position k / drafts):", ""]
        for p, c, rates in per_pos:
            lines.append(f"- len={p} c={c}: " + ", ".join(f"{x:.2f}" for x in rates))
    errs = [(r["prompt_len"], r["concurrency"], r["errors"]) for r in result["runs"] if r["errors"]]
    if errs:
        lines += ["", "Failed requests:", ""]
        for p, c, e in errs:
            lines.append(f"- len={p} c={c}: " + ", ".join(f"{k} {v}" for k, v in sorted(e.items())))
    if not result["metrics_available"]:
        lines += ["", "No spec-decode counters on /metrics (speculation off?)."]
    return "\n".join(lines) + "\n"


def _chart(plt: Any, series: list[tuple[str, list, list, str, dict]], out: Path, axes: dict) -> Path:
    """One line chart: series are (label, xs, ys, style, extra plot kwargs)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, xs, ys, style, extra in series:
        ax.plot(xs, ys, style, label=label, **extra)
    if axes.get("log2"):
        ax.set_xscale("log", base=2)
    ax.set_xticks(axes["xticks"], [str(x) for x in axes["xticks"]])
    ax.set_ylim(bottom=0)
    ax.set_xlabel(axes["xlabel"])
    ax.set_ylabel(axes["ylabel"])
    ax.set_title(axes["title"])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def write_plots(result: dict[str, Any], stem: Path) -> list[Path]:
    """Aggregate tok/s vs concurrency and TTFT vs prompt length, as PNGs next to `stem`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    title = f"{result['recipe']['profile']} · {result['machine']['server']['model']}"
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    tok_series, ttft_series = [], []
    for i, plen in enumerate(sorted({r["prompt_len"] for r in runs})):
        pts = sorted(
            (r["concurrency"], r["aggregate_decode_tok_s"], r["output_tok_s"])
            for r in runs
            if r["prompt_len"] == plen and r["aggregate_decode_tok_s"] is not None
        )
        tok_series += _series_pair(pts, colors[i % len(colors)], f"decode, {plen} tok",
                                   f"output, {plen} tok", "x--")
    for i, conc in enumerate(sorted({r["concurrency"] for r in runs})):
        pts = sorted(
            (r["prompt_len"], r["ttft_s"]["p50"], r["ttft_s"]["p90"])
            for r in runs
            if r["concurrency"] == conc and r["ttft_s"]
        )
        ttft_series += _series_pair(pts, colors[i % len(colors)], f"p50, c={conc}",
                                    f"p90, c={conc}", ":")
    plens = sorted({r["prompt_len"] for r in runs})
    return [
        _chart(plt, tok_series, stem.with_name(stem.name + "-tok_s.png"), {
            "xticks": sorted({r["concurrency"] for r in runs}),
            "xlabel": "concurrent streams",
            "ylabel": "aggregate tok/s (output = end-to-end incl. prefill)",
            "title": f"Aggregate throughput — {title}",
        }),
        _chart(plt, ttft_series, stem.with_name(stem.name + "-ttft.png"), {
            "xticks": plens,
            "log2": len(plens) > 1 and plens[-1] / plens[0] >= 8,
            "xlabel": "prompt length (tokens)",
            "ylabel": "TTFT (s)",
            "title": f"Time to first token — {title}",
        }),
    ]


def _series_pair(pts: list[tuple], color: str, label_a: str, label_b: str, b_style: str) -> list:
    """Column 1 as a solid line and column 2 in `b_style`, same colour; nothing if no points."""
    if not pts:
        return []
    xs = [p[0] for p in pts]
    return [
        (label_a, xs, [p[1] for p in pts], "o-", {"color": color}),
        (label_b, xs, [p[2] for p in pts], b_style, {"color": color, "alpha": 0.6}),
    ]
