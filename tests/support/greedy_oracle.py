"""The greedy oracle for tests: teacher forcing with the plain target.

One implementation, shared with ``make demo``: this module re-exports the scoring core from
``scripts/verify/teacher_forcing.py`` (scripts must not import from ``tests/``), so tests and the demo judge
losslessness identically.
"""

from __future__ import annotations

from scripts.verify.teacher_forcing import (
    EPSILON_NATS,
    OracleReport,
    report,
    teacher_force,
    token_deficits,
)

__all__ = ["EPSILON_NATS", "OracleReport", "report", "teacher_force", "token_deficits"]
