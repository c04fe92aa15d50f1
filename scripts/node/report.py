"""Check results as preflight prints them: one PASS/WARN/FAIL line each, every FAIL with fixes."""

from __future__ import annotations

import sys
from typing import TextIO


class Report:
    def __init__(self, out: TextIO | None = None):
        self.out = sys.stdout if out is None else out  # the stream at use, not at import
        self.fails = self.warns = 0

    def passed(self, check: str, text: str) -> None:
        print(f"PASS  {check:<8} {text}", file=self.out)

    def warn(self, check: str, text: str) -> None:
        print(f"WARN  {check:<8} {text}", file=self.out)
        self.warns += 1

    def fail(self, check: str, problem: str, *fixes: str) -> None:
        print(f"FAIL  {check:<8} {problem}", file=self.out)
        for fix in fixes:
            print(f"      {'':<8} fix: {fix}", file=self.out)
        self.fails += 1

    @property
    def exit_code(self) -> int:
        return 1 if self.fails else 0
