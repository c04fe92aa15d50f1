"""One streaming OpenAI request: read the SSE stream and turn chunk arrivals into metrics.

Token counts come from `usage` (vLLM's continuous usage stats give a cumulative count on every
chunk) or `token_ids`, never from counting chunks: with speculative decoding one chunk
carries several tokens. Only when the server gives neither is ITL one sample per chunk.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp


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


class StreamFault(Exception):
    """The request failed with `status` (see schema.REQUEST_STATUSES) for `error`."""

    def __init__(self, status: str, error: str):
        super().__init__(error)
        self.status, self.error = status, error


def _chunk_text(choice: dict[str, Any], endpoint: str) -> str:
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        return (
            delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""
        )
    return choice.get("text") or ""


class ChunkTally:
    """Arrival time and token count of every token-bearing chunk of one request."""

    def __init__(self, res: RequestResult, endpoint: str):
        self.res, self.endpoint = res, endpoint
        self.times: list[float] = []
        self.counts: list[int | None] = []
        self.prev_cumulative = 0

    def add(self, now: float, chunk: dict[str, Any]) -> None:
        res = self.res
        usage = chunk.get("usage")
        cumulative = None
        if isinstance(usage, dict):
            res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
            cumulative = usage.get("completion_tokens")
            if cumulative is not None:
                res.output_tokens = cumulative
        for choice in (chunk.get("choices") or [])[:1]:  # n=1 requests
            n, basis = self._tokens_in(choice, cumulative)
            has_tokens = n > 0 if n is not None else bool(_chunk_text(choice, self.endpoint))
            if has_tokens:
                self.times.append(now)
                self.counts.append(n)
                if basis != "chunks" and res.itl_basis is None:
                    res.itl_basis = basis
            if choice.get("finish_reason"):
                res.finish_reason = choice["finish_reason"]

    def _tokens_in(self, choice: dict[str, Any], cumulative: Any) -> tuple[int | None, str]:
        """Tokens in this chunk: continuous usage, else token_ids, else unknown."""
        if isinstance(cumulative, int):
            n, self.prev_cumulative = cumulative - self.prev_cumulative, cumulative
            return n, "chunk_usage"
        if isinstance(choice.get("token_ids"), list):
            return len(choice["token_ids"]), "token_ids"
        return None, "chunks"

    def finalize(self, t0: float) -> None:
        """Turn chunk arrival times and per-chunk token counts into the request's metrics."""
        res, times, counts = self.res, self.times, self.counts
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


async def sse_payloads(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[float, bytes]]:
    """(arrival time, payload) of every `data:` line; separators, comments, events skipped."""
    buf = b""
    async for data in resp.content.iter_any():
        now = time.perf_counter()
        buf += data
        *lines, buf = buf.split(b"\n")
        for raw in lines:
            line = raw.strip()
            if line.startswith(b"data:"):
                yield now, line[5:].strip()


def decode_chunk(payload: bytes) -> dict[str, Any]:
    try:
        chunk = json.loads(payload)
    except json.JSONDecodeError:
        raise StreamFault("bad_response", f"unparseable stream chunk: {payload[:200]!r}")
    if not isinstance(chunk, dict):
        raise StreamFault("bad_response", f"chunk is not an object: {chunk!r:.200}")
    if "error" in chunk:
        raise StreamFault("stream_error", f"error in stream: {json.dumps(chunk['error'])[:300]}")
    return chunk


async def _consume(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], tally: ChunkTally
) -> None:
    """Read the whole stream into `tally`; a failure raises StreamFault."""
    async with session.post(url, json=body) as resp:
        tally.res.http_status = resp.status
        if resp.status != 200:
            text = await resp.text(errors="replace")
            raise StreamFault("http_error", f"HTTP {resp.status}: {text[:300]}")
        done = False
        async for now, payload in sse_payloads(resp):
            if payload == b"[DONE]":
                done = True
            else:
                tally.add(now, decode_chunk(payload))
    if not done:
        raise StreamFault("truncated", "stream ended without data: [DONE]")


async def stream_request(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    res: RequestResult,
    endpoint: str,
    timeout: float,
) -> RequestResult:
    """Send one streaming request; fill `res`; never raises (except cancellation)."""
    tally = ChunkTally(res, endpoint)
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            await _consume(session, url, body, tally)
        res.status = "ok"
    except StreamFault as fault:
        res.status, res.error = fault.status, fault.error
    except TimeoutError:
        res.status, res.error = "timeout", f"no complete response within {timeout:g} s"
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
        started = res.http_status == 200
        res.status = "truncated" if started else "connection_error"
        res.error = f"stream dropped: {exc!r:.300}" if started else repr(exc)[:300]
    except aiohttp.ClientError as exc:
        res.status, res.error = "connection_error", repr(exc)[:300]
    except Exception as exc:  # a benchmark must outlive one bad response
        res.status, res.error = "client_error", repr(exc)[:300]
    finally:
        res.end_time = time.perf_counter()
        res.e2e_s = res.end_time - t0
        tally.finalize(t0)
    return res
