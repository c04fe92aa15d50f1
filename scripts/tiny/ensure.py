"""The tiny checkpoint's path, generated on first use and, when asked, its draft trained once.

The one place that knows where the demo's checkpoint lives and how to make it: the demo, the
server, the benchmarks and the tests call this instead of running the generators themselves.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

from scripts.tiny.make_tiny_model import write_generation_config
from scripts.tiny.membound import RECORD as TWIN_RECORD

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = REPO / "models" / "tiny-dsv4-dspark"


def run_tool(module: str, *args: str) -> None:
    """``python -m scripts.tiny.<module> ARGS`` from the repo root (its imports need it)."""
    subprocess.run([sys.executable, "-m", f"scripts.tiny.{module}", *args], cwd=REPO, check=True)


def ensure_tiny_model(
    path: Path = TINY_MODEL,
    *,
    train: bool = True,
    quiet: bool = True,
    compress_ratios: str | None = None,
    announce: str | None = None,
) -> Path:
    """``path`` holding the tiny DeepSeek-V4-DSpark checkpoint; each step skipped when done.

    ``train`` trains the checkpoint's draft against the tiny target (recorded beside the
    checkpoint, so a second call only reads the record); ``quiet`` hides the training's
    progress; ``announce`` (a prefix, e.g. ``">> "``) prints a line before generating.
    """
    path = Path(path).resolve()
    if (path / TWIN_RECORD).is_file():
        # The memory-bound twin: `make model-membound` generates and trains it, at its own
        # temperature and training settings; the tiny defaults would overwrite both.
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # One generator and trainer per checkpoint: a test run and a demo started on a fresh
    # checkout would otherwise train the same draft at once, into the same files.
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _generate_and_train(path, train, quiet, compress_ratios, announce)
    return path


def _generate_and_train(path: Path, train: bool, quiet: bool, compress_ratios: str | None,
                        announce: str | None) -> None:
    if not (path / "config.json").exists():
        if announce is not None:
            print(f"{announce}generating the tiny DeepSeek-V4-DSpark checkpoint: {path}", flush=True)
        extra = [] if compress_ratios is None else ["--compress-ratios", compress_ratios]
        run_tool("make_tiny_model", "--dspark", "--quiet", "--force", "--out", str(path), *extra)
    elif write_generation_config(path) and announce is not None:  # made before the default
        print(f"{announce}set the tiny checkpoint's default sampling: {path}", flush=True)
    if train:
        run_tool("train_tiny_draft", "--model", str(path), *(["--quiet"] if quiet else []))


if __name__ == "__main__":  # `make model`: the demo's checkpoint and its trained draft
    ensure_tiny_model(quiet=False, announce=">> ")
