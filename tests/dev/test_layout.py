"""Repository rules that keep the tooling readable: small files, no import tricks in scripts/."""

from __future__ import annotations

import re

import pytest
from conftest import REPO

MAX_LINES = 700
SOURCES = sorted(
    p for folder in ("scripts", "overlay") for p in (REPO / folder).rglob("*")
    if p.is_file() and p.suffix in (".py", ".sh") and "__pycache__" not in p.parts
)  # fmt: skip


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_source_file_is_small(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(REPO)} has {n} lines (at most {MAX_LINES})"


@pytest.mark.parametrize(
    "path", [p for p in SOURCES if p.suffix == ".py" and p.parts[len(REPO.parts)] == "scripts"],
    ids=lambda p: str(p.relative_to(REPO)),
)
def test_scripts_import_through_the_package_layout(path):
    """No sys.path edits and nothing from tests/: tools run as files import their siblings by
    name, the bench package runs with -m from the repo root."""
    text = path.read_text()
    assert not re.search(r"sys\.path\.(insert|append)|sys\.path\s*\+?=", text), path
    assert not re.search(r"^\s*(from|import)\s+(tests\b|conftest|support\b|dspark_support)",
                         text, re.M), path
