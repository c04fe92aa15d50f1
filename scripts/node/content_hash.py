"""The content hash of what an image is built from: ``overlay/``, ``recipe/`` and ``docker/``.

``make image`` stamps it on the image (label ``dspark.content.sha256``); preflight hashes the
checkout again and refuses an image built from other files (after ``git pull``, a profile
edit, an overlay change). The hash covers every regular file's path and bytes, sorted, so
it does not depend on the commit, timestamps or file modes, and it sees uncommitted edits.
Python caches and the node's own ``docker/.env`` are not inputs of the image and are left out.

    python -m scripts.node.content_hash [--root DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INPUTS = ("overlay", "recipe", "docker")
LABEL = "dspark.content.sha256"
_IGNORED_DIRS = {"__pycache__"}
_IGNORED_FILES = {"docker/.env"}


def content_files(root: Path) -> list[Path]:
    """The hashed files under ``root``, as paths relative to it, sorted."""
    files = []
    for top in INPUTS:
        base = root / top
        if not base.is_dir():
            continue
        for path in base.rglob("*"):
            rel = path.relative_to(root)
            if not path.is_file():
                continue
            if _IGNORED_DIRS & set(rel.parts) or rel.suffix == ".pyc":
                continue
            if rel.as_posix() in _IGNORED_FILES:
                continue
            files.append(rel)
    return sorted(files, key=lambda p: p.as_posix())


def content_hash(root: Path = REPO) -> str:
    """sha256 over (path, size, bytes) of every file of ``content_files(root)``."""
    digest = hashlib.sha256()
    for rel in content_files(root):
        data = (root / rel).read_bytes()
        digest.update(f"{rel.as_posix()}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=REPO, help="checkout root (default: this one)")
    args = ap.parse_args(argv)
    missing = [top for top in INPUTS if not (args.root / top).is_dir()]
    if missing:
        print(f"content_hash: {args.root} has no {', '.join(missing)}/", file=sys.stderr)
        return 2
    print(content_hash(args.root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
