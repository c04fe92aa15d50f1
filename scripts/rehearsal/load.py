"""The rehearsal's client, run inside a node's namespace (``python -m scripts.rehearsal.load``).

    mixed  --base-url URL --out FILE   greedy and sampled requests with long prompts, all at
                                       once (prefill chunks pack several requests), then seeded
                                       sampled requests, one at a time, twice; /metrics
                                       before and after
    stream --base-url URL --out FILE   N streaming requests with long outputs; prints one
                                       ``started I`` line per request at its first token, so the
                                       caller can kill a node mid-stream, and records how each
                                       one ended

Prompts are token ids (``/v1/completions`` accepts them) and outputs come back as token ids
(``return_token_ids``), so the driver can teacher-force them against the plain target. The API
key is read from VLLM_API_KEY, as ``make smoke`` does. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from scripts.node.metrics import dspark_snapshot

VOCAB_LOW, VOCAB_HIGH = 10, 1000  # ids of ordinary tokens of the tiny tokenizer
MIXED_PROMPT_LENS = [620, 180, 480, 350, 700, 260, 540, 90, 410, 650]
OUTPUT_LEN = 24
SEEDED_PROMPT_LENS = [12, 25, 40, 18]
SAMPLED = {"temperature": 0.8, "top_p": 0.95}


def _headers() -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if os.environ.get("VLLM_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['VLLM_API_KEY']}"
    return headers


def post(url: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), _headers())
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def metrics(base: str) -> dict | None:
    req = urllib.request.Request(f"{base}/metrics", headers=_headers())
    with urllib.request.urlopen(req, timeout=30) as resp:
        return dspark_snapshot(resp.read().decode())


def prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(length)]


def complete(base: str, model: str, ids: list[int], **sampling) -> dict:
    body = {"model": model, "prompt": ids, "max_tokens": OUTPUT_LEN, "ignore_eos": True,
            "return_token_ids": True, **sampling}  # fmt: skip
    start = time.monotonic()
    try:
        choice = post(f"{base}/v1/completions", body)["choices"][0]
        return {"output": choice["token_ids"], "seconds": time.monotonic() - start}
    except (urllib.error.URLError, OSError, KeyError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}


def mixed(base: str, model: str) -> dict:
    rng = random.Random(29)
    requests = []
    for i, length in enumerate(MIXED_PROMPT_LENS):
        greedy = i % 2 == 0
        sampling = {"temperature": 0.0} if greedy else SAMPLED
        requests.append({"prompt": prompt(rng, length), "greedy": greedy, "sampling": sampling})
    seeded = [prompt(rng, n) for n in SEEDED_PROMPT_LENS]
    before = metrics(base)
    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(lambda r: complete(base, model, r["prompt"], **r["sampling"]),
                                requests))  # fmt: skip
    for req, res in zip(requests, results, strict=True):
        req.update(res)
    # One at a time, so both runs batch each request the same way: a seed promises the same
    # tokens for the same steps, and at TP=4 gloo's all-reduce sums in an order that depends
    # on the tensor's size, so a request sharing steps with others may round differently.
    runs = [[complete(base, model, ids, seed=1000 + i, **SAMPLED) for i, ids in enumerate(seeded)]
            for _ in range(2)]  # fmt: skip
    return {
        "requests": requests,
        "seeded": {"prompts": seeded, "runs": runs},
        "dspark_before": before,
        "dspark_after": metrics(base),
    }


def stream_one(base: str, model: str, index: int, ids: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True}  # fmt: skip
    req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(), _headers())
    out = {"index": index, "chunks": 0, "finish_reason": None, "error": None}
    try:
        with urllib.request.urlopen(req, timeout=900) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out["error"] = f"server error event: {event['error']}"
                    break
                out["chunks"] += 1
                if out["chunks"] == 1:
                    print(f"started {index}", flush=True)
                out["finish_reason"] = event["choices"][0].get("finish_reason") or out[
                    "finish_reason"
                ]
    except (urllib.error.URLError, OSError, ValueError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["ended_at"] = time.time()
    if out["error"] is None and out["finish_reason"] is None:
        out["error"] = "stream ended without a finish reason"
    return out


def stream(base: str, model: str, n: int, max_tokens: int) -> dict:
    rng = random.Random(7)
    prompts = [prompt(rng, 64) for _ in range(n)]
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda a: stream_one(base, model, a[0], a[1], max_tokens),
                                enumerate(prompts)))  # fmt: skip
    return {"streams": results}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("mixed", "stream"))
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=400)
    args = ap.parse_args(argv)
    base = args.base_url.rstrip("/")
    if args.mode == "mixed":
        result = mixed(base, args.model)
    else:
        result = stream(base, args.model, args.streams, args.max_tokens)
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
