"""The sweep: content type x prompt length x concurrency, each level one `vllm bench serve` run.

vLLM's tool sends the load and measures TTFT, TPOT, ITL, E2EL and throughput (its
`--save-result` JSON is kept per level, verbatim). Around each level this module reads the
server's /metrics (with the API key, which vLLM's tool does not send there) and records the
deltas of the spec-decode counters, DSpark's series and the token counters, from which the
server-counter decode rate = generated tokens / vLLM's benchmark duration. Warm-up requests
run before the first level and are in no level's deltas.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import os
import platform
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .. import recipe
from . import content, prometheus

RESULT_KIND = "dspark-serving-sweep"


@dataclasses.dataclass
class SweepConfig:
    base_url: str
    model: str
    tokenizer: str
    out_dir: Path  # vLLM's per-level JSON and the datasets go to out_dir/levels/
    contents: tuple[str, ...] = content.CONTENT_TYPES
    concurrency: tuple[int, ...] = (1, 4)
    prompt_lens: tuple[int, ...] = (256,)
    output_len: int = 128
    rounds: int = 2  # requests per level = rounds x concurrency
    warmup: int = 2
    endpoint: str = "completions"  # or "chat"
    temperature: float | None = None  # None: the server's default
    api_key: str | None = None
    seed: int = 0
    tag: str = "run"  # in every prompt's first line: different per run, so caches stay cold


@contextlib.contextmanager
def _client_key(api_key: str | None) -> Iterator[None]:
    """vLLM's bench client sends $OPENAI_API_KEY as the bearer token."""
    old = os.environ.get("OPENAI_API_KEY")
    if api_key:
        os.environ["OPENAI_API_KEY"] = api_key
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("OPENAI_API_KEY", None)
        else:
            os.environ["OPENAI_API_KEY"] = old


def vllm_bench_argv(cfg: SweepConfig, dataset: Path, n: int, conc: int, out: Path) -> list[str]:
    chat = cfg.endpoint == "chat"
    argv = [
        "--backend", "openai-chat" if chat else "openai",
        "--endpoint", "/v1/chat/completions" if chat else "/v1/completions",
        "--base-url", cfg.base_url, "--model", cfg.model, "--tokenizer", cfg.tokenizer,
        "--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template",
        "--disable-shuffle", "--num-prompts", str(n), "--max-concurrency", str(conc),
        "--output-len", str(cfg.output_len), "--ignore-eos", "--seed", str(cfg.seed),
        "--ready-check-timeout-sec", "0", "--num-warmups", "0", "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
    ]  # fmt: skip
    if cfg.temperature is not None:
        argv += ["--temperature", str(cfg.temperature)]
    return argv


def run_vllm_bench(argv: list[str], api_key: str | None, log: Path) -> dict[str, Any]:
    """One `vllm bench serve` through its Python entry point (its printout goes to `log`);
    its saved JSON."""
    from vllm.benchmarks.serve import add_cli_args, main_async
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    args = parser.parse_args(argv)
    with _client_key(api_key), log.open("w") as out, contextlib.redirect_stdout(out):
        asyncio.run(main_async(args))
    return json.loads(Path(args.result_dir, args.result_filename).read_text())


def get(base_url: str, path: str, api_key: str | None) -> bytes:
    req = urllib.request.Request(base_url + path)
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.read()


def scrape(base_url: str, api_key: str | None) -> dict[str, Any]:
    """Every per-level /metrics series now (None where the server exposes none)."""
    text = get(base_url, "/metrics", api_key).decode("utf-8", "replace")
    return prometheus.read_level_snapshot(text)


def level_record(
    key: dict[str, Any], theirs: dict[str, Any], series: dict[str, Any], file: str
) -> dict[str, Any]:
    """One level: what vLLM's tool measured (verbatim) and what /metrics counted."""
    tokens = series.get("tokens")
    duration = theirs.get("duration") or 0.0
    decode = tokens["generation"] / duration if tokens and duration > 0 else None
    return {**key, "vllm_bench": theirs, "vllm_bench_file": file, **series,
            "server_decode_tok_s": decode}


def run_sweep(cfg: SweepConfig, tokenizer: Any, log=print) -> list[dict[str, Any]]:
    """Warm up, then every level in order; the level records."""
    levels_dir = cfg.out_dir / "levels"
    levels_dir.mkdir(parents=True, exist_ok=True)
    if cfg.warmup:
        data = levels_dir / "warmup.jsonl"
        content.write_dataset(data, tokenizer, cfg.contents[0], min(cfg.prompt_lens),
                              cfg.warmup, f"{cfg.tag}-warmup")
        run_vllm_bench(vllm_bench_argv(cfg, data, cfg.warmup, cfg.warmup,
                                       levels_dir / "warmup.json"), cfg.api_key,
                       levels_dir / "warmup.log")
    records = []
    for kind in cfg.contents:
        for plen in cfg.prompt_lens:
            for conc in cfg.concurrency:
                name = f"{kind}-p{plen}-c{conc}"
                log(f"[bench] level {name}")
                n = cfg.rounds * conc
                data = levels_dir / f"{name}.jsonl"
                content.write_dataset(data, tokenizer, kind, plen, n, f"{cfg.tag}-{name}")
                argv = vllm_bench_argv(cfg, data, n, conc, levels_dir / f"{name}.json")
                before = scrape(cfg.base_url, cfg.api_key)
                theirs = run_vllm_bench(argv, cfg.api_key, levels_dir / f"{name}.log")
                series, problems = prometheus.level_deltas(
                    before, scrape(cfg.base_url, cfg.api_key))
                for line in problems:
                    log(f"[bench] warning: {name}: {line}")
                key = {"content": kind, "prompt_len": plen, "concurrency": conc,
                       "num_requests": n, "output_len": cfg.output_len}
                records.append(level_record(key, theirs, series, f"levels/{name}.json"))
    return records


def _run(*cmd: str) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def provenance(profile: str | None, server_version: str | None) -> dict[str, Any]:
    """Commit, profile, vLLM versions and the client machine's CPU and GPU."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor()) \
        if Path("/proc/cpuinfo").exists() else platform.processor()
    from vllm import __version__ as client_vllm

    return {
        "created_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": _run("git", "-C", str(recipe.REPO), "rev-parse", "--short", "HEAD"),
        "dirty": bool(_run("git", "-C", str(recipe.REPO), "status", "--porcelain",
                           "--untracked-files=no")),
        "profile": profile,
        "profile_config": recipe.load_profile(profile) if profile else None,
        "vllm_server": server_version,
        "vllm_client": client_vllm,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "gpu": _run("nvidia-smi", "--query-gpu=name", "--format=csv,noheader"),
        "host": platform.node(),
    }


def server_version(base_url: str, api_key: str | None) -> str | None:
    try:
        return json.loads(get(base_url, "/version", api_key)).get("version")
    except (OSError, ValueError):
        return None


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,4, got {text!r}")
    return values
