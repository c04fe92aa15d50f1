#!/usr/bin/env python3
"""Smoke test of a running DSpark vLLM server: health, one chat completion, spec-decode counters.

    python -m scripts.smoke [--profile spark-2x] [--host H | --base-url URL] [--model NAME]
    python -m scripts.smoke --health ...      only GET /health (the container healthcheck)

The port and served model name come from the recipe profile (scripts/recipe.py), so this
checks the server the profile describes. It passes when /health is 200, the model is listed,
one chat completion returns text, and /metrics shows vLLM's speculative-decoding counters
going up across that completion (drafts proposed, tokens accepted), and prints what the
DSpark drafter did (vllm:dspark_* series, when the server exports them). Exit 0 pass, 1 fail.
Only the standard library (plus the recipe tool's PyYAML); an API key is read from
VLLM_API_KEY.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request

from scripts.node.metrics import (
    dspark_delta,
    dspark_snapshot,
    format_dspark,
    spec_decode_counters,
    spec_decode_delta,
)

PROMPT = "List the first ten prime numbers, separated by commas."


class SmokeError(Exception):
    """A failed step, with what to do about it."""


def request(url: str, payload: dict | None = None, timeout: float = 10.0) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"}
    if os.environ.get("VLLM_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['VLLM_API_KEY']}"
    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise SmokeError(f"{url}: cannot connect ({reason})") from exc


def profile_target(profile: str) -> tuple[int, str]:
    """(API port, served model name) from the recipe profile."""
    from scripts import recipe  # needs PyYAML

    try:
        env = recipe.profile_env(recipe.load_profile(profile))
    except recipe.RecipeError as exc:
        raise SmokeError(f"profile {profile!r}: {exc}") from exc
    return int(env["API_PORT"]), env["SERVED_MODEL_NAME"]


def check_health(base: str) -> str:
    status, body = request(f"{base}/health", timeout=5.0)
    if status != 200:
        raise SmokeError(f"{base}/health answered {status}: {body[:200]!r}; the server is not ready "
                         "(make logs; the first start compiles and loads for many minutes)")
    return "health 200"


def metrics(base: str) -> str:
    status, body = request(f"{base}/metrics")
    if status != 200:
        raise SmokeError(f"{base}/metrics answered {status}"
                         + (" (401: set VLLM_API_KEY for this client)" if status == 401 else ""))
    return body


def run(base: str, model: str, max_tokens: int, timeout: float) -> list[str]:
    lines = [check_health(base)]
    status, body = request(f"{base}/v1/models")
    if status != 200:
        raise SmokeError(f"{base}/v1/models answered {status}: {body[:200]!r}"
                         " (401: set VLLM_API_KEY for this client)")
    served = [m.get("id") for m in json.loads(body).get("data", [])]
    if model not in served:
        raise SmokeError(f"model {model!r} is not served (the server lists {served}); "
                         "is this the profile the server was started with?")
    lines.append(f"model {model} listed")

    before_page = metrics(base)
    before = spec_decode_counters(before_page)
    payload = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    t0 = time.monotonic()
    status, body = request(f"{base}/v1/chat/completions", payload, timeout=timeout)
    elapsed = time.monotonic() - t0
    if status != 200:
        raise SmokeError(f"chat completion answered {status}: {body[:300]!r}")
    try:
        reply = json.loads(body)
        message = reply["choices"][0]["message"]
        completion_tokens = int(reply["usage"]["completion_tokens"])
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise SmokeError(f"chat completion is not an OpenAI chat response ({exc}): {body[:300]!r}")
    # vLLM 0.32.0 puts a reasoning parser's output in `reasoning` (older: `reasoning_content`).
    reasoning = message.get("reasoning") or message.get("reasoning_content") or ""
    text = (message.get("content") or "") + reasoning
    if not text.strip() or completion_tokens <= 0:
        raise SmokeError(f"chat completion returned no text ({completion_tokens} tokens): {body[:300]!r}")
    lines.append(f"chat completion: {completion_tokens} tokens in {elapsed:.2f}s: {text.strip()[:80]!r}")

    after_page = metrics(base)
    after = spec_decode_counters(after_page)
    if after is None:
        raise SmokeError("/metrics has no vllm:spec_decode_* counters: speculative decoding is off "
                         "(check the profile's speculative section and the server log)")
    delta = spec_decode_delta(before, after)
    if delta["num_drafts"] <= 0:
        raise SmokeError("the completion ran, but the spec-decode counters did not move "
                         "(no drafts proposed): DSpark is configured but not drafting")
    rate = delta["acceptance_rate"]
    rate_text = f"{rate:.2f}" if rate is not None else "n/a"
    per_pos = ", ".join(f"{x:.2f}" for x in delta["acceptance_per_position"] or [])
    lines.append(
        f"spec decode: {delta['num_drafts']} drafts, {delta['num_draft_tokens']} draft tokens, "
        f"{delta['num_accepted_tokens']} accepted (rate {rate_text}, mean acceptance length "
        f"{delta['mean_acceptance_length']:.2f}; per position: {per_pos})"
    )
    dspark = dspark_delta(dspark_snapshot(before_page), dspark_snapshot(after_page))
    if dspark is None:
        lines.append("dspark: no vllm:dspark_* series on /metrics (the server was started "
                     "without PROMETHEUS_MULTIPROC_DIR; scripts/serve.py sets it)")
    elif sum(dspark["steps"].values()) <= 0:
        raise SmokeError("the completion ran, but vllm:dspark_steps_total did not move")
    else:
        lines.append(f"dspark: {format_dspark(dspark)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default=os.environ.get("PROFILE", "spark-2x"))
    parser.add_argument("--host", default="127.0.0.1", help="server host (the head's address)")
    parser.add_argument("--base-url", help="overrides --host and the profile's port")
    parser.add_argument("--model", help="served model name (default: from the profile)")
    parser.add_argument("--health", action="store_true", help="only check /health")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=600.0, help="chat completion timeout (s)")
    args = parser.parse_args(argv)
    try:
        model = args.model
        base = args.base_url
        if base is None or (model is None and not args.health):
            port, served = profile_target(args.profile)
            base = base or f"http://{args.host}:{port}"
            model = model or served
        base = base.rstrip("/")
        lines = [check_health(base)] if args.health else run(base, model, args.max_tokens, args.timeout)
    except SmokeError as exc:
        print(f"smoke: FAIL: {exc}", file=sys.stderr)
        return 1
    for line in lines:
        print(f"smoke: {line}")
    if not args.health:
        print(f"smoke: OK ({base})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
