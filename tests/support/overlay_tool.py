"""The overlay tool as the crash tests run it: on a synthetic overlay tree, killed at a boundary.

    python -m tests.support.overlay_tool OVERLAY_DIR KILL_AT TOOL_ARGS...    (repo root)

``OVERLAY_DIR`` replaces the repository's overlay tree (``-`` keeps it). ``KILL_AT`` is a
step boundary's number (counted from 1 in this process) or its label, where the process
SIGKILLs itself as a power cut would stop it; ``-`` never kills. Everything else is
``scripts/apply_overlay.py`` unchanged.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
from pathlib import Path

from scripts import apply_overlay


def killing_step_done(kill_at: str):
    boundaries = itertools.count(1)

    def step_done(label: str) -> None:
        number = next(boundaries)
        if kill_at in (str(number), label):
            print(
                f"apply_overlay: fault injection: SIGKILL at step boundary {number} ({label})",
                file=sys.stderr,
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGKILL)

    return step_done


def main() -> int:
    overlay, kill_at, *args = sys.argv[1:]
    if overlay != "-":
        apply_overlay.OVERLAY = Path(overlay)
    if kill_at != "-":
        apply_overlay.step_done = killing_step_done(kill_at)
    return apply_overlay.main(args)


if __name__ == "__main__":
    sys.exit(main())
