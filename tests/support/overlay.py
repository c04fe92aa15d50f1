"""Overlay source files imported from this checkout, not the venv's applied copy.

The loader is `scripts/dev/overlay_source.py` (the micro-benchmarks use it too).
"""

from scripts.dev.overlay_source import OVERLAY, load_overlay_module

__all__ = ["OVERLAY", "load_overlay_module"]
