"""The node-policy subcommands of ``python -m scripts.recipe``, shared by preflight.sh and the
container entrypoint: a node's .env as exports, its variables checked, the model cache, and the
listening-socket audit of a running node."""

from __future__ import annotations

import argparse
import os

from scripts.node import audit, cache, env
from scripts.node.report import Report
from scripts.recipe import RecipeError, load_profile, model_ref


def run(args: argparse.Namespace) -> int:
    """``python -m scripts.recipe env-file | check-env | check-cache | audit``."""
    report = Report()
    if args.cmd == "audit":
        try:
            profile = load_profile(args.profile)
            rows = audit.parse_ss(args.ss.read_text())
        except (RecipeError, OSError, ValueError) as exc:
            report.fail("audit", f"cannot audit: {exc}", "fix the profile or the ss output file")
            return report.exit_code
        audit.check(rows, os.environ, profile["serving"]["port"],
                    profile["parallel"]["master_port"], args.pids, report)
        return report.exit_code
    if args.cmd == "env-file":
        values = env.parse_env_file(args.file, report)
        if values is not None:
            print(env.exports(values, os.environ), end="")
    elif args.cmd == "check-env":
        mode = "container" if args.container else "host"
        if env.check(os.environ, mode, args.nnodes, report):
            role = "head" if os.environ.get("NODE_RANK") == "0" else "worker"
            report.passed("env", f"variables are well-formed ({mode if args.container else role})")
    else:
        try:
            profile = load_profile(args.profile)
        except RecipeError as exc:
            report.fail("cache", f"profile {args.profile!r}: {exc}", "fix the profile")
            return report.exit_code
        cache.check(args.cache_dir, model_ref(profile), profile["model"]["revision"], args.image,
                    args.container_uid, report)
    return report.exit_code


def pid_set(text: str) -> set[int]:
    """``--pids``: a comma- or space-separated pid list."""
    try:
        return {int(p) for p in text.replace(",", " ").split()}
    except ValueError:
        raise argparse.ArgumentTypeError(f"--pids: {text!r} is not a comma-separated pid list")
