"""What a result records about where it came from: recipe profile, pins, client machine."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from .. import recipe
from .server import BenchError


def _load_yaml(path: Path) -> dict[str, Any] | None:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        print(f"[bench] warning: cannot read {path}: {exc}", file=sys.stderr)
        return None
    return data if isinstance(data, dict) else None


def pins(path: Path | None) -> dict[str, Any] | None:
    return _load_yaml(path) if path else None


def check_profile_name(name: str) -> None:
    if name not in recipe.list_profiles():
        raise BenchError(f"unknown recipe profile {name!r}; known: {recipe.list_profiles()}")


def resolve_profile(name: str | None, served_model: str) -> tuple[str, str, dict | None]:
    """(profile name, how it was chosen, profile YAML content)."""
    if name:
        check_profile_name(name)
        return name, "cli", _load_yaml(recipe.profile_path(name))
    matches = []
    for stem in recipe.list_profiles():
        data = _load_yaml(recipe.profile_path(stem)) or {}
        if (data.get("model") or {}).get("served_name") == served_model:
            matches.append((stem, data))
    if len(matches) == 1:
        return matches[0][0], "served model name", matches[0][1]
    return "unspecified", "none", None


def profile_base_url(name: str) -> str:
    """http://127.0.0.1:PORT with the profile's serving port."""
    return f"http://127.0.0.1:{recipe.profile_env(recipe.load_profile(name))['API_PORT']}"


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(recipe.REPO), *args],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout.strip()


def client_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "aiohttp": aiohttp.__version__,
        "git_commit": None,
        "git_dirty": None,
    }
    try:
        info["git_commit"] = _git("rev-parse", "HEAD")
        info["git_dirty"] = bool(_git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        pass
    return info
