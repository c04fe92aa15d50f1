"""Copies of the venv's vLLM for tests: pristine ``.py`` trees for the apply tool, and
private overlay-applied trees for subprocess tests.

``copy_py_tree(src, dst)`` hard-links the ``.py`` files (and overlay state) of ``src/vllm``,
``tree_digest`` fingerprints a tree (the apply tool's tests compare before and after).
``pristine_vllm_tree(dst)`` lays out ``dst/vllm`` from the installed package (shared
libraries symlinked, the rest copied) without any overlay, and ``apply_overlay(dst)`` /
``revert_overlay(dst)`` run scripts/apply_overlay.sh on it. A subprocess with
``PYTHONPATH=dst`` then imports that vLLM instead of the venv's; the venv's own files are
never touched.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO, VENV_PY

APPLY = REPO / "scripts/apply_overlay.sh"
MARKER = "vllm/.dspark_overlay.json"


def tree_digest(root: Path) -> dict[str, str]:
    """Path -> sha256 (or link target, or mode for dirs) for every entry under root."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = "link:" + os.readlink(path)
        elif path.is_file():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out[rel] = f"dir:{path.stat().st_mode & 0o777:o}"
    return out


def installed_vllm_root() -> Path:
    """The site-packages folder holding the venv's ``vllm`` (asked of the venv's Python)."""
    out = subprocess.run(
        [
            str(VENV_PY),
            "-c",
            "import importlib.util as u, os; "
            "print(os.path.dirname(os.path.dirname(u.find_spec('vllm').origin)))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


def copy_py_tree(src: Path, dst: Path) -> None:
    """Copy vllm/*.py plus overlay state, hard-linked (the apply tool never writes in place)."""

    def ignore(folder: str, names: list[str]) -> set[str]:
        keep = set()
        for name in names:
            full = Path(folder) / name
            if (
                full.is_dir()
                and name != "__pycache__"
                or name.endswith(".py")
                or name == ".dspark_overlay.json"
            ):
                keep.add(name)
        return set(names) - keep

    shutil.copytree(src / "vllm", dst / "vllm", ignore=ignore, copy_function=os.link)


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
    """Environment for a vLLM subprocess that imports the vLLM under ``tree`` (or, for the
    kernel oracle, the stock Triton under it); start it with ``cwd=REPO`` and ``-m``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TRITON_INTERPRET", "PYTHONPATH") and not k.startswith("PYTEST_")
    }
    if tree is not None:  # which vLLM (or Triton) the child imports: a folder, not code
        env["PYTHONPATH"] = str(tree)
    env.update(
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_USE_V2_MODEL_RUNNER="0",
        TOKENIZERS_PARALLELISM="false",
    )
    return env
