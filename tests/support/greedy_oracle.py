"""The greedy oracle for tests: teacher forcing with the plain target (see scripts/teacher_forcing.py).

One implementation, shared with ``make demo``: this module re-exports the scoring core from
``scripts/`` (which must not import from ``tests/``), so tests and the demo judge
losslessness identically.
"""

from __future__ import annotations

import sys
from pathlib import Path

_SCRIPTS = str(Path(__file__).resolve().parents[2] / "scripts")
if _SCRIPTS not in sys.path:  # runner subprocesses start without the conftest's path
    sys.path.append(_SCRIPTS)

from teacher_forcing import (  # noqa: E402
    EPSILON_NATS,
    OracleReport,
    report,
    teacher_force,
    token_deficits,
)

__all__ = ["EPSILON_NATS", "OracleReport", "report", "teacher_force", "token_deficits"]
