"""The sweep: content type x prompt length x concurrency, each level one `vllm bench serve` run.

vLLM's tool sends the load and measures TTFT, TPOT, ITL, E2EL and throughput (its
`--save-result` JSON is kept per level, verbatim). Around each level this module reads the
server's /metrics (with the API key, which vLLM's tool does not send there) and records the
deltas of the spec-decode counters, DSpark's series and the token counters, from which the
server-counter decode rate = generated tokens / vLLM's benchmark duration. Warm-up requests
run before the first level and are in no level's deltas.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import itertools
import json
import os
import platform
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .. import recipe
from . import content, levels
from .figures import cpu_name

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
    os.environ.update({"OPENAI_API_KEY": api_key} if api_key else {})
    try:
        yield
    finally:
        os.environ.pop("OPENAI_API_KEY", None)
        os.environ.update({"OPENAI_API_KEY": old} if old is not None else {})


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
    return argv + (["--temperature", str(cfg.temperature)] if cfg.temperature is not None else [])


def run_vllm_bench(cfg: SweepConfig, tokenizer: Any, name: str, kind: str, prompt_len: int,
                   conc: int, n: int) -> dict[str, Any]:
    """Write the level's prompts (levels/NAME.jsonl), run one `vllm bench serve` on them
    through its Python entry point (its printout to NAME.log); its saved JSON (NAME.json)."""
    from vllm.benchmarks.serve import add_cli_args, main_async
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    levels = cfg.out_dir / "levels"
    levels.mkdir(parents=True, exist_ok=True)
    data = levels / f"{name}.jsonl"
    content.write_dataset(data, tokenizer, kind, prompt_len, n, f"{cfg.tag}-{name}")
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    args = parser.parse_args(vllm_bench_argv(cfg, data, n, conc, levels / f"{name}.json"))
    with _client_key(cfg.api_key), (levels / f"{name}.log").open("w") as out, \
            contextlib.redirect_stdout(out):
        asyncio.run(main_async(args))
    return json.loads((levels / f"{name}.json").read_text())


def get(base_url: str, path: str, api_key: str | None) -> bytes:
    req = urllib.request.Request(base_url + path)
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.read()


def scrape(base_url: str, api_key: str | None) -> dict[str, Any]:
    """Every per-level /metrics series now (None where the server exposes none)."""
    return levels.read_level_snapshot(get(base_url, "/metrics", api_key).decode())


def run_sweep(cfg: SweepConfig, tokenizer: Any, log=print) -> list[dict[str, Any]]:
    """Warm up, then every level in order; one record per level: vLLM's JSON (verbatim),
    the /metrics deltas and the server-counter decode rate."""
    if cfg.warmup:
        run_vllm_bench(cfg, tokenizer, "warmup", cfg.contents[0], min(cfg.prompt_lens),
                       cfg.warmup, cfg.warmup)
    records = []
    for kind, plen, conc in itertools.product(cfg.contents, cfg.prompt_lens, cfg.concurrency):
        name, n = f"{kind}-p{plen}-c{conc}", cfg.rounds * conc
        log(f"[bench] level {name}")
        before = scrape(cfg.base_url, cfg.api_key)
        theirs = run_vllm_bench(cfg, tokenizer, name, kind, plen, conc, n)
        series, problems = levels.level_deltas(before, scrape(cfg.base_url, cfg.api_key))
        for line in problems:
            log(f"[bench] warning: {name}: {line}")
        tokens, duration = series["tokens"], theirs["duration"]
        records.append({
            "content": kind, "prompt_len": plen, "concurrency": conc, "num_requests": n,
            "output_len": cfg.output_len, "vllm_bench": theirs,
            "vllm_bench_file": f"levels/{name}.json", **series,
            "server_decode_tok_s": tokens["generation"] / duration if tokens and duration else None,
        })
    return records


def _run(*cmd: str) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def provenance(profile: dict[str, Any], base_url: str, api_key: str | None) -> dict[str, Any]:
    """Commit, profile, vLLM versions (server and client) and the client's CPU and GPU."""
    from vllm import __version__ as client_vllm

    try:
        server = json.loads(get(base_url, "/version", api_key)).get("version")
    except (OSError, ValueError):
        server = None
    git = ("git", "-C", str(recipe.REPO))
    return {
        "created_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": _run(*git, "rev-parse", "--short", "HEAD"),
        "dirty": bool(_run(*git, "status", "--porcelain", "--untracked-files=no")),
        "profile": profile["name"], "profile_config": profile,
        "vllm_server": server, "vllm_client": client_vllm,
        "cpu": cpu_name(), "cpu_count": os.cpu_count(),
        "gpu": _run("nvidia-smi", "--query-gpu=name", "--format=csv,noheader"),
        "host": platform.node(),
    }
