"""Bounded serving soak against the real cpu-tiny server: nothing leaks, nothing dies.

Waves of concurrent streaming completions (more than `max_num_seqs` at once, prompts of 1 to
300 tokens, greedy and sampled mixed, every third dropped by the client mid-stream), and
between waves a battery of malformed requests. Afterwards: every malformed request got a 4xx
with a message, /health stayed 200, the engine process is the same one, the drafter's ring
rows all came back (vllm:dspark_ring_slots_in_use == 0), its steps took both the flat and the
ragged path, and a greedy request is still correct by teacher forcing through the server's
own prompt logprobs. Loopback only; every loop and request is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import time
import urllib.error
import urllib.request

import pytest
import yaml

from scripts.node.metrics import dspark_delta, dspark_snapshot, format_dspark, parse_prometheus
from scripts.verify.teacher_forcing import EPSILON_NATS, token_deficits
from tests.support.cpu_server import CPU_TINY_API_KEY, child_pids, process_tree_rss
from tests.support.paths import REPO

aiohttp = pytest.importorskip("aiohttp")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

PROFILE = yaml.safe_load((REPO / "recipe/profiles/cpu-tiny.yaml").read_text())
MODEL = PROFILE["model"]["served_name"]
MAX_NUM_SEQS = PROFILE["serving"]["max_num_seqs"]
MAX_MODEL_LEN = PROFILE["serving"]["max_model_len"]

WAVES = 4
PER_WAVE = 2 * MAX_NUM_SEQS  # more than can run at once: some wait in the queue
DROP_EVERY = 3  # every third request is dropped by the client after its first chunks
DROP_AFTER_CHUNKS = 2
REQUEST_TIMEOUT_S = 240
DRAIN_TIMEOUT_S = 120


def completion(prompt: list[int], max_tokens: int, temperature: float, **extra) -> dict:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        **extra,
    }


@functools.cache
def vocab_size() -> int:
    """The tiny checkpoint's vocabulary; read once the server fixture has generated it."""
    config = REPO / PROFILE["model"]["id"] / "config.json"
    return json.loads(config.read_text())["vocab_size"]


def malformed_requests() -> dict[str, tuple[str, dict | bytes]]:
    """Requests the server must refuse with a 4xx and a message: what -> (path, body)."""
    return {
        "invalid JSON": (
            "/v1/completions",
            b'{"model": "' + MODEL.encode() + b'", "prompt": [1, 2',
        ),
        "prompt longer than max_model_len": (
            "/v1/completions",
            completion([7] * (MAX_MODEL_LEN + 10), 4, 0.0),
        ),
        "absurd max_tokens": ("/v1/completions", completion([7] * 5, 10**12, 0.0)),
        "negative max_tokens": ("/v1/completions", completion([7] * 5, -3, 0.0)),
        "unknown model": ("/v1/completions", completion([7] * 5, 4, 0.0) | {"model": "no-such"}),
        "out-of-vocabulary token id": (
            "/v1/completions",
            completion([7, vocab_size() + 100], 4, 0.0),
        ),
        "negative token id": ("/v1/completions", completion([7, -4], 4, 0.0)),
        "messages not a list": (
            "/v1/chat/completions",
            {"model": MODEL, "messages": "hello", "max_tokens": 4},
        ),
        "message content of the wrong type": (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": 123}], "max_tokens": 4},
        ),
        "unknown message role": (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 4},
        ),
        "negative temperature": ("/v1/completions", completion([7] * 5, 4, -1.0)),
    }


# The shared server requires its API key (as a Spark head does): every request carries it.
HEADERS = {"Authorization": f"Bearer {CPU_TINY_API_KEY}", "Content-Type": "application/json"}


def http(base: str, path: str, body: dict | bytes | None = None) -> tuple[int, str]:
    data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data, HEADERS)
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def metrics(base: str) -> str:
    status, text = http(base, "/metrics")
    assert status == 200
    return text


def metric_sum(text: str, name: str) -> float:
    """Sum of a series over its label sets (one engine here)."""
    values = [v for n, _, v in parse_prometheus(text) if n == name]
    assert values, f"{name} missing from /metrics"
    return sum(values)


def finished_total(text: str) -> float:
    """Requests vLLM finished by itself (any reason); a request the client dropped and
    vLLM aborted is not among them (vLLM 0.32 counts no aborts in this series)."""
    return sum(v for n, _, v in parse_prometheus(text) if n == "vllm:request_success_total")


def wave_requests(rng: random.Random, wave: int) -> list[dict]:
    reqs = []
    for i in range(PER_WAVE):
        drop = i % DROP_EVERY == DROP_EVERY - 1
        prompt_len = rng.randint(1, 300)
        reqs.append(
            {
                "drop": drop,
                # Dropped ones ask for many tokens and ignore EOS, so they are surely
                # mid-stream when the client goes away.
                "body": completion(
                    [rng.randrange(3, vocab_size()) for _ in range(prompt_len)],
                    max_tokens=160 if drop else rng.randint(4, 24),
                    temperature=0.0 if (i + wave) % 2 == 0 else 0.8,
                    stream=True,
                    ignore_eos=drop,
                ),
            }
        )
    return reqs


async def stream_one(session, base: str, req: dict) -> str:
    """'done' (read to [DONE] with at least one token), or 'dropped' (closed mid-stream)."""
    chunks = 0
    async with session.post(base + "/v1/completions", json=req["body"]) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                assert chunks > 0, "stream ended without a token"
                return "done"
            payload = json.loads(line[len("data: ") :])
            assert "error" not in payload, payload
            chunks += 1
            if req["drop"] and chunks >= DROP_AFTER_CHUNKS:
                resp.close()  # the client goes away; vLLM must abort the request
                return "dropped"
    raise AssertionError("stream closed without [DONE]")


async def run_wave(base: str, reqs: list[dict]) -> list[str]:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout, headers=HEADERS) as session:
        return await asyncio.gather(*(stream_one(session, base, r) for r in reqs))


def check_malformed(base: str) -> int:
    requests = malformed_requests()
    for what, (path, body) in requests.items():
        status, text = http(base, path, body)
        assert 400 <= status < 500, f"{what}: HTTP {status}: {text[:300]}"
        message = json.loads(text)["error"]["message"]
        assert isinstance(message, str) and message.strip(), f"{what}: no error message: {text}"
    return len(requests)


def wait_drained(base: str) -> str:
    """The /metrics page once no request runs or waits and the drafter holds no ring row."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        text = metrics(base)
        busy = sum(
            metric_sum(text, f"vllm:num_requests_{state}") for state in ("running", "waiting")
        )
        slots = metric_sum(text, "vllm:dspark_ring_slots_in_use")
        if (busy == 0 and slots == 0) or time.monotonic() > deadline:
            return text
        time.sleep(1)


def teacher_forcing_deficit(base: str, prompt: list[int], max_tokens: int) -> float:
    """Largest gap (nats) between the target's best logprob and each greedy token emitted."""
    status, text = http(
        base, "/v1/completions", completion(prompt, max_tokens, 0.0, return_token_ids=True)
    )
    assert status == 200, text
    emitted = json.loads(text)["choices"][0]["token_ids"]
    assert emitted, "greedy request emitted nothing"
    status, text = http(
        base, "/v1/completions", completion(prompt + emitted, 1, 0.0, prompt_logprobs=1)
    )
    assert status == 200, text
    scored = [
        None if entry is None else {int(t): v["logprob"] for t, v in entry.items()}
        for entry in json.loads(text)["choices"][0]["prompt_logprobs"]
    ]
    return max(token_deficits(scored, len(prompt), emitted))


def test_soak_leaks_nothing(cpu_tiny_server, capsys):
    server = cpu_tiny_server
    base = server.base_url
    rng = random.Random(15)
    engine_pids = child_pids(server.pid)
    assert engine_pids, "the API server has no engine process"
    # One request first: vLLM and the drafter publish their series from the first step on.
    assert http(base, "/v1/completions", completion([5, 6, 7], 4, 0.0))[0] == 200
    mem_before = process_tree_rss(server.pid)
    first = wait_drained(base)
    before = dspark_snapshot(first)
    finished_before = finished_total(first)
    tokens_before = metric_sum(first, "vllm:generation_tokens_total")
    assert before is not None, "no vllm:dspark_* series on /metrics"

    t0 = time.monotonic()
    outcomes: list[str] = []
    malformed = 0
    for wave in range(WAVES):
        outcomes += asyncio.run(run_wave(base, wave_requests(rng, wave)))
        malformed += check_malformed(base)
        assert http(base, "/health")[0] == 200, f"/health failed after wave {wave}"
    after_page = wait_drained(base)
    duration = time.monotonic() - t0

    delta = dspark_delta(before, dspark_snapshot(after_page))
    finished = finished_total(after_page) - finished_before
    # Tokens generated for the dropped requests before vLLM aborted them.
    dropped_tokens = (
        metric_sum(after_page, "vllm:generation_tokens_total")
        - tokens_before
        - (
            metric_sum(after_page, "vllm:request_generation_tokens_sum")
            - metric_sum(first, "vllm:request_generation_tokens_sum")
        )
    )
    deficit = teacher_forcing_deficit(base, [rng.randrange(3, vocab_size()) for _ in range(57)], 24)
    mem_after = process_tree_rss(server.pid)
    with capsys.disabled():
        print(
            f"\nsoak: {len(outcomes)} streamed requests in {WAVES} waves "
            f"({outcomes.count('dropped')} dropped by the client after "
            f"{int(dropped_tokens)} tokens in all), {malformed} malformed, {duration:.1f} s; "
            f"memory MiB api/tree before {mem_before['api_server_mib']:.0f}/"
            f"{mem_before['server_tree_mib']:.0f}, after {mem_after['api_server_mib']:.0f}/"
            f"{mem_after['server_tree_mib']:.0f}; dspark: {format_dspark(delta)}; "
            f"greedy teacher-forcing worst deficit {deficit:.4f} nats"
        )

    assert outcomes.count("dropped") == WAVES * (PER_WAVE // DROP_EVERY)
    assert outcomes.count("done") == len(outcomes) - outcomes.count("dropped")
    # Every dropped stream was aborted: vLLM finished exactly the streams read to the end.
    assert finished == outcomes.count("done"), "a dropped stream ran on to its end"
    assert engine_pids <= child_pids(server.pid), "the engine process was replaced"
    assert http(base, "/health")[0] == 200
    assert delta["ring_slots_in_use"] == 0, f"ring rows leaked: {format_dspark(delta)}"
    assert delta["ring_slots_total"] == MAX_NUM_SEQS
    assert delta["steps"]["flat"] > 0 and delta["steps"]["ragged"] > 0, format_dspark(delta)
    assert delta["context_rows"]["stored"] > 0
    assert deficit <= EPSILON_NATS, f"greedy output after the soak is off by {deficit:.3f} nats"
