#!/usr/bin/env python3
"""Serving benchmark: streaming load against an OpenAI-compatible vLLM server.

For every (prompt length, concurrency) pair of the sweep it sends `rounds x concurrency`
streaming requests, keeping `concurrency` of them in flight (closed loop), and measures
per request TTFT, inter-token latency and decode tok/s, per run the aggregate figures,
and speculative-decoding acceptance from the server's /metrics counters read before and
after the run.

How the numbers are made trustworthy
  * Exact prompt lengths: prompts are built from token ids that the server's own
    /tokenize endpoint produced (completions API: the ids are sent as the prompt, so the
    length is exact by construction; chat API: the text is re-tokenized through the chat
    template and trimmed until /tokenize reports the target). usage.prompt_tokens is
    checked against the target and mismatches are counted.
  * Cold prefixes: every request starts with a unique nonce (run id + run + index), so
    the prefix cache never serves a benchmark prompt from an earlier request or run.
  * Warm-up requests (excluded) before the sweep; fixed seeds for filler text and
    sampling (`--seed`); a random run id keeps repeated invocations cold (`--run-id`
    fixes it).
  * Token counts come from `usage`, per chunk from vLLM's continuous usage stats
    (cumulative completion_tokens on every chunk) or `token_ids`, never from counting
    SSE chunks: with speculative decoding one chunk carries several tokens.
  * Decode speed excludes TTFT: decode_tok_s = (output tokens - tokens of the first
    chunk) / (time of last chunk - time of first chunk).

Definitions (all times in seconds)
  ttft_s                  request sent -> first chunk carrying a token.
  itl_s                   per-token inter-token latency: each gap between token-bearing
                          chunks divided by the tokens in the later chunk, one sample per
                          token (itl_basis "chunk_usage" or "token_ids", where the count
                          came from); when the server gives no per-chunk count, one
                          sample per chunk (itl_basis "chunks"; "mixed" if requests
                          differ).
  chunk_gap_s             raw gaps between token-bearing chunks (burstiness under
                          speculative decoding).
  decode_tok_s_per_stream per-request decode_tok_s over the run's ok requests.
  aggregate_decode_tok_s  min(concurrency, requests) x mean per-stream decode tok/s:
                          the decode throughput with that many streams in flight.
  output_tok_s            all completion tokens of ok requests / run wall time
                          (includes prefill and queueing; "server tok/s").
  spec_decode             counter deltas over the run: num_drafts, num_draft_tokens,
                          num_accepted_tokens, accepted_per_position; acceptance_rate =
                          accepted / draft tokens; mean_acceptance_length = 1 + accepted /
                          drafts; acceptance_per_position[k] = accepted at k / drafts.
                          Null when /metrics has no spec-decode counters. Any other
                          traffic on the server during a run is counted too.

Result JSON (schema_version 1; `validate_result` checks it)
  {
    "schema_version": 1, "kind": "bench_serving",
    "created_utc": "2026-...Z", "run_id": "a1b2c3d4", "note": "free text" | null,
    "recipe": {"profile": "spark-2x", "profile_source": "cli" | "served model name" |
               "none", "profile_config": {...} | null, "pins": {...} | null},
    "machine": {"client": {"hostname", "platform", "machine", "python", "cpu_count",
                           "git_commit", "git_dirty"},
                "server": {"base_url", "model", "version" | null,
                           "max_model_len" | null}},
    "config": {"endpoint", "concurrency": [int], "prompt_lens": [int], "output_len",
               "skipped_prompt_lens", "rounds", "warmup", "seed", "temperature", "ignore_eos",
               "request_timeout_s", "ramp_s", "extra_body"},
    "warmup": {"num_requests", "num_ok"},
    "metrics_available": bool,
    "runs": [{
        "concurrency", "prompt_len", "output_len", "num_requests", "num_ok",
        "num_errors", "errors": {"timeout": 1, ...}, "duration_s",
        "total_output_tokens", "prompt_len_mismatches", "output_tok_s" | null,
        "aggregate_decode_tok_s" | null, "itl_basis",
        "ttft_s" | "itl_s" | "chunk_gap_s" | "decode_tok_s_per_stream" | "e2e_s":
            {"n", "mean", "min", "max", "p50", "p90", "p99"} | null,
        "spec_decode": {...} | null,
        "requests": [{"index", "status", "error", "http_status", "prompt_tokens",
                      "expected_prompt_tokens", "output_tokens", "num_chunks",
                      "ttft_s", "decode_tok_s", "e2e_s", "finish_reason",
                      "token_count_source"}]
    }]
  }
  Request status is one of: ok, http_error, truncated (stream ended or dropped before
  [DONE]), timeout, stream_error (error object in the stream), bad_response
  (unparseable chunk), connection_error, client_error. Statistics use ok requests only.

Python use (what the end-to-end test does):
  from bench_serving import run_sweep, validate_result
  result = run_sweep("http://127.0.0.1:18000", concurrency=(1, 2), prompt_lens=(64,),
                     output_len=16)
  validate_result(result)

Exit codes: 0 done; 1 no request succeeded (or any failed, with --strict);
2 bad arguments, server unreachable or without /tokenize.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import os
import platform
import random
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_metrics import (  # noqa: E402
    RESULT_KIND,
    SCHEMA_VERSION,
    spec_decode_counters,
    spec_decode_delta,
    summarize,
    validate_result,
)

__all__ = ["SweepConfig", "run_sweep", "run_sweep_async", "validate_result", "main"]

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PINS = REPO_ROOT / "recipe" / "pins.yaml"
PROFILES_DIR = REPO_ROOT / "recipe" / "profiles"
DEFAULT_OUT_DIR = REPO_ROOT / "bench-results"

# Filler vocabulary: varied plain words, so the prompt is neither a single repeated
# token (which makes drafters look pathologically good or bad) nor random ids.
_WORDS = (
    "the quick survey of river valleys shows that farmers moved their orchards closer to "
    "water after several dry summers while merchants built new roads between market towns "
    "engineers measured bridges and reported cracks in older stone arches teachers wrote "
    "letters about crowded classrooms and asked for more books a small museum opened a "
    "gallery of maps drawn by sailors who crossed the northern sea in winter storms "
    "scientists compared samples of soil from hills forests and coastal plains to learn how "
    "rain shaped the land musicians played at the harbor festival every evening in autumn "
    "doctors visited distant villages with medicine and careful notes on seasonal illness "
    "children collected shells painted stones and told stories about ancient lighthouses"
).split()


class BenchError(RuntimeError):
    """A problem that stops the benchmark before it measures anything (exit code 2)."""


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
    pins_path: Path | None = DEFAULT_PINS
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
        if self.profile and not (PROFILES_DIR / f"{self.profile}.yaml").is_file():
            known = sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))
            raise BenchError(f"unknown recipe profile {self.profile!r}; known: {known}")


# ---------------------------------------------------------------------------------------
# One streaming request
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class RequestResult:
    index: int
    expected_prompt_tokens: int
    status: str = "client_error"
    error: str | None = None
    http_status: int | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    num_chunks: int = 0
    ttft_s: float | None = None
    decode_tok_s: float | None = None
    e2e_s: float | None = None
    finish_reason: str | None = None
    token_count_source: str | None = None
    # not serialized:
    end_time: float | None = None  # perf_counter at completion
    itl_basis: str | None = None  # chunk_usage | token_ids | chunks
    itl: list[float] = dataclasses.field(default_factory=list)
    chunk_gaps: list[float] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("itl", "chunk_gaps", "end_time", "itl_basis"):
            d.pop(k)
        return d


def _chunk_text(choice: dict[str, Any], endpoint: str) -> str:
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        return (
            delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""
        )
    return choice.get("text") or ""


def _finalize(res: RequestResult, t0: float, times: list[float], counts: list[int | None]) -> None:
    """Turn chunk arrival times and per-chunk token counts into the request's metrics."""
    if not times:
        return
    res.num_chunks = len(times)
    res.ttft_s = times[0] - t0
    known = all(c is not None for c in counts)
    if not known:
        res.itl_basis = "chunks"
    if res.output_tokens is not None:
        res.token_count_source = "usage"
    elif known:
        res.output_tokens = sum(counts)  # type: ignore[arg-type]
        res.token_count_source = "token_ids"
    else:
        res.output_tokens = len(times)
        res.token_count_source = "chunks"
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    res.chunk_gaps = gaps
    if known:
        for gap, n in zip(gaps, counts[1:], strict=False):
            res.itl.extend([gap / n] * n)  # type: ignore[operator]
    else:
        res.itl = list(gaps)
    if len(times) >= 2 and times[-1] > times[0]:
        first = counts[0] if counts[0] is not None else res.output_tokens / len(times)
        res.decode_tok_s = (res.output_tokens - first) / (times[-1] - times[0])


async def _stream_request(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    res: RequestResult,
    endpoint: str,
    timeout: float,
) -> RequestResult:
    """Send one streaming request; fill `res`; never raises (except cancellation)."""
    times: list[float] = []
    counts: list[int | None] = []
    t0 = time.perf_counter()
    done = False
    started = False
    prev_cumulative = 0
    try:
        async with asyncio.timeout(timeout):
            async with session.post(url, json=body) as resp:
                res.http_status = resp.status
                if resp.status != 200:
                    text = await resp.text(errors="replace")
                    res.status, res.error = "http_error", f"HTTP {resp.status}: {text[:300]}"
                    return res
                started = True
                buf = b""
                async for data in resp.content.iter_any():
                    now = time.perf_counter()
                    buf += data
                    *lines, buf = buf.split(b"\n")
                    for raw in lines:
                        line = raw.strip()
                        if not line.startswith(b"data:"):
                            continue  # blank separators, comments, event: lines
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            done = True
                            continue
                        try:
                            chunk = json.loads(payload)
                        except json.JSONDecodeError:
                            res.status = "bad_response"
                            res.error = f"unparseable stream chunk: {payload[:200]!r}"
                            return res
                        if not isinstance(chunk, dict):
                            res.status, res.error = (
                                "bad_response",
                                f"chunk is not an object: {chunk!r:.200}",
                            )
                            return res
                        if "error" in chunk:
                            res.status = "stream_error"
                            res.error = f"error in stream: {json.dumps(chunk['error'])[:300]}"
                            return res
                        usage = chunk.get("usage")
                        cumulative = None
                        if isinstance(usage, dict):
                            res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
                            cumulative = usage.get("completion_tokens")
                            if cumulative is not None:
                                res.output_tokens = cumulative
                        for choice in (chunk.get("choices") or [])[:1]:  # n=1 requests
                            # tokens in this chunk: continuous usage (cumulative count),
                            # else token_ids, else unknown (the text says "some")
                            ids = choice.get("token_ids")
                            if isinstance(cumulative, int):
                                n, basis = cumulative - prev_cumulative, "chunk_usage"
                                prev_cumulative = cumulative
                            elif isinstance(ids, list):
                                n, basis = len(ids), "token_ids"
                            else:
                                n, basis = None, "chunks"
                            if (n > 0) if n is not None else bool(_chunk_text(choice, endpoint)):
                                times.append(now)
                                counts.append(n)
                                if basis != "chunks" and res.itl_basis is None:
                                    res.itl_basis = basis
                            if choice.get("finish_reason"):
                                res.finish_reason = choice["finish_reason"]
        if done:
            res.status = "ok"
        else:
            res.status, res.error = "truncated", "stream ended without data: [DONE]"
    except TimeoutError:
        res.status, res.error = "timeout", f"no complete response within {timeout:g} s"
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
        if started:
            res.status, res.error = "truncated", f"stream dropped: {exc!r:.300}"
        else:
            res.status, res.error = "connection_error", repr(exc)[:300]
    except aiohttp.ClientError as exc:
        res.status, res.error = "connection_error", repr(exc)[:300]
    except Exception as exc:  # a benchmark must outlive one bad response
        res.status, res.error = "client_error", repr(exc)[:300]
    finally:
        res.end_time = time.perf_counter()
        res.e2e_s = res.end_time - t0
        _finalize(res, t0, times, counts)
    return res


# ---------------------------------------------------------------------------------------
# Server access: probe, tokenizer, metrics
# ---------------------------------------------------------------------------------------


class Server:
    def __init__(self, session: aiohttp.ClientSession, cfg: SweepConfig):
        self.session = session
        self.cfg = cfg
        self.base = normalize_base_url(cfg.base_url)
        self.model: str = cfg.model or ""
        self.max_model_len: int | None = None
        self.version: str | None = None

    async def _get(self, path: str, timeout: float = 30.0) -> aiohttp.ClientResponse:
        return await self.session.get(
            self.base + path, timeout=aiohttp.ClientTimeout(total=timeout)
        )

    async def probe(self) -> None:
        url = self.base + "/v1/models"
        try:
            async with await self._get("/v1/models", timeout=15.0) as resp:
                if resp.status != 200:
                    text = await resp.text(errors="replace")
                    raise BenchError(
                        f"server at {self.base} answered GET /v1/models with HTTP {resp.status}: "
                        f"{text[:200]} (wrong --api-key?)"
                    )
                models = (await resp.json(content_type=None)).get("data") or []
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            reason = str(exc) or type(exc).__name__
            raise BenchError(
                f"cannot reach the server at {self.base} (GET {url}: {reason}). "
                "Is it running? Locally: `make serve`; on Spark: `docker compose up` on both "
                "nodes, then pass --base-url http://HEAD:8000"
            ) from exc
        except (ValueError, AttributeError) as exc:
            raise BenchError(f"{url} did not return an OpenAI model list: {exc!r:.200}") from exc
        ids = [m.get("id") for m in models if isinstance(m, dict)]
        if not ids:
            raise BenchError(f"{url} lists no models")
        if not self.model:
            self.model = ids[0]
        elif self.model not in ids:
            raise BenchError(f"model {self.model!r} is not served; the server has {ids}")
        card = next(m for m in models if isinstance(m, dict) and m.get("id") == self.model)
        if isinstance(card.get("max_model_len"), int):
            self.max_model_len = card["max_model_len"]
        try:
            async with await self._get("/version", timeout=10.0) as resp:
                if resp.status == 200:
                    self.version = (await resp.json(content_type=None)).get("version")
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
            self.version = None

    async def _post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            async with self.session.post(
                self.base + path, json=body, timeout=aiohttp.ClientTimeout(total=300)
            ) as resp:
                if resp.status == 404:
                    raise BenchError(
                        f"the server has no {path} endpoint; exact prompt lengths need vLLM's "
                        "tokenizer endpoints (/tokenize, /detokenize)"
                    )
                if resp.status != 200:
                    text = await resp.text(errors="replace")
                    raise BenchError(f"POST {path} failed with HTTP {resp.status}: {text[:300]}")
                return await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise BenchError(f"POST {path} failed: {exc!r:.300}") from exc

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        body = {"model": self.model, "prompt": text, "add_special_tokens": add_special_tokens}
        out = await self._post_json("/tokenize", body)
        if isinstance(out.get("max_model_len"), int) and self.max_model_len is None:
            self.max_model_len = out["max_model_len"]
        return list(out["tokens"])

    async def count_chat(self, messages: list[dict[str, str]]) -> int:
        body = {"model": self.model, "messages": messages, "add_generation_prompt": True}
        return int((await self._post_json("/tokenize", body))["count"])

    async def detokenize(self, tokens: list[int]) -> str:
        out = await self._post_json("/detokenize", {"model": self.model, "tokens": tokens})
        return str(out["prompt"])

    async def spec_counters(self) -> dict[str, Any] | None:
        """Spec-decode counters now, or None if /metrics is missing or has none."""
        try:
            async with await self._get("/metrics", timeout=30.0) as resp:
                if resp.status != 200:
                    return None
                text = await resp.text(errors="replace")
        except (aiohttp.ClientError, TimeoutError):
            return None
        try:
            return spec_decode_counters(text)
        except ValueError as exc:
            print(f"[bench] warning: could not parse /metrics: {exc}", file=sys.stderr)
            return None


def normalize_base_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if url.endswith("/v1"):
        url = url[:-3]
    return url


# ---------------------------------------------------------------------------------------
# Prompts: exact token lengths, unique prefixes
# ---------------------------------------------------------------------------------------


class PromptBuilder:
    """Builds prompts of exact token length with a unique nonce at the very start."""

    def __init__(self, server: Server, cfg: SweepConfig, run_id: str):
        self.server = server
        self.cfg = cfg
        self.run_id = run_id
        self.filler_ids: list[int] = []
        self._chat_guess: dict[int, int] = {}
        self._warned: set[int] = set()

    def _filler_text(self, n_words: int) -> str:
        rng = random.Random(self.cfg.seed)
        out, count = [], 0
        while count < n_words:
            k = rng.randint(8, 18)
            words = [rng.choice(_WORDS) for _ in range(k)]
            out.append(" ".join(words).capitalize() + ".")
            count += k
        return "\n" + " ".join(out)

    async def prepare(self, max_len: int) -> None:
        """Tokenize enough filler for the longest prompt (ids without special tokens)."""
        n_words = max_len + 64
        for _ in range(8):
            self.filler_ids = await self.server.tokenize(self._filler_text(n_words), False)
            if len(self.filler_ids) >= max_len:
                return
            n_words *= 2
        raise BenchError(f"could not build {max_len} filler tokens via /tokenize")

    def nonce(self, tag: str) -> str:
        return f"Session {self.run_id}-{tag}. Read the notes below and continue them."

    async def completion_prompt(self, tag: str, length: int) -> list[int]:
        head = await self.server.tokenize(self.nonce(tag), True)
        need = length - len(head)
        if need < 0:
            raise BenchError(
                f"prompt length {length} is shorter than the unique prefix ({len(head)} tokens)"
            )
        return head + self.filler_ids[:need]

    async def chat_prompt(self, tag: str, length: int) -> tuple[list[dict[str, str]], int]:
        """Messages whose chat-templated length is `length` (or the closest reachable)."""
        nonce = self.nonce(tag)

        async def count(k: int) -> tuple[int, list[dict[str, str]]]:
            text = nonce + " " + await self.server.detokenize(self.filler_ids[:k]) if k else nonce
            msgs = [{"role": "user", "content": text}]
            return await self.server.count_chat(msgs), msgs

        k = self._chat_guess.get(length)
        if k is None:
            base, _ = await count(0)
            k = length - base
            if k < 0:
                raise BenchError(
                    f"prompt length {length} is shorter than the chat template plus the "
                    f"unique prefix ({base} tokens)"
                )
        best: tuple[int, int, list[dict[str, str]]] | None = None
        for _ in range(6):
            k = max(0, min(k, len(self.filler_ids)))
            n, msgs = await count(k)
            if best is None or abs(n - length) < abs(best[0] - length):
                best = (n, k, msgs)
            if n == length:
                break
            k += length - n
        assert best is not None
        if best[0] != length and length not in self._warned:
            self._warned.add(length)
            print(
                f"[bench] warning: chat prompt for length {length} reached {best[0]} tokens "
                "(the template/tokenizer merges at the boundary); the actual length is "
                "recorded per request as expected_prompt_tokens",
                file=sys.stderr,
            )
        self._chat_guess[length] = best[1]
        return best[2], best[0]


# ---------------------------------------------------------------------------------------
# Progress display
# ---------------------------------------------------------------------------------------


class Progress:
    def __init__(self, enabled: bool, total_runs: int):
        self.enabled = enabled
        self.total_runs = total_runs
        self.label = ""
        self.total = self.done = self.failed = 0
        self.t0 = time.perf_counter()

    def start(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.failed = label, total, 0, 0
        self.t0 = time.perf_counter()
        self._draw()

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        self._draw()

    def finish(self, summary: str) -> None:
        if self.enabled:
            sys.stderr.write(f"\r\033[K{self.label} {summary}\n")
            sys.stderr.flush()

    def _draw(self) -> None:
        if not self.enabled:
            return
        width = 24
        filled = int(width * self.done / self.total) if self.total else width
        bar = "#" * filled + "." * (width - filled)
        sys.stderr.write(
            f"\r\033[K{self.label} [{bar}] {self.done}/{self.total}"
            f" err={self.failed} {time.perf_counter() - self.t0:.1f}s"
        )
        sys.stderr.flush()


# ---------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------


def _request_body(cfg: SweepConfig, model: str, prompt: Any, max_tokens: int, seed: int) -> dict:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": cfg.temperature,
        "seed": seed,
        "ignore_eos": cfg.ignore_eos,
    }
    if cfg.chunk_usage:
        body["stream_options"]["continuous_usage_stats"] = True
    if cfg.endpoint == "chat":
        body["messages"] = prompt
    else:
        body["prompt"] = prompt
    body.update(cfg.extra_body or {})
    return body


async def _run_level(
    session: aiohttp.ClientSession,
    server: Server,
    builder: PromptBuilder,
    cfg: SweepConfig,
    tag: str,
    concurrency: int,
    prompt_len: int,
    n_requests: int,
    max_tokens: int,
    progress: Progress | None,
) -> tuple[list[RequestResult], float]:
    """Build the prompts, then run them closed-loop at `concurrency`; returns (results, wall)."""
    url = server.base + ("/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions")
    prompts: list[tuple[Any, int]] = []
    for i in range(n_requests):
        if cfg.endpoint == "chat":
            prompts.append(await builder.chat_prompt(f"{tag}-{i}", prompt_len))
        else:
            prompts.append((await builder.completion_prompt(f"{tag}-{i}", prompt_len), prompt_len))
    sem = asyncio.Semaphore(concurrency)
    t_start = time.perf_counter()

    async def one(i: int) -> RequestResult:
        if cfg.ramp_s and i < concurrency:
            await asyncio.sleep(i * cfg.ramp_s)
        prompt, expected = prompts[i]
        body = _request_body(cfg, server.model, prompt, max_tokens, cfg.seed + i)
        async with sem:
            res = await _stream_request(
                session, url, body, RequestResult(i, expected), cfg.endpoint, cfg.request_timeout
            )
        if progress:
            progress.update(res.status == "ok")
        return res

    results = await asyncio.gather(*(one(i) for i in range(n_requests)))
    ends = [r.end_time for r in results if r.end_time is not None]
    wall = (max(ends) if ends else time.perf_counter()) - t_start
    return list(results), wall


def _run_summary(
    cfg: SweepConfig,
    concurrency: int,
    prompt_len: int,
    results: list[RequestResult],
    wall: float,
    spec: dict[str, Any] | None,
) -> dict[str, Any]:
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
        "spec_decode": spec,
        "requests": [r.to_json() for r in results],
    }


async def run_sweep_async(cfg: SweepConfig) -> dict[str, Any]:
    """Run the whole sweep and return the result dict (see the module docstring)."""
    cfg.check()
    run_id = cfg.run_id or uuid.uuid4().hex[:8]
    max_c = max(cfg.concurrency)
    connector = aiohttp.TCPConnector(limit=max(max_c, cfg.warmup) + 4, force_close=False)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    async with aiohttp.ClientSession(
        connector=connector, headers=headers, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        server = Server(session, cfg)
        await server.probe()
        if server.max_model_len is None:
            await server.tokenize("x", True)  # /tokenize also reports max_model_len
        dropped: list[int] = []
        if server.max_model_len is not None:
            limit = server.max_model_len
            too_long = [p for p in cfg.prompt_lens if p + cfg.output_len > limit]
            if too_long and cfg.fit_prompt_lens and len(too_long) < len(cfg.prompt_lens):
                dropped = too_long
                cfg.prompt_lens = tuple(p for p in cfg.prompt_lens if p not in too_long)
                print(
                    f"[bench] note: skipping default prompt lengths {too_long}: with output_len "
                    f"{cfg.output_len} they exceed the server's max_model_len {limit}",
                    file=sys.stderr,
                )
            elif too_long:
                raise BenchError(
                    f"prompt lengths {too_long} + output_len {cfg.output_len} exceed the "
                    f"server's max_model_len {limit}; lower --prompt-lens or --output-len"
                )
        builder = PromptBuilder(server, cfg, run_id)
        await builder.prepare(max(cfg.prompt_lens))
        levels = [(p, c) for p in cfg.prompt_lens for c in cfg.concurrency]
        progress = Progress(cfg.progress, len(levels))

        warm_ok = 0
        if cfg.warmup:
            progress.start("warm-up", cfg.warmup)
            warm, _ = await _run_level(
                session,
                server,
                builder,
                cfg,
                "w",
                cfg.warmup,
                min(cfg.prompt_lens),
                cfg.warmup,
                min(cfg.output_len, 16),
                progress,
            )
            warm_ok = sum(r.status == "ok" for r in warm)
            progress.finish(f"{warm_ok}/{cfg.warmup} ok")

        runs = []
        metrics_available = False
        for n, (prompt_len, conc) in enumerate(levels):
            label = f"[{n + 1}/{len(levels)}] len={prompt_len} c={conc}"
            n_req = cfg.rounds * conc
            progress.start(label, n_req)
            before = await server.spec_counters()
            results, wall = await _run_level(
                session,
                server,
                builder,
                cfg,
                f"r{n}",
                conc,
                prompt_len,
                n_req,
                cfg.output_len,
                progress,
            )
            after = await server.spec_counters()
            try:
                spec = spec_decode_delta(before, after) if before is not None else None
            except ValueError as exc:
                print(f"\n[bench] warning: {exc}", file=sys.stderr)
                spec = None
            metrics_available = metrics_available or spec is not None
            run = _run_summary(cfg, conc, prompt_len, results, wall, spec)
            runs.append(run)
            agg = run["aggregate_decode_tok_s"]
            progress.finish(
                f"ok={run['num_ok']}/{n_req} agg decode "
                + (f"{agg:.1f} tok/s" if agg is not None else "n/a")
            )

    profile_name, profile_source, profile_cfg = _resolve_profile(cfg.profile, server.model)
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
            "pins": _load_yaml(cfg.pins_path) if cfg.pins_path else None,
        },
        "machine": {
            "client": client_info(),
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
        "metrics_available": metrics_available,
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
    if "pins_path" in kwargs and kwargs["pins_path"] is not None:
        kwargs["pins_path"] = Path(kwargs["pins_path"])
    return asyncio.run(run_sweep_async(SweepConfig(base_url=base_url, **kwargs)))


# ---------------------------------------------------------------------------------------
# Recipe, pins, machine info
# ---------------------------------------------------------------------------------------


def _load_yaml(path: Path) -> dict[str, Any] | None:
    try:
        import yaml
    except ImportError:
        print("[bench] warning: pyyaml missing; pins not recorded", file=sys.stderr)
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        print(f"[bench] warning: cannot read {path}: {exc}", file=sys.stderr)
        return None
    return data if isinstance(data, dict) else None


def _resolve_profile(name: str | None, served_model: str) -> tuple[str, str, dict | None]:
    """(profile name, how it was chosen, profile YAML content)."""
    if name:
        path = PROFILES_DIR / f"{name}.yaml"
        if not path.is_file():
            known = sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))
            raise BenchError(f"unknown recipe profile {name!r}; known: {known}")
        return name, "cli", _load_yaml(path)
    matches = []
    for path in sorted(PROFILES_DIR.glob("*.yaml")):
        data = _load_yaml(path) or {}
        if (data.get("model") or {}).get("served_name") == served_model:
            matches.append((path.stem, data))
    if len(matches) == 1:
        return matches[0][0], "served model name", matches[0][1]
    return "unspecified", "none", None


def client_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "aiohttp": aiohttp.__version__,
        "git_commit": None,
        "git_dirty": None,
    }
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        info["git_commit"], info["git_dirty"] = commit, bool(dirty)
    except (OSError, subprocess.SubprocessError):
        pass
    return info


# ---------------------------------------------------------------------------------------
# Reports: Markdown and plots
# ---------------------------------------------------------------------------------------


def _f(x: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "–" if x is None else f"{x * scale:.{digits}f}"


def _p(stats: dict | None, key: str, scale: float = 1.0, digits: int = 1) -> str:
    return "–" if not stats else _f(stats[key], scale, digits)


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
        "| accept len | accept rate |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["runs"]:
        spec = r.get("spec_decode") or {}
        ttft, itl = r["ttft_s"], r["itl_s"]
        lines.append(
            f"| {r['prompt_len']} | {r['concurrency']} | {r['num_ok']}/{r['num_requests']} "
            f"| {_p(ttft, 'p50', 1e3, 0)} / {_p(ttft, 'p90', 1e3, 0)} / {_p(ttft, 'p99', 1e3, 0)} "
            f"| {_p(itl, 'p50', 1e3, 1)} / {_p(itl, 'p99', 1e3, 1)} "
            f"| {_p(r['decode_tok_s_per_stream'], 'p50')} "
            f"| {_f(r['aggregate_decode_tok_s'])} | {_f(r['output_tok_s'])} "
            f"| {_f(spec.get('mean_acceptance_length'), digits=2)} "
            f"| {_f(spec.get('acceptance_rate'), digits=3)} |"
        )
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


def write_plots(result: dict[str, Any], stem: Path) -> list[Path]:
    """Aggregate tok/s vs concurrency and TTFT vs prompt length, as PNGs next to `stem`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    title = f"{result['recipe']['profile']} · {result['machine']['server']['model']}"
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for plen in sorted({r["prompt_len"] for r in runs}):
        pts = sorted(
            (r["concurrency"], r["aggregate_decode_tok_s"], r["output_tok_s"])
            for r in runs
            if r["prompt_len"] == plen and r["aggregate_decode_tok_s"] is not None
        )
        if not pts:
            continue
        (line,) = ax.plot(
            [p[0] for p in pts], [p[1] for p in pts], "o-", label=f"decode, {plen} tok"
        )
        ax.plot(
            [p[0] for p in pts],
            [p[2] for p in pts],
            "x--",
            color=line.get_color(),
            alpha=0.6,
            label=f"output, {plen} tok",
        )
    ax.set_xticks(sorted({r["concurrency"] for r in runs}))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate tok/s (output = end-to-end incl. prefill)")
    ax.set_title(f"Aggregate throughput — {title}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(stem.with_name(stem.name + "-tok_s.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for conc in sorted({r["concurrency"] for r in runs}):
        pts = sorted(
            (r["prompt_len"], r["ttft_s"]["p50"], r["ttft_s"]["p90"])
            for r in runs
            if r["concurrency"] == conc and r["ttft_s"]
        )
        if not pts:
            continue
        (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"p50, c={conc}")
        ax.plot(
            [p[0] for p in pts],
            [p[2] for p in pts],
            ":",
            color=line.get_color(),
            label=f"p90, c={conc}",
        )
    plens = sorted({r["prompt_len"] for r in runs})
    if len(plens) > 1 and plens[-1] / plens[0] >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(plens, [str(p) for p in plens])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title(f"Time to first token — {title}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(stem.with_name(stem.name + "-ttft.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}") from None
    return values


def _json_obj(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="bench_serving.py",
        description="Streaming serving benchmark for a vLLM OpenAI-compatible server: "
        "concurrency x prompt-length sweep with TTFT, ITL, decode tok/s and "
        "speculative-decoding acceptance. Writes JSON + Markdown (+ PNG with --plot) "
        "under --out-dir.",
        epilog="Examples:\n"
        "  # local CPU tiny server (make serve); the URL comes from the profile's port\n"
        "  bench_serving.py --profile cpu-tiny --concurrency 1,2,4 --prompt-lens 64,256 "
        "--output-len 32 --plot\n"
        "  # two Sparks, from any machine that reaches the head\n"
        "  bench_serving.py --base-url http://SPARK_HEAD:8000 --profile spark-2x --plot\n"
        "  # then: compare_bench.py bench-results/A.json bench-results/B.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = SweepConfig(base_url="")
    ap.add_argument(
        "--base-url",
        default=None,
        help="server root, with or without /v1 (default: http://127.0.0.1:PORT with the "
        "--profile's serving port, else http://127.0.0.1:8000)",
    )
    ap.add_argument(
        "--model",
        default=None,
        help="served model name (default: the first one GET /v1/models lists)",
    )
    ap.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default=d.endpoint,
        help="completions sends exact token-id prompts; chat sends messages "
        "padded through the chat template (default: %(default)s)",
    )
    ap.add_argument(
        "--concurrency",
        type=_int_list,
        default=d.concurrency,
        metavar="N,N,..",
        help="concurrent streams per level (default: 1,2,4,6,16)",
    )
    ap.add_argument(
        "--prompt-lens",
        type=_int_list,
        default=None,
        metavar="N,N,..",
        help="prompt lengths in tokens, exact via /tokenize (default: 256,2048, leaving out "
        "those that do not fit the server's max_model_len; given lengths that do not fit "
        "are an error)",
    )
    ap.add_argument(
        "--output-len",
        type=int,
        default=d.output_len,
        help="completion tokens per request; EOS is ignored so every request "
        "generates exactly this many (default: %(default)s)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=d.rounds,
        help="requests per level = rounds x concurrency, kept `concurrency` in "
        "flight (default: %(default)s)",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=d.warmup,
        help="warm-up requests before the sweep, excluded from results (default: %(default)s)",
    )
    ap.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="seed for filler text and per-request sampling seeds (default: %(default)s)",
    )
    ap.add_argument(
        "--run-id",
        default=None,
        help="fixed id in the unique prompt prefixes (default: random, so repeated "
        "runs stay cold for the prefix cache)",
    )
    ap.add_argument(
        "--temperature",
        type=float,
        default=d.temperature,
        help="sampling temperature (default: %(default)s = greedy)",
    )
    ap.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let requests stop at EOS (output lengths then vary)",
    )
    ap.add_argument(
        "--no-chunk-usage",
        dest="chunk_usage",
        action="store_false",
        help="do not ask for per-chunk usage (stream_options.continuous_usage_stats); "
        "per-chunk token counts then come from token_ids if the server sends them "
        "(--extra-body '{\"return_token_ids\": true}'), else ITL is per chunk",
    )
    ap.add_argument(
        "--request-timeout",
        type=float,
        default=d.request_timeout,
        help="seconds before one request counts as timed out (default: %(default)s)",
    )
    ap.add_argument(
        "--ramp-s",
        type=float,
        default=d.ramp_s,
        help="stagger the first `concurrency` requests of a level by this many "
        "seconds each (default: 0 = all at once)",
    )
    ap.add_argument(
        "--extra-body",
        type=_json_obj,
        default=None,
        metavar="JSON",
        help="JSON merged into every request body, e.g. "
        '\'{"chat_template_kwargs": {"thinking": false}}\'',
    )
    ap.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY") or None,
        help="bearer token (default: $VLLM_API_KEY)",
    )
    ap.add_argument(
        "--profile",
        default=None,
        help="recipe profile name recorded in the result (recipe/profiles/NAME.yaml; "
        "default: the profile whose served_name matches the server's model)",
    )
    ap.add_argument(
        "--pins",
        type=Path,
        default=DEFAULT_PINS,
        help="pins file recorded in the result (default: recipe/pins.yaml)",
    )
    ap.add_argument(
        "--note",
        default=None,
        help="free text stored in the result and shown in the report, e.g. 'DSpark k=5, ragged on'",
    )
    ap.add_argument(
        "--out-dir",
        type=Path,
        default=DEFAULT_OUT_DIR,
        help="directory for the outputs (default: bench-results/)",
    )
    ap.add_argument(
        "--name", default=None, help="output file stem (default: serving-PROFILE-YYYYmmdd-HHMMSS)"
    )
    ap.add_argument(
        "--plot",
        action="store_true",
        help="also write STEM-tok_s.png (aggregate tok/s vs concurrency) and "
        "STEM-ttft.png (TTFT vs prompt length)",
    )
    ap.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: on when stderr is a terminal)",
    )
    ap.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 if any request failed (default: only if none succeeded)",
    )
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    base_url = args.base_url or "http://127.0.0.1:8000"
    if args.base_url is None and args.profile:
        port = ((_load_yaml(PROFILES_DIR / f"{args.profile}.yaml") or {}).get("serving") or {}).get(
            "port"
        )
        if isinstance(port, int):
            base_url = f"http://127.0.0.1:{port}"
    cfg = SweepConfig(
        base_url=base_url,
        model=args.model,
        endpoint=args.endpoint,
        concurrency=args.concurrency,
        prompt_lens=args.prompt_lens or SweepConfig.prompt_lens,
        fit_prompt_lens=args.prompt_lens is None,
        output_len=args.output_len,
        rounds=args.rounds,
        warmup=args.warmup,
        seed=args.seed,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        request_timeout=args.request_timeout,
        ramp_s=args.ramp_s,
        api_key=args.api_key,
        extra_body=args.extra_body,
        chunk_usage=args.chunk_usage,
        profile=args.profile,
        pins_path=args.pins,
        run_id=args.run_id,
        note=args.note,
        progress=sys.stderr.isatty() if args.progress is None else args.progress,
    )
    try:
        result = asyncio.run(run_sweep_async(cfg))
    except BenchError as exc:
        print(f"bench_serving: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("bench_serving: interrupted", file=sys.stderr)
        return 130
    validate_result(result)

    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    stem = args.out_dir / (args.name or f"serving-{result['recipe']['profile']}-{stamp}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = stem.with_suffix(".json"), stem.with_suffix(".md")
    json_path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    report = markdown_report(result)
    md_path.write_text(report, encoding="utf-8")
    written = [json_path, md_path]
    if args.plot:
        written += write_plots(result, stem)
    print(report)
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)

    n_req = sum(r["num_requests"] for r in result["runs"])
    n_ok = sum(r["num_ok"] for r in result["runs"])
    if n_ok == 0:
        print(f"bench_serving: error: all {n_req} requests failed", file=sys.stderr)
        return 1
    if args.strict and n_ok < n_req:
        print(f"bench_serving: error: {n_req - n_ok} of {n_req} requests failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
