"""The sweep: for every (prompt length, concurrency) level, `rounds x concurrency` streaming
requests kept `concurrency` in flight (closed loop), with /metrics read before and after.

Warm-up requests run first and are excluded; sampling seeds are fixed (`seed + request
index`); a random run id in every prompt's prefix keeps repeated invocations cold.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp

from .. import recipe
from . import provenance
from .progress import Progress
from .prometheus import level_deltas, read_level_snapshot
from .prompts import PromptBuilder
from .schema import RESULT_KIND, SCHEMA_VERSION
from .server import BenchError, Server
from .stats import summarize
from .stream import RequestResult, stream_request


@dataclasses.dataclass
class SweepConfig:
    base_url: str
    model: str | None = None
    endpoint: str = "completions"  # or "chat"
    concurrency: tuple[int, ...] = (1, 2, 4, 6, 16)
    prompt_lens: tuple[int, ...] = (256, 2048)
    output_len: int = 256
    rounds: int = 2
    warmup: int = 2
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = True
    request_timeout: float = 600.0
    ramp_s: float = 0.0
    api_key: str | None = None
    extra_body: dict[str, Any] | None = None
    chunk_usage: bool = True
    profile: str | None = None
    pins_path: Path | None = recipe.PINS_FILE
    run_id: str | None = None
    note: str | None = None
    # drop prompt lengths that do not fit max_model_len instead of refusing (CLI defaults)
    fit_prompt_lens: bool = False
    progress: bool = False

    def check(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise BenchError(f"endpoint must be 'completions' or 'chat', got {self.endpoint!r}")
        for name in ("concurrency", "prompt_lens"):
            levels = getattr(self, name)
            if not levels or any(int(x) < 1 for x in levels):
                raise BenchError(f"{name} must be a non-empty list of integers >= 1: {levels}")
        if self.output_len < 2:
            raise BenchError("output_len must be >= 2 (decode speed needs two tokens)")
        if self.rounds < 1 or self.warmup < 0:
            raise BenchError("rounds must be >= 1 and warmup >= 0")
        if self.request_timeout <= 0 or self.ramp_s < 0:
            raise BenchError("request_timeout must be > 0 and ramp_s >= 0")
        if self.profile:
            provenance.check_profile_name(self.profile)

    def request_body(self, model: str, prompt: Any, max_tokens: int, seed: int) -> dict:
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": self.temperature,
            "seed": seed,
            "ignore_eos": self.ignore_eos,
        }
        if self.chunk_usage:
            body["stream_options"]["continuous_usage_stats"] = True
        body["messages" if self.endpoint == "chat" else "prompt"] = prompt
        body.update(self.extra_body or {})
        return body


@dataclasses.dataclass
class _Bench:
    """What every level shares: the config, the HTTP session, the server, the prompt source."""

    cfg: SweepConfig
    session: aiohttp.ClientSession
    server: Server
    prompts: PromptBuilder
    progress: Progress

    async def run_level(
        self, tag: str, concurrency: int, prompt_len: int, n_requests: int, max_tokens: int
    ) -> tuple[list[RequestResult], float]:
        """Build the prompts, then run them closed-loop at `concurrency`; (results, wall s)."""
        cfg, server = self.cfg, self.server
        path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
        prompts: list[tuple[Any, int]] = []
        for i in range(n_requests):
            if cfg.endpoint == "chat":
                prompts.append(await self.prompts.chat_prompt(f"{tag}-{i}", prompt_len))
            else:
                ids = await self.prompts.completion_prompt(f"{tag}-{i}", prompt_len)
                prompts.append((ids, prompt_len))
        sem = asyncio.Semaphore(concurrency)
        t_start = time.perf_counter()

        async def one(i: int) -> RequestResult:
            if cfg.ramp_s and i < concurrency:
                await asyncio.sleep(i * cfg.ramp_s)
            prompt, expected = prompts[i]
            body = cfg.request_body(server.model, prompt, max_tokens, cfg.seed + i)
            async with sem:
                res = await stream_request(
                    self.session,
                    server.base + path,
                    body,
                    RequestResult(i, expected),
                    cfg.endpoint,
                    cfg.request_timeout,
                )
            self.progress.update(res.status == "ok")
            return res

        results = await asyncio.gather(*(one(i) for i in range(n_requests)))
        ends = [r.end_time for r in results if r.end_time is not None]
        wall = (max(ends) if ends else time.perf_counter()) - t_start
        return list(results), wall

    async def metrics_snapshot(self) -> dict[str, Any]:
        """Every per-level /metrics series now (prometheus.LEVEL_SERIES)."""
        text = await self.server.metrics_text()
        try:
            return read_level_snapshot(text)
        except ValueError as exc:
            print(f"[bench] warning: could not parse /metrics: {exc}", file=sys.stderr)
            return read_level_snapshot(None)


def run_summary(
    cfg: SweepConfig,
    concurrency: int,
    prompt_len: int,
    results: list[RequestResult],
    wall: float,
    series: dict[str, Any],
) -> dict[str, Any]:
    """One level of the result (schema.RUN), from its requests and its /metrics deltas."""
    ok = [r for r in results if r.status == "ok"]
    errors: dict[str, int] = {}
    for r in results:
        if r.status != "ok":
            errors[r.status] = errors.get(r.status, 0) + 1
    total_out = sum(r.output_tokens or 0 for r in ok)
    per_stream = summarize(r.decode_tok_s for r in ok)
    streams = min(concurrency, len(results))
    bases = {r.itl_basis or "chunks" for r in ok}
    basis = bases.pop() if len(bases) == 1 else ("mixed" if bases else "none")
    return {
        "concurrency": concurrency,
        "prompt_len": prompt_len,
        "output_len": cfg.output_len,
        "num_requests": len(results),
        "num_ok": len(ok),
        "num_errors": len(results) - len(ok),
        "errors": errors,
        "duration_s": wall,
        "total_output_tokens": total_out,
        "prompt_len_mismatches": sum(
            1
            for r in ok
            if r.prompt_tokens is not None and r.prompt_tokens != r.expected_prompt_tokens
        ),
        "output_tok_s": total_out / wall if ok and wall > 0 else None,
        "aggregate_decode_tok_s": streams * per_stream["mean"] if per_stream else None,
        "itl_basis": basis,
        "ttft_s": summarize(r.ttft_s for r in ok),
        "itl_s": summarize(x for r in ok for x in r.itl),
        "chunk_gap_s": summarize(x for r in ok for x in r.chunk_gaps),
        "decode_tok_s_per_stream": per_stream,
        "e2e_s": summarize(r.e2e_s for r in ok),
        **series,
        "requests": [r.to_json() for r in results],
    }


def _fit_prompt_lens(cfg: SweepConfig, max_model_len: int | None) -> list[int]:
    """Refuse (or, for default lengths, drop and return) prompt lengths that do not fit."""
    if max_model_len is None:
        return []
    too_long = [p for p in cfg.prompt_lens if p + cfg.output_len > max_model_len]
    if not too_long:
        return []
    if cfg.fit_prompt_lens and len(too_long) < len(cfg.prompt_lens):
        cfg.prompt_lens = tuple(p for p in cfg.prompt_lens if p not in too_long)
        print(
            f"[bench] note: skipping default prompt lengths {too_long}: with output_len "
            f"{cfg.output_len} they exceed the server's max_model_len {max_model_len}",
            file=sys.stderr,
        )
        return too_long
    raise BenchError(
        f"prompt lengths {too_long} + output_len {cfg.output_len} exceed the "
        f"server's max_model_len {max_model_len}; lower --prompt-lens or --output-len"
    )


async def _warm_up(bench: _Bench) -> int:
    cfg = bench.cfg
    if not cfg.warmup:
        return 0
    bench.progress.start("warm-up", cfg.warmup)
    warm, _ = await bench.run_level(
        "w", cfg.warmup, min(cfg.prompt_lens), cfg.warmup, min(cfg.output_len, 16)
    )
    warm_ok = sum(r.status == "ok" for r in warm)
    bench.progress.finish(f"{warm_ok}/{cfg.warmup} ok")
    return warm_ok


async def _measure(bench: _Bench) -> list[dict[str, Any]]:
    cfg = bench.cfg
    levels = [(p, c) for p in cfg.prompt_lens for c in cfg.concurrency]
    runs = []
    for n, (prompt_len, conc) in enumerate(levels):
        n_req = cfg.rounds * conc
        bench.progress.start(f"[{n + 1}/{len(levels)}] len={prompt_len} c={conc}", n_req)
        before = await bench.metrics_snapshot()
        results, wall = await bench.run_level(f"r{n}", conc, prompt_len, n_req, cfg.output_len)
        series, problems = level_deltas(before, await bench.metrics_snapshot())
        for line in problems:
            print(f"\n[bench] warning: {line}", file=sys.stderr)
        run = run_summary(cfg, conc, prompt_len, results, wall, series)
        runs.append(run)
        agg = run["aggregate_decode_tok_s"]
        bench.progress.finish(
            f"ok={run['num_ok']}/{n_req} agg decode "
            + (f"{agg:.1f} tok/s" if agg is not None else "n/a")
        )
    return runs


async def run_sweep_async(cfg: SweepConfig) -> dict[str, Any]:
    """Run the whole sweep and return the result dict (schema.RESULT)."""
    cfg.check()
    run_id = cfg.run_id or uuid.uuid4().hex[:8]
    connector = aiohttp.TCPConnector(limit=max(max(cfg.concurrency), cfg.warmup) + 4)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    async with aiohttp.ClientSession(
        connector=connector, headers=headers, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        server = Server(session, cfg.base_url, cfg.model)
        await server.probe()
        if server.max_model_len is None:
            await server.tokenize("x", True)  # /tokenize also reports max_model_len
        dropped = _fit_prompt_lens(cfg, server.max_model_len)
        prompts = PromptBuilder(server, cfg.seed, run_id)
        await prompts.prepare(max(cfg.prompt_lens))
        bench = _Bench(cfg, session, server, prompts, Progress(cfg.progress))
        warm_ok = await _warm_up(bench)
        runs = await _measure(bench)

    profile_name, profile_source, profile_cfg = provenance.resolve_profile(
        cfg.profile, server.model
    )
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": RESULT_KIND,
        "created_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "run_id": run_id,
        "note": cfg.note,
        "recipe": {
            "profile": profile_name,
            "profile_source": profile_source,
            "profile_config": profile_cfg,
            "pins": provenance.pins(cfg.pins_path),
        },
        "machine": {
            "client": provenance.client_info(),
            "server": {
                "base_url": server.base,
                "model": server.model,
                "version": server.version,
                "max_model_len": server.max_model_len,
            },
        },
        "config": {
            "endpoint": cfg.endpoint,
            "concurrency": list(cfg.concurrency),
            "prompt_lens": list(cfg.prompt_lens),
            "skipped_prompt_lens": dropped,
            "output_len": cfg.output_len,
            "rounds": cfg.rounds,
            "warmup": cfg.warmup,
            "seed": cfg.seed,
            "temperature": cfg.temperature,
            "ignore_eos": cfg.ignore_eos,
            "request_timeout_s": cfg.request_timeout,
            "ramp_s": cfg.ramp_s,
            "extra_body": cfg.extra_body,
        },
        "warmup": {"num_requests": cfg.warmup, "num_ok": warm_ok},
        "metrics_available": any(run["spec_decode"] is not None for run in runs),
        "runs": runs,
    }


def run_sweep(base_url: str, **kwargs: Any) -> dict[str, Any]:
    """Synchronous entry point: `run_sweep(url, concurrency=(1, 2), ...)` -> result dict.

    Keyword arguments are the fields of SweepConfig. Raises BenchError when the server
    cannot be used (unreachable, no /tokenize, prompts too long); individual request
    failures never raise, they are recorded in the result.
    """
    for key in ("concurrency", "prompt_lens"):
        if key in kwargs:
            kwargs[key] = tuple(int(x) for x in kwargs[key])
    if kwargs.get("pins_path") is not None:
        kwargs["pins_path"] = Path(kwargs["pins_path"])
    return asyncio.run(run_sweep_async(SweepConfig(base_url=base_url, **kwargs)))
