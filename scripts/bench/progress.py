"""A one-line progress bar on stderr for the sweep's levels (off when stderr is not a terminal)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.label = ""
        self.total = self.done = self.failed = 0
        self.t0 = time.perf_counter()

    def start(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.failed = label, total, 0, 0
        self.t0 = time.perf_counter()
        self._draw()

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        self._draw()

    def finish(self, summary: str) -> None:
        if self.enabled:
            sys.stderr.write(f"\r\033[K{self.label} {summary}\n")
            sys.stderr.flush()

    def _draw(self) -> None:
        if not self.enabled:
            return
        width = 24
        filled = int(width * self.done / self.total) if self.total else width
        bar = "#" * filled + "." * (width - filled)
        sys.stderr.write(
            f"\r\033[K{self.label} [{bar}] {self.done}/{self.total}"
            f" err={self.failed} {time.perf_counter() - self.t0:.1f}s"
        )
        sys.stderr.flush()
