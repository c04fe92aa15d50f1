"""How every benchmark here writes its record: JSON, a PNG drawn headless beside it, and the
machine it ran on."""

from __future__ import annotations

import json
import platform
import re
from pathlib import Path
from typing import Any


def subplots(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """matplotlib's ``subplots`` on the headless Agg backend (imported only when plotting)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save_png(fig: Any, path: Path, dpi: int = 110) -> None:
    """Lay a figure out, write it and close it (benchmarks draw several per run, headless)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def write_json_png(path: Path, result: dict[str, Any], plot: Any) -> None:
    """A benchmark's record: ``path`` (JSON) and ``plot(result, png)`` beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png').name}")


def cpu_name() -> str:
    """This machine's CPU model as /proc/cpuinfo names it (timings mean nothing without it)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    found = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    return found.group(1) if found else platform.processor() or platform.machine()
