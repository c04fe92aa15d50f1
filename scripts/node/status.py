"""`make status`: this node in one screen, read-only.

The recipe's container (state and health from Docker), the API's health, the served model
and the runner (from the profile), the last self-test record for this node, and the
DSpark and speculative-decoding counters from ``/metrics`` (the head's API; the key from
``VLLM_API_KEY``). Every probe that fails says so on its line and the rest still print.

    python -m scripts.node.status [--profile spark-2x] [--host 127.0.0.1]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import urllib.request

from scripts import recipe
from scripts.selftest.record import DEFAULT_DIR, load_all

COUNTERS = ("vllm:dspark_steps_total", "vllm:dspark_context_rows_total",
            "vllm:dspark_ring_slots_in_use", "vllm:spec_decode_num_drafts_total",
            "vllm:spec_decode_num_accepted_tokens_total")


def _get(url: str) -> str:
    req = urllib.request.Request(url)
    key = os.environ.get("VLLM_API_KEY")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=5) as resp:
        return resp.read().decode()


def container() -> str:
    try:
        out = subprocess.run(
            ["docker", "ps", "-a", "--filter", "label=com.docker.compose.project=dspark",
             "--format", "{{.Names}}: {{.Status}}"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    return "; ".join(out.stdout.split("\n")).strip("; ") or "none"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=os.environ.get("PROFILE", "spark-2x"))
    ap.add_argument("--host", default="127.0.0.1")
    args = ap.parse_args(argv)
    profile = recipe.load_profile(args.profile)
    base = f"http://{args.host}:{profile['serving']['port']}"
    print(f"container : {container()}")
    try:
        _get(f"{base}/health")
        health = "healthy"
    except OSError as e:
        health = f"no answer ({e})"
    print(f"api       : {base} {health}")
    print(f"model     : {profile['model']['served_name']} ({profile['model']['id']} "
          f"@ {profile['model']['revision']}), profile {profile['name']}")
    print(f"runner    : {profile['speculative']['runner']}, k={profile['speculative']['num_speculative_tokens']}")
    records = load_all(DEFAULT_DIR)
    if records:
        last = records[0]
        print(f"self-test : {last['result']} {last.get('finished', '?')} on "
              f"{last['device']['name']}, image {last['image_id'][:19]} ({last['_path']})")
    else:
        print(f"self-test : no record in {DEFAULT_DIR} (make selftest)")
    try:
        text = _get(f"{base}/metrics")
    except OSError as e:
        print(f"counters  : unavailable ({e})")
        return 0
    for line in text.splitlines():
        if line.startswith(COUNTERS):
            print(f"counters  : {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
