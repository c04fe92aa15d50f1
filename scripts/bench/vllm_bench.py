"""Cross-check: run vLLM's own `vllm bench serve` on the levels of a sweep result, same server
and load, and print TTFT / ITL side by side.

    python -m scripts.bench.vllm_bench bench-results/NAME.json [--tokenizer PATH]

For each level (prompt length, concurrency) it sends the same number of requests with vLLM's
random dataset (prompts of exactly that many token ids, EOS ignored, same output length,
`--max-concurrency` = the level's concurrency). Two different clients measuring the same
server should agree on TTFT; ITL differs by definition under speculative decoding: ours is
per token (a chunk gap divided by the tokens in the chunk), vLLM's ITL is per chunk gap, and
its TPOT ((e2e - TTFT) / (tokens - 1)) is the comparable per-token figure.
Writes NAME-vllm-bench.{json,md} next to the result. Exit 2 when `vllm bench serve` fails.
The API key is $VLLM_API_KEY, as for the sweep (handed to vLLM's client as OPENAI_API_KEY).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import recipe
from .compare import load_result

# (label, our run's getter, key in vLLM's result JSON); ours in seconds, vLLM's in ms.
COLUMNS = [
    ("TTFT p50 ms", lambda r: (r["ttft_s"] or {}).get("p50"), "p50_ttft_ms"),
    ("TTFT p99 ms", lambda r: (r["ttft_s"] or {}).get("p99"), "p99_ttft_ms"),
    ("ITL p50 ms", lambda r: (r["itl_s"] or {}).get("p50"), "p50_itl_ms"),
    ("ITL p99 ms", lambda r: (r["itl_s"] or {}).get("p99"), "p99_itl_ms"),
    ("ITL mean ms / vLLM TPOT mean", lambda r: (r["itl_s"] or {}).get("mean"), "mean_tpot_ms"),
]


def vllm_bench_argv(
    vllm: str, result: dict[str, Any], run: dict[str, Any], tokenizer: str, out_dir: Path
) -> list[str]:
    server = result["machine"]["server"]
    return [
        vllm, "bench", "serve",
        "--backend", "vllm",
        "--base-url", server["base_url"],
        "--model", server["model"],
        "--tokenizer", tokenizer,
        "--dataset-name", "random",
        "--random-input-len", str(run["prompt_len"]),
        "--random-output-len", str(run["output_len"]),
        "--num-prompts", str(run["num_requests"]),
        "--max-concurrency", str(run["concurrency"]),
        "--seed", str(result["config"]["seed"]),
        "--ignore-eos",
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99",
        "--save-result", "--result-dir", str(out_dir), "--result-filename", "level.json",
    ]  # fmt: skip


def default_tokenizer(result: dict[str, Any]) -> str:
    """The profile's model (a local path for cpu-tiny), else the served model name."""
    profile = result["recipe"]["profile"]
    if profile in recipe.list_profiles():
        return recipe.model_ref(recipe.load_profile(profile))
    return result["machine"]["server"]["model"]


def client_env() -> dict[str, str]:
    """vLLM's bench client sends OPENAI_API_KEY as the bearer token; ours is VLLM_API_KEY."""
    env = dict(os.environ)
    if os.environ.get("VLLM_API_KEY"):
        env["OPENAI_API_KEY"] = os.environ["VLLM_API_KEY"]
    return env


def run_level(vllm: str, result: dict, run: dict, tokenizer: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        argv = vllm_bench_argv(vllm, result, run, tokenizer, Path(tmp))
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              env=client_env())
        out = Path(tmp) / "level.json"
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(
                f"`{' '.join(argv)}` exited {proc.returncode}:\n{proc.stdout[-2000:]}"
                f"{proc.stderr[-2000:]}"
            )
        return json.loads(out.read_text())


def _ms(x: float | None, scale: float = 1.0) -> str:
    return "–" if x is None else f"{x * scale:.1f}"


def side_by_side(result: dict[str, Any], theirs: list[dict[str, Any]]) -> str:
    head = " | ".join(f"{label} ours / vLLM" for label, _, _ in COLUMNS)
    lines = [
        "## This sweep vs `vllm bench serve` (same server, same load)",
        "",
        f"| prompt | conc | requests ok ours / vLLM | {head} |",
        "|---:|---:|---:|" + "---:|" * len(COLUMNS),
    ]
    for run, other in zip(result["runs"], theirs, strict=True):
        cells = [f"{_ms(get(run), 1e3)} / {_ms(other.get(key))}" for _, get, key in COLUMNS]
        lines.append(
            f"| {run['prompt_len']} | {run['concurrency']} "
            f"| {run['num_ok']} / {other.get('completed')} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench.vllm_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", type=Path, help="a sweep result JSON (python -m scripts.bench)")
    ap.add_argument("--tokenizer", help="tokenizer for vLLM's random prompts (default: the "
                    "result's profile model, else the served model name)")
    ap.add_argument("--vllm", default=str(Path(sys.executable).with_name("vllm")),
                    help="the vllm command (default: the one next to this Python)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per level")
    args = ap.parse_args(argv)
    try:
        result = load_result(args.result)
    except ValueError as exc:
        print(f"vllm_bench: error: {exc}", file=sys.stderr)
        return 2
    tokenizer = args.tokenizer or default_tokenizer(result)
    theirs = []
    for run in result["runs"]:
        print(f"[vllm bench] len={run['prompt_len']} c={run['concurrency']}", file=sys.stderr)
        try:
            theirs.append(run_level(args.vllm, result, run, tokenizer, args.timeout))
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
            print(f"vllm_bench: error: {exc}", file=sys.stderr)
            return 2
    table = side_by_side(result, theirs)
    stem = args.result.with_suffix("")
    md, js = Path(f"{stem}-vllm-bench.md"), Path(f"{stem}-vllm-bench.json")
    md.write_text(table, encoding="utf-8")
    js.write_text(json.dumps(theirs, indent=2) + "\n", encoding="utf-8")
    print(table)
    print(f"wrote {md}, {js}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
