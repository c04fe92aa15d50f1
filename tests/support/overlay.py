"""Import an overlay source file from this checkout, not the venv's applied copy.

The overlay mirrors vLLM's tree, so `import vllm....` would give the installed package (with
whatever overlay `make setup` applied last). Tests of the pure-torch cores load the working
tree's file instead, as a module of a stand-in package for its folder: relative imports
between overlay files work and the folder's `__init__.py` (kernel registration) never runs.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
OVERLAY = REPO / "overlay"


def load_overlay_module(rel_path: str) -> ModuleType:
    """overlay/<rel_path> (e.g. "vllm/v1/spec_decode/dspark_ragged.py"), loaded once per process.

    The module is registered in sys.modules before it runs, under a name derived from the
    path alone, so dataclasses, pickling and spawned workers find the same module.
    """
    path = OVERLAY / rel_path
    if path.suffix != ".py" or not path.is_file():
        raise FileNotFoundError(f"rel_path: no overlay source file {path}")
    folder = path.parent.relative_to(OVERLAY)
    package = "_overlay_" + "_".join(folder.parts)
    if package not in sys.modules:
        stand_in = types.ModuleType(package)
        stand_in.__path__ = [str(path.parent)]
        sys.modules[package] = stand_in
    return importlib.import_module(f"{package}.{path.stem}")
