"""The overlay's DSpark code lives in two packages with one-way imports.

``vllm.v1.spec_decode.dspark`` (the V1 proposer) may import the draft model package
``vllm.models.deepseek_v4.common.dspark``; the model package never imports the proposer.
Relative imports stay inside their own package, and the packages' ``__init__`` import
nothing, so their pure-torch modules load without vLLM (unit tests, benchmarks).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

OVERLAY = Path(__file__).resolve().parents[2] / "overlay"
PROPOSER = "vllm.v1.spec_decode.dspark"
MODEL = "vllm.models.deepseek_v4.common.dspark"


def module_name(path: Path) -> str:
    parts = path.relative_to(OVERLAY).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, int]]:
    """(absolute module imported, relative level) for every import in ``path``."""
    package = module_name(path).rpartition(".")[0] if path.name != "__init__.py" else module_name(path)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, 0) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((name, node.level))
    return found


PACKAGE_FILES = sorted(
    p for pkg in (PROPOSER, MODEL) for p in (OVERLAY / pkg.replace(".", "/")).glob("*.py")
)


def test_no_dspark_prefixed_modules_are_left():
    assert sorted(OVERLAY.rglob("dspark_*.py")) == []
    assert len(PACKAGE_FILES) >= 10


@pytest.mark.parametrize("path", PACKAGE_FILES, ids=lambda p: str(p.relative_to(OVERLAY)))
def test_imports_go_one_way_and_stay_in_their_package(path):
    own = PROPOSER if module_name(path).startswith(PROPOSER) else MODEL
    for name, level in imports(path):
        if own == MODEL:
            assert not name.startswith(PROPOSER), f"{path.name}: the model imports {name}"
        if level:
            assert name.startswith(own), f"{path.name}: relative import {name} leaves {own}"


@pytest.mark.parametrize("package", [PROPOSER, MODEL])
def test_package_init_imports_nothing(package):
    init = OVERLAY / package.replace(".", "/") / "__init__.py"
    assert imports(init) == []


def test_the_model_package_is_imported_by_the_proposer():
    """The direction check above would pass vacuously if the proposer stopped using it."""
    proposer = OVERLAY / PROPOSER.replace(".", "/") / "proposer.py"
    assert any(name.startswith(MODEL) for name, _ in imports(proposer))
