"""Repository rules that keep the layout readable: small files, one import style, tests by tier."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.support.paths import REPO

MAX_LINES = 700
TIERS = ("unit", "integration", "e2e", "deploy", "dev")
TRACKED = [
    REPO / p
    for p in subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
]  # fmt: skip
SOURCES = sorted(
    p for p in TRACKED
    if p.parts[len(REPO.parts)] in ("scripts", "overlay") and p.suffix in (".py", ".sh")
    and p.is_file()
)  # fmt: skip
CODE = sorted(
    p for p in TRACKED
    if p.is_file() and (p.suffix in (".py", ".sh") or p.name in ("Dockerfile", "Makefile"))
)  # fmt: skip
SYS_PATH_EDIT = re.compile(r"sys\.path\.(insert|append|extend)|sys\.path\s*\+?=|sys\.path\[.*\]\s*=")


def rel(path) -> str:
    return str(path.relative_to(REPO))


@pytest.mark.parametrize("path", SOURCES, ids=rel)
def test_source_file_is_small(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{rel(path)} has {n} lines (at most {MAX_LINES})"


def test_no_sys_path_edits_anywhere():
    """Scripts and tests import through packages from the repo root (``python -m``); which
    tree a subprocess imports is chosen by its environment, never by editing sys.path."""
    this = REPO / "tests" / "dev" / "test_layout.py"
    edits = [f"{rel(p)}:{n}" for p in CODE if p != this
             for n, line in enumerate(p.read_text().splitlines(), 1) if SYS_PATH_EDIT.search(line)]
    assert not edits, f"sys.path edited at {edits}"


SCRIPT_MODULES = sorted(
    {p.stem for p in SOURCES if p.parts[len(REPO.parts)] == "scripts" and p.suffix == ".py"}
    - {"__init__", "__main__"}
    | {p.parent.name for p in SOURCES if p.name == "__init__.py" and "scripts" in p.parts}
    - {"scripts"}
)


@pytest.mark.parametrize(
    "path", [p for p in SOURCES if p.suffix == ".py" and p.parts[len(REPO.parts)] == "scripts"],
    ids=rel,
)
def test_scripts_import_through_the_package(path):
    """A script imports its siblings as ``scripts.x`` (or relatively inside a subpackage), never
    by bare name (that only works when run as a file), and nothing from tests/."""
    text = path.read_text()
    bare = re.compile(rf"^\s*(from|import)\s+({'|'.join(SCRIPT_MODULES)})\b", re.M)
    assert not bare.search(text), f"{rel(path)}: bare import {bare.search(text).group(0).strip()!r}"
    assert not re.search(r"^\s*(from|import)\s+(tests\b|conftest)", text, re.M), rel(path)


def test_tests_live_in_their_tier_folders():
    """Test modules sit in a tier folder; support/ holds helpers, e2e/runners/ the programs the
    end-to-end tests start, fixtures/ data only."""
    tests = REPO / "tests"
    stray = [rel(p) for p in TRACKED if p.is_relative_to(tests) and p.name.startswith("test_")
             and p.suffix == ".py" and p.relative_to(tests).parts[0] not in TIERS]
    assert not stray, f"test modules outside {TIERS}: {stray}"
    code_in_fixtures = [rel(p) for p in TRACKED if p.is_relative_to(tests / "fixtures")
                        and p.suffix == ".py"]
    assert not code_in_fixtures, f"code among the fixtures (move it to tests/support): {code_in_fixtures}"
    helpers_at_top = [rel(p) for p in TRACKED if p.parent == tests and p.suffix == ".py"
                      and p.name not in ("__init__.py", "conftest.py")]
    assert not helpers_at_top, f"helpers belong in tests/support: {helpers_at_top}"


def test_unit_tests_do_not_import_vllm():
    """The unit tier runs without vLLM (overlay files it needs come through load_overlay_module)."""
    imports = re.compile(r"^\s*(from|import)\s+vllm\b", re.M)
    bad = [rel(p) for p in TRACKED if p.is_relative_to(REPO / "tests" / "unit")
           and p.suffix == ".py" and imports.search(p.read_text())]
    assert not bad, bad


def test_overlay_has_no_dspark_prefixed_modules():
    """DSpark lives in packages (spec_decode/dspark/, deepseek_v4/common/dspark/), not in files
    named for it."""
    prefixed = [rel(p) for p in TRACKED if p.is_relative_to(REPO / "overlay")
                and p.name.startswith("dspark_") and p.suffix == ".py"]
    assert not prefixed, prefixed
