"""A private, overlay-applied copy of the venv's vLLM for subprocess tests.

``pristine_vllm_tree(dst)`` lays out ``dst/vllm`` from the installed package (shared
libraries symlinked, the rest copied) without any overlay, and ``apply_overlay(dst)`` /
``revert_overlay(dst)`` run scripts/apply_overlay.sh on it. A subprocess with
``PYTHONPATH=dst`` then imports that vLLM instead of the venv's; the venv's own files are
never touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
APPLY = REPO / "scripts/apply_overlay.sh"
MARKER = "vllm/.dspark_overlay.json"


def installed_vllm_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("vllm is not installed in this interpreter")
    return Path(next(iter(spec.submodule_search_locations)))


def make_vllm_tree(dst: Path, src: Path | None = None) -> Path:
    """Mirror the installed ``vllm`` package under ``dst/vllm``; return ``dst``.

    Shared libraries are symlinked (they are never written), links are re-created as links,
    everything else is copied, so the apply tool sees the same file states as in the source
    (an overlay applied to the venv by ``make setup``, copy or link mode, stays consistent)
    and nothing it does can reach the venv's files.
    """
    src = src or installed_vllm_dir()
    for root, _dirs, files in os.walk(src):
        rel = Path(root).relative_to(src)
        out = dst / "vllm" / rel
        out.mkdir(parents=True, exist_ok=True)
        for name in files:
            path = Path(root) / name
            if path.is_symlink():
                os.symlink(os.readlink(path), out / name)
            elif name.endswith(".so"):
                os.symlink(path, out / name)
            else:
                shutil.copy2(path, out / name)
    return dst


def pristine_vllm_tree(dst: Path) -> Path:
    """``make_vllm_tree`` with any overlay the venv carries taken off again."""
    make_vllm_tree(dst)
    if (dst / MARKER).exists():
        revert_overlay(dst)
    return dst


def _run_apply(target: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(APPLY), "--target", str(target), *flags],
        capture_output=True,
        text=True,
        env={**os.environ, "OVERLAY_PYTHON": sys.executable},
        timeout=300,
    )


def apply_overlay(target: Path) -> str:
    res = _run_apply(target)
    if res.returncode != 0:
        raise RuntimeError(f"apply_overlay.sh failed ({res.returncode}):\n{res.stdout}{res.stderr}")
    return res.stdout


def revert_overlay(target: Path) -> str:
    res = _run_apply(target, "--revert")
    if res.returncode != 0:
        raise RuntimeError(f"apply_overlay.sh --revert failed:\n{res.stdout}{res.stderr}")
    return res.stdout


def subprocess_env(tree: Path | None) -> dict[str, str]:
    """Environment for a vLLM subprocess that imports the vLLM under ``tree``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TRITON_INTERPRET", "PYTHONPATH") and not k.startswith("PYTEST_")
    }
    # scripts/ for the overlay loader (tests/support/overlay.py); `tree` first when given
    trees = [str(tree)] if tree is not None else []
    env["PYTHONPATH"] = os.pathsep.join([*trees, str(REPO / "scripts")])
    env.update(
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_USE_V2_MODEL_RUNNER="0",
        TOKENIZERS_PARALLELISM="false",
    )
    return env
