"""Serving benchmark client against a fake streaming OpenAI server with a known schedule.

The fake server emits the first token TTFT_S after a request arrives, then a chunk of
TOKENS_PER_CHUNK tokens every CHUNK_GAP_S, each at an absolute deadline (so late wake-ups
do not accumulate). Every emission is late by at most LATE_S on a loaded machine; the
tolerances below are derived from that bound, not from the speed of the client.
"""

from __future__ import annotations

import asyncio
import copy
import json
import socket
import threading
from pathlib import Path

import pytest
from aiohttp import web

from scripts.bench import __main__ as bench_cli
from scripts.bench import compare, prometheus, schema, stats
from scripts.bench.sweep import run_sweep

pytestmark = pytest.mark.timeout(60)

TTFT_S = 0.150
CHUNK_GAP_S = 0.040
TOKENS_PER_CHUNK = 2
SPEC_K = 4  # draft tokens per verify step the fake server reports on /metrics
OUTPUT_LEN = 17  # 1 first token + 8 chunks of 2
LATE_S = 0.060  # upper bound on how late any one emission (or its receipt) may be
MAX_MODEL_LEN = 4096
BOS = 1


# ---------------------------------------------------------------------------------------
# Fake server
# ---------------------------------------------------------------------------------------


class FakeServer:
    """vLLM-like OpenAI server: word-level tokenizer, streaming completions, /metrics."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.words: dict[int, str] = {}
        self.faults: dict[int, str] = {}  # arrival index -> fault kind
        self.arrivals = 0
        self.received: list[dict] = []  # generation request bodies, arrival order
        self.prompt_lens: list[int] = []
        self.prompt_heads: list[tuple[int, ...]] = []
        self.drafts = self.draft_tokens = self.accepted = 0
        self.accepted_pos = [0] * SPEC_K
        self.ttft_s, self.gap_s, self.per_chunk = TTFT_S, CHUNK_GAP_S, TOKENS_PER_CHUNK
        self.max_model_len = MAX_MODEL_LEN
        self.honor_chunk_usage = True  # vLLM: stream_options.continuous_usage_stats

    # tokenizer: one token per whitespace-separated word; BOS=1; chat adds 2 markers
    def encode(self, text: str) -> list[int]:
        ids = []
        for w in text.split():
            if w not in self.vocab:
                self.vocab[w] = 100 + len(self.vocab)
                self.words[self.vocab[w]] = w
            ids.append(self.vocab[w])
        return ids

    def chat_ids(self, messages: list[dict]) -> list[int]:
        ids = [BOS]
        for m in messages:
            ids += [2] + self.encode(m["content"])
        return ids + [3]

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": "fake-model", "object": "model", "max_model_len": self.max_model_len}
        return web.json_response({"object": "list", "data": [card]})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0+fake"})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        if "messages" in body:
            ids = self.chat_ids(body["messages"])
        else:
            ids = ([BOS] if body.get("add_special_tokens", True) else []) + self.encode(
                body["prompt"]
            )
        out = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        return web.json_response(out)

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"prompt": " ".join(self.words[t] for t in body["tokens"])})

    async def metrics(self, request: web.Request) -> web.Response:
        lines = [
            "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
            "# TYPE vllm:spec_decode_num_drafts_total counter",
            f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="fake-model"}} {float(self.drafts)}',
            f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="fake-model"}} {float(self.draft_tokens)}',
            f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="fake-model"}} {float(self.accepted)}',
        ]
        for pos, n in enumerate(self.accepted_pos):
            lines.append(
                "vllm:spec_decode_num_accepted_tokens_per_pos_total"
                f'{{engine="0",model_name="fake-model",position="{pos}"}} {float(n)}'
            )
        # The DSpark drafter's series, as the overlay exports them: one flat step per draft
        # and one ragged step per arriving request (its prefill beside running decodes).
        labels = 'engine="0",model_name="fake-model"'
        lines += [
            f'vllm:dspark_steps_total{{{labels},path="flat"}} {float(self.drafts)}',
            f'vllm:dspark_steps_total{{{labels},path="ragged"}} {float(self.arrivals)}',
            f'vllm:dspark_steps_total{{{labels},path="packed"}} 0.0',
            f'vllm:dspark_context_rows_total{{{labels},kind="stored"}} {float(self.accepted)}',
            f'vllm:dspark_context_rows_total{{{labels},kind="rejected"}} '
            f"{float(self.draft_tokens - self.accepted)}",
            f"vllm:dspark_drafts_discarded_total{{{labels}}} 0.0",
            f"vllm:dspark_ring_slots_in_use{{{labels}}} 0.0",
            f"vllm:dspark_ring_slots_total{{{labels}}} 8.0",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        t0 = asyncio.get_running_loop().time()
        arrival = self.arrivals
        self.arrivals += 1
        self.received.append(body)
        chat = request.path.endswith("/chat/completions")
        ids = self.chat_ids(body["messages"]) if chat else body["prompt"]
        self.prompt_lens.append(len(ids))
        self.prompt_heads.append(tuple(ids[:8]))
        fault = self.faults.get(arrival)
        if fault == "http500":
            return web.json_response({"error": {"message": "boom", "code": 500}}, status=500)

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n_total = body["max_tokens"]
        sizes = [1]
        while sum(sizes) < n_total:
            sizes.append(min(self.per_chunk, n_total - sum(sizes)))

        async def send(obj) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            await resp.write(f"data: {data}\n\n".encode())

        opts = body.get("stream_options") or {}
        chunk_usage = self.honor_chunk_usage and opts.get("continuous_usage_stats")
        next_id, emitted = 1000, 0
        for j, n in enumerate(sizes):
            deadline = t0 + self.ttft_s + j * self.gap_s
            await asyncio.sleep(max(0.0, deadline - asyncio.get_running_loop().time()))
            toks = list(range(next_id, next_id + n))
            next_id += n
            choice = {"index": 0, "finish_reason": None}
            if chat:
                choice["delta"] = {"content": " w" * n}
            else:
                choice["text"] = " w" * n
            if body.get("return_token_ids"):
                choice["token_ids"] = toks
            chunk = {"id": "x", "object": "chunk", "choices": [choice]}
            emitted += n
            if chunk_usage:
                chunk["usage"] = {"prompt_tokens": len(ids), "completion_tokens": emitted}
            await send(chunk)
            if j == 2 and fault == "truncate":
                return resp  # clean end of body, no [DONE]
            if j == 2 and fault == "drop":
                request.transport.close()  # connection dies mid-stream
                return resp
            if j == 2 and fault == "hang":
                await asyncio.sleep(3600)
            if j == 2 and fault == "garbage":
                await send("{not json")
            if j == 2 and fault == "error_event":
                await send({"error": {"message": "engine died", "code": 500}})
                return resp
        # speculative decoding bookkeeping: every chunk after the first is one verify
        # step that accepted (per_chunk - 1) drafts at positions 0.. plus the bonus token
        steps = len(sizes) - 1
        acc = self.per_chunk - 1
        self.drafts += steps
        self.draft_tokens += steps * SPEC_K
        self.accepted += steps * acc
        for pos in range(acc):
            self.accepted_pos[pos] += steps
        last = {"index": 0, "finish_reason": "length"}
        last.update({"delta": {}} if chat else {"text": ""})
        await send({"id": "x", "object": "chunk", "choices": [last]})
        usage = {"prompt_tokens": len(ids), "completion_tokens": n_total}
        await send({"id": "x", "object": "chunk", "choices": [], "usage": usage})
        await send("[DONE]")
        return resp

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        return app


class ServerThread:
    """Runs a FakeServer on 127.0.0.1 (random free port) in its own event loop thread."""

    def __init__(self, fake: FakeServer):
        self.fake = fake
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner: web.AppRunner | None = None
        self.url = ""

    def __enter__(self) -> ServerThread:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    async def _start(self) -> None:
        self.runner = web.AppRunner(
            self.fake.app(), handler_cancellation=True, shutdown_timeout=0.5
        )
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        assert self.runner is not None
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def fake():
    fake = FakeServer()
    with ServerThread(fake) as srv:
        fake.url = srv.url
        yield fake


def sweep(fake: FakeServer, **kw):
    args = dict(
        concurrency=(1,),
        prompt_lens=(40,),
        output_len=OUTPUT_LEN,
        rounds=1,
        warmup=0,
        run_id="t",
        request_timeout=10.0,
    )
    args.update(kw)
    return schema.validate_result(run_sweep(fake.url, **args))


# ---------------------------------------------------------------------------------------
# Timing against the known schedule
# ---------------------------------------------------------------------------------------


def test_ttft_itl_and_tok_s_match_the_schedule(fake):
    result = sweep(fake, concurrency=(1, 2), rounds=2, warmup=1)
    decode_tokens = OUTPUT_LEN - 1
    steps = decode_tokens // TOKENS_PER_CHUNK
    decode_time = steps * CHUNK_GAP_S
    # first and last emission each late by at most LATE_S
    rate_lo = decode_tokens / (decode_time + LATE_S)
    rate_hi = decode_tokens / (decode_time - LATE_S)
    expected_rate = decode_tokens / decode_time  # 50 tok/s

    assert [(r["prompt_len"], r["concurrency"]) for r in result["runs"]] == [(40, 1), (40, 2)]
    assert result["warmup"] == {"num_requests": 1, "num_ok": 1}
    for run in result["runs"]:
        c = run["concurrency"]
        assert run["num_requests"] == 2 * c and run["num_ok"] == 2 * c and run["errors"] == {}
        assert run["total_output_tokens"] == 2 * c * OUTPUT_LEN
        assert run["prompt_len_mismatches"] == 0
        assert run["itl_basis"] == "chunk_usage"
        for req in run["requests"]:
            assert req["status"] == "ok" and req["output_tokens"] == OUTPUT_LEN
            assert req["num_chunks"] == 1 + steps
            assert TTFT_S - 0.005 <= req["ttft_s"] <= TTFT_S + LATE_S
            assert rate_lo <= req["decode_tok_s"] <= rate_hi
        ttft = run["ttft_s"]
        assert TTFT_S - 0.005 <= ttft["p50"] <= ttft["p99"] <= TTFT_S + LATE_S
        # per-token ITL: every chunk gap split over its two tokens
        itl = run["itl_s"]
        assert itl["n"] == 2 * c * decode_tokens
        assert itl["mean"] == pytest.approx(CHUNK_GAP_S / TOKENS_PER_CHUNK, abs=LATE_S / steps)
        assert run["chunk_gap_s"]["n"] == 2 * c * steps
        assert run["chunk_gap_s"]["mean"] == pytest.approx(CHUNK_GAP_S, abs=LATE_S / steps)
        per_stream = run["decode_tok_s_per_stream"]
        assert rate_lo <= per_stream["p50"] <= rate_hi
        # streams run in parallel on the fake server: aggregate = c x per-stream rate
        assert c * rate_lo <= run["aggregate_decode_tok_s"] <= c * rate_hi
        assert run["aggregate_decode_tok_s"] == pytest.approx(c * expected_rate, rel=0.25)
        # output tok/s: 2 sequential waves of c requests, each TTFT + decode long
        e2e = TTFT_S + decode_time
        assert run["duration_s"] >= 2 * e2e
        assert run["output_tok_s"] <= 2 * c * OUTPUT_LEN / (2 * e2e)
        assert run["output_tok_s"] >= 2 * c * OUTPUT_LEN / (2 * (e2e + 2 * LATE_S) + 0.5)


def test_spec_decode_deltas_come_from_metrics(fake):
    result = sweep(fake, concurrency=(1, 3), rounds=1, warmup=2)
    steps = (OUTPUT_LEN - 1) // TOKENS_PER_CHUNK
    assert result["metrics_available"] is True
    for run in result["runs"]:
        n = run["num_requests"]
        spec = run["spec_decode"]
        # warm-up and the other level's requests are not in this run's delta
        assert spec["num_drafts"] == n * steps
        assert spec["num_draft_tokens"] == n * steps * SPEC_K
        assert spec["num_accepted_tokens"] == n * steps * (TOKENS_PER_CHUNK - 1)
        assert spec["accepted_per_position"] == [n * steps, 0, 0, 0]
        assert spec["mean_acceptance_length"] == pytest.approx(TOKENS_PER_CHUNK)
        assert spec["acceptance_rate"] == pytest.approx((TOKENS_PER_CHUNK - 1) / SPEC_K)
        assert spec["acceptance_per_position"] == pytest.approx([1.0, 0.0, 0.0, 0.0])
        dspark = run["dspark"]  # the drafter's series, over the same level only
        assert dspark["steps"] == {"flat": n * steps, "ragged": n, "packed": 0}
        assert dspark["ragged_share"] == pytest.approx(n / (n * steps + n))
        assert dspark["context_rows"] == {
            "stored": n * steps * (TOKENS_PER_CHUNK - 1),
            "rejected": n * steps * (SPEC_K - TOKENS_PER_CHUNK + 1),
        }
        assert (dspark["ring_slots_in_use"], dspark["ring_slots_total"]) == (0, 8)


def test_prompts_have_exact_lengths_and_unique_prefixes(fake):
    result = sweep(fake, concurrency=(2,), prompt_lens=(30, 200), rounds=2, warmup=1)
    # warm-up uses the shortest length; every request got exactly its target length
    assert fake.prompt_lens == [30] + [30] * 4 + [200] * 4
    assert len(set(fake.prompt_heads)) == len(fake.prompt_heads)
    assert all(h[0] == BOS for h in fake.prompt_heads)
    for body in fake.received:
        assert body["stream"] is True and body["ignore_eos"] is True
        assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        assert body["max_tokens"] in (OUTPUT_LEN, 16)
    assert [body["seed"] for body in fake.received[1:5]] == [0, 1, 2, 3]
    for run in result["runs"]:
        assert all(r["prompt_tokens"] == run["prompt_len"] for r in run["requests"])


def test_chat_endpoint_pads_through_the_chat_template(fake):
    result = sweep(fake, endpoint="chat", concurrency=(2,), prompt_lens=(25, 64))
    assert fake.prompt_lens == [25, 25, 64, 64]
    assert all("messages" in b and "prompt" not in b for b in fake.received)
    assert len(set(fake.prompt_heads)) == 4
    run = result["runs"][1]
    assert run["num_ok"] == 2 and run["prompt_len_mismatches"] == 0
    assert all(TTFT_S - 0.005 <= r["ttft_s"] <= TTFT_S + LATE_S for r in run["requests"])


@pytest.mark.parametrize(
    ("server_usage", "kwargs", "basis"),
    [
        (True, {"chunk_usage": False, "extra_body": {"return_token_ids": True}}, "token_ids"),
        (True, {"chunk_usage": False}, "chunks"),
        (False, {}, "chunks"),  # server ignores continuous_usage_stats
    ],
)
def test_per_chunk_token_counts_fall_back_in_order(fake, server_usage, kwargs, basis):
    fake.honor_chunk_usage = server_usage
    run = sweep(fake, **kwargs)["runs"][0]
    steps = (OUTPUT_LEN - 1) // TOKENS_PER_CHUNK
    assert run["itl_basis"] == basis
    req = run["requests"][0]
    # the final usage says 17 tokens although only 9 chunks arrived: never count chunks
    assert req["output_tokens"] == OUTPUT_LEN and req["token_count_source"] == "usage"
    if basis == "chunks":  # one ITL sample per chunk; the first chunk's size is estimated
        assert run["itl_s"]["n"] == steps
        assert run["itl_s"]["mean"] == pytest.approx(CHUNK_GAP_S, abs=LATE_S / steps)
        est_first = OUTPUT_LEN / (1 + steps)  # mean tokens per chunk
        decode_time = steps * CHUNK_GAP_S
        lo = (OUTPUT_LEN - est_first) / (decode_time + LATE_S)
        hi = (OUTPUT_LEN - est_first) / (decode_time - LATE_S)
        assert lo <= req["decode_tok_s"] <= hi
    else:
        assert run["itl_s"]["n"] == OUTPUT_LEN - 1
        assert run["itl_s"]["mean"] == pytest.approx(CHUNK_GAP_S / 2, abs=LATE_S / steps)
        decode_time = steps * CHUNK_GAP_S
        lo = (OUTPUT_LEN - 1) / (decode_time + LATE_S)
        assert lo <= req["decode_tok_s"] <= (OUTPUT_LEN - 1) / (decode_time - LATE_S)


# ---------------------------------------------------------------------------------------
# Bad responses are recorded per request
# ---------------------------------------------------------------------------------------


def test_bad_responses_are_recorded_and_do_not_stop_the_sweep(fake):
    fake.ttft_s, fake.gap_s = 0.02, 0.01
    kinds = ["http500", "truncate", "hang", "drop", "garbage", "error_event"]
    fake.faults = {1 + i: k for i, k in enumerate(kinds)}  # arrival 0 and 7 are fine
    result = sweep(fake, concurrency=(1, 2), rounds=8, request_timeout=1.5)
    first, second = result["runs"]
    statuses = [r["status"] for r in first["requests"]]
    assert statuses == [
        "ok",
        "http_error",
        "truncated",
        "timeout",
        "truncated",
        "bad_response",
        "stream_error",
        "ok",
    ]
    assert first["errors"] == {
        "http_error": 1,
        "truncated": 2,
        "timeout": 1,
        "bad_response": 1,
        "stream_error": 1,
    }
    assert first["num_ok"] == 2 and first["num_errors"] == 6
    reqs = first["requests"]
    assert reqs[1]["http_status"] == 500 and "boom" in reqs[1]["error"]
    assert "[DONE]" in reqs[2]["error"]
    assert reqs[3]["e2e_s"] == pytest.approx(1.5, abs=0.5)
    # statistics use the two ok requests only
    assert first["ttft_s"]["n"] == 2 and first["total_output_tokens"] == 2 * OUTPUT_LEN
    # the next level ran normally after all that
    assert second["num_ok"] == second["num_requests"] == 16 and second["errors"] == {}


def test_every_request_failing_still_produces_a_valid_result(fake, tmp_path, capsys):
    fake.faults = {i: "http500" for i in range(100)}
    argv = ["--base-url", fake.url, "--concurrency", "2", "--prompt-lens", "30"]
    argv += ["--output-len", "4", "--rounds", "1", "--warmup", "1", "--out-dir", str(tmp_path)]
    argv += ["--name", "allfail", "--no-progress"]
    assert bench_cli.main(argv) == 1
    assert "all 2 requests failed" in capsys.readouterr().err
    data = json.loads((tmp_path / "allfail.json").read_text())
    schema.validate_result(data)
    run = data["runs"][0]
    assert run["errors"] == {"http_error": 2} and run["ttft_s"] is None
    assert run["output_tok_s"] is None and data["warmup"]["num_ok"] == 0


def test_unreachable_server_exits_nonzero_with_message(capsys, tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = bench_cli.main(
        ["--base-url", f"http://127.0.0.1:{port}", "--out-dir", str(tmp_path)]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "cannot reach the server" in err and str(port) in err
    assert list(tmp_path.iterdir()) == []


def test_prompt_longer_than_max_model_len_is_refused(fake, capsys, tmp_path):
    argv = ["--base-url", fake.url + "/v1", "--prompt-lens", "4090", "--output-len", "16"]
    assert bench_cli.main(argv + ["--out-dir", str(tmp_path)]) == 2
    assert "max_model_len 4096" in capsys.readouterr().err
    assert fake.arrivals == 0


def test_default_prompt_lengths_that_do_not_fit_are_skipped(fake, capsys, tmp_path):
    fake.max_model_len = 600
    argv = ["--base-url", fake.url, "--concurrency", "1", "--output-len", "17", "--rounds", "1"]
    argv += ["--warmup", "0", "--out-dir", str(tmp_path), "--name", "fit", "--no-progress"]
    assert bench_cli.main(argv) == 0
    assert "skipping default prompt lengths [2048]" in capsys.readouterr().err
    data = json.loads((tmp_path / "fit.json").read_text())
    assert data["config"]["prompt_lens"] == [256] and data["config"]["skipped_prompt_lens"] == [
        2048
    ]
    assert [r["prompt_len"] for r in data["runs"]] == [256] and fake.prompt_lens == [256]


# ---------------------------------------------------------------------------------------
# CLI outputs, schema, compare
# ---------------------------------------------------------------------------------------


def test_cli_writes_json_markdown_and_plots(fake, tmp_path, capsys):
    argv = ["--base-url", fake.url, "--concurrency", "1,2", "--prompt-lens", "30,60"]
    argv += ["--output-len", "5", "--rounds", "1", "--warmup", "1", "--out-dir", str(tmp_path)]
    argv += ["--name", "cli", "--plot", "--profile", "cpu-tiny", "--run-id", "abc", "--no-progress"]
    argv += ["--note", "fake run"]
    assert bench_cli.main(argv) == 0
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "cli.json").read_text())
    schema.validate_result(data)
    assert data["recipe"]["profile"] == "cpu-tiny" and data["recipe"]["profile_source"] == "cli"
    assert data["recipe"]["profile_config"]["name"] == "cpu-tiny"
    assert data["recipe"]["pins"]["vllm"]["version"] == "0.32.0"
    assert data["machine"]["server"] == {
        "base_url": fake.url,
        "model": "fake-model",
        "version": "0.32.0+fake",
        "max_model_len": MAX_MODEL_LEN,
    }
    assert data["machine"]["client"]["cpu_count"] >= 1 and data["run_id"] == "abc"
    assert len(data["runs"]) == 4
    md = (tmp_path / "cli.md").read_text()
    assert md.strip() in out and "- note: fake run" in md and data["note"] == "fake run"
    assert "| prompt | conc |" in md and md.count("\n| 30 |") + md.count("\n| 60 |") == 4
    assert "Per-position acceptance" in md
    for png in ("cli-tok_s.png", "cli-ttft.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_help_explains_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_cli.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--concurrency", "--prompt-lens", "--output-len", "--plot", "--request-timeout"):
        assert flag in text


def _tiny_result() -> dict:
    stats = {"n": 2, "mean": 1.0, "min": 0.5, "max": 1.5, "p50": 1.0, "p90": 1.4, "p99": 1.5}
    run = {
        "concurrency": 1,
        "prompt_len": 64,
        "output_len": 8,
        "num_requests": 1,
        "num_ok": 1,
        "num_errors": 0,
        "errors": {},
        "duration_s": 1.0,
        "total_output_tokens": 8,
        "prompt_len_mismatches": 0,
        "output_tok_s": 8.0,
        "aggregate_decode_tok_s": 10.0,
        "itl_basis": "token_ids",
        "ttft_s": dict(stats),
        "itl_s": dict(stats),
        "chunk_gap_s": None,
        "decode_tok_s_per_stream": dict(stats, p50=10.0, p90=10.0, p99=10.0, max=10.0),
        "e2e_s": dict(stats),
        "spec_decode": {
            "num_drafts": 4,
            "num_draft_tokens": 16,
            "num_accepted_tokens": 6,
            "accepted_per_position": [3, 2, 1, 0],
            "acceptance_rate": 0.375,
            "mean_acceptance_length": 2.5,
            "acceptance_per_position": [0.75, 0.5, 0.25, 0.0],
        },
        "dspark": None,
        "requests": [
            {
                "index": 0,
                "status": "ok",
                "error": None,
                "http_status": 200,
                "prompt_tokens": 64,
                "expected_prompt_tokens": 64,
                "output_tokens": 8,
                "num_chunks": 4,
                "ttft_s": 1.0,
                "decode_tok_s": 10.0,
                "e2e_s": 1.7,
                "finish_reason": "length",
                "token_count_source": "usage",
            }
        ],
    }
    return {
        "schema_version": 1,
        "kind": "bench_serving",
        "created_utc": "2026-01-01T00:00:00Z",
        "run_id": "x",
        "note": None,
        "recipe": {"profile": "a", "profile_source": "cli", "profile_config": None, "pins": None},
        "machine": {
            "client": {"hostname": "h", "platform": "p", "python": "3.11", "cpu_count": 2},
            "server": {"base_url": "u", "model": "m", "version": None, "max_model_len": None},
        },
        "config": {
            "endpoint": "completions",
            "concurrency": [1],
            "prompt_lens": [64],
            "output_len": 8,
            "rounds": 1,
            "warmup": 0,
            "seed": 0,
        },
        "warmup": {"num_requests": 0, "num_ok": 0},
        "metrics_available": True,
        "runs": [run],
    }


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.pop("runs"), "$.runs"),
        (lambda d: d["runs"][0]["ttft_s"].update(p50=9.0), "runs[0].ttft_s"),
        (lambda d: d["runs"][0].update(num_ok=0), "runs[0]"),
        (lambda d: d["runs"][0]["errors"].update(timeout=1), "runs[0].errors"),
        (lambda d: d["runs"][0]["requests"][0].update(status="weird"), "requests[0].status"),
        (lambda d: d["config"].update(concurrency=[0]), "config.concurrency"),
        (lambda d: d.update(schema_version=2), "schema_version"),
        (lambda d: d["runs"][0]["spec_decode"].update(num_drafts=-1), "spec_decode.num_drafts"),
    ],
)
def test_validate_result_names_the_bad_field(mutate, field):
    good = _tiny_result()
    schema.validate_result(good)
    bad = copy.deepcopy(good)
    mutate(bad)
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("$", r"\$")):
        schema.validate_result(bad)


def test_compare_bench_ratios(tmp_path, capsys):
    a = _tiny_result()
    b = copy.deepcopy(a)
    b["recipe"]["profile"] = "b"
    rb = b["runs"][0]
    rb["aggregate_decode_tok_s"] = 25.0  # 2.5x
    rb["output_tok_s"] = 4.0  # 0.5x
    rb["ttft_s"]["p50"] = 0.5  # 0.5x (lower is better)
    rb["spec_decode"]["mean_acceptance_length"] = 3.0  # 1.2x
    extra = copy.deepcopy(rb)
    extra["concurrency"] = 4
    b["runs"].append(extra)

    cmp = compare.compare(a, b)
    row = cmp["rows"][0]
    assert (row["prompt_len"], row["concurrency"]) == (64, 1)
    m = row["metrics"]
    assert m["aggregate_decode_tok_s"]["ratio"] == pytest.approx(2.5)
    assert m["output_tok_s"]["ratio"] == pytest.approx(0.5)
    assert m["ttft_p50_s"]["ratio"] == pytest.approx(0.5)
    assert m["mean_acceptance_length"]["ratio"] == pytest.approx(1.2)
    assert m["aggregate_decode_tok_s"]["a"] == 10.0 and m["aggregate_decode_tok_s"]["b"] == 25.0
    assert cmp["only_in_b"] == [(64, 4)] and cmp["only_in_a"] == []

    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    assert compare.main([str(pa), str(pb)]) == 0
    out = capsys.readouterr().out
    assert "2.50x" in out and "0.50x" in out and "only in b" in out.lower()
    # a missing metric gives no ratio instead of a crash
    b["runs"][0]["spec_decode"] = None
    row = compare.compare(a, b)["rows"][0]
    assert row["metrics"]["mean_acceptance_length"]["ratio"] is None
    # an invalid file is refused with a clear message
    pb.write_text(json.dumps({"kind": "other"}))
    assert compare.main([str(pa), str(pb)]) == 2
    assert "b.json" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# /metrics parsing
# ---------------------------------------------------------------------------------------

# A /metrics page of a two-engine vLLM server with speculative decoding (label orders vary,
# escapes, NaN, exponents, histogram buckets).
VLLM_METRICS_SAMPLE = (Path(__file__).parent / "fixtures" / "vllm_metrics_sample.txt").read_text()


def test_parse_vllm_spec_decode_counters():
    c = prometheus.spec_decode_counters(VLLM_METRICS_SAMPLE)
    assert c == {
        "num_drafts": 210.0,
        "num_draft_tokens": 1050.0,
        "num_accepted_tokens": 300.0,
        "accepted_per_position": [182.0, 81.0, 29.0, 7.0, 1.0],
    }
    samples = prometheus.parse_prometheus(VLLM_METRICS_SAMPLE)
    http = [s for s in samples if s[0] == "http_requests_total"][0]
    assert http[1]["note"] == 'a "quoted" \\ value' and http[2] == 7.0
    assert [s for s in samples if s[0] == "process_start_time_seconds"][0][1] == {}


def test_spec_decode_delta_and_derived_figures():
    before = prometheus.spec_decode_counters(VLLM_METRICS_SAMPLE)
    after = copy.deepcopy(before)
    after["num_drafts"] += 100
    after["num_draft_tokens"] += 500
    after["num_accepted_tokens"] += 180
    after["accepted_per_position"] = [
        a + d for a, d in zip(before["accepted_per_position"], [80, 50, 30, 15, 5], strict=True)
    ]
    d = prometheus.spec_decode_delta(before, after)
    assert d["num_drafts"] == 100 and d["num_draft_tokens"] == 500
    assert d["num_accepted_tokens"] == 180
    assert d["accepted_per_position"] == [80, 50, 30, 15, 5]
    assert d["acceptance_rate"] == pytest.approx(0.36)
    assert d["mean_acceptance_length"] == pytest.approx(2.8)
    assert d["acceptance_per_position"] == pytest.approx([0.8, 0.5, 0.3, 0.15, 0.05])
    idle = prometheus.spec_decode_delta(before, before)
    assert idle["num_drafts"] == 0 and idle["mean_acceptance_length"] is None
    assert idle["acceptance_per_position"] is None
    assert prometheus.spec_decode_counters("# nothing\nvllm:num_requests_running 1\n") is None
    with pytest.raises(ValueError, match="backwards"):
        prometheus.spec_decode_delta(after, before)


def test_malformed_metrics_line_is_named():
    with pytest.raises(ValueError, match="line 2"):
        prometheus.parse_prometheus("ok_metric 1\nthis is not a sample\n")


def test_percentiles_match_linear_interpolation():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert stats.percentile(xs, 50) == 3.0
    assert stats.percentile(xs, 90) == pytest.approx(4.6)
    assert stats.percentile(xs, 99) == pytest.approx(4.96)
    assert stats.percentile([7.0], 99) == 7.0
    s = stats.summarize([None, 2.0, 4.0])
    assert s["n"] == 2 and s["mean"] == 3.0 and s["p50"] == 3.0
    assert stats.summarize([None]) is None
