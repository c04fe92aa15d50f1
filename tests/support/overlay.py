"""Overlay source files imported from this checkout, not the venv's applied copy.

The loader is `scripts/overlay_source.py` (the micro-benchmarks use it too); pytest puts
scripts/ on the path (pyproject.toml) and `dsv4_overlay_tree.subprocess_env` does the same
for test subprocesses.
"""

from overlay_source import OVERLAY, load_overlay_module

__all__ = ["OVERLAY", "load_overlay_module"]
