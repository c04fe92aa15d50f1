"""Where things are in this checkout, for tests and their helpers."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
FIXTURES = REPO / "tests" / "fixtures"
CACHE = REPO / ".cache"
VENV_PY = REPO / ".venv" / "bin" / "python"
