"""Import an overlay file from this checkout without importing vLLM (micro-benchmarks, tests).

The pure-torch cores (ragged store, packed prefill, the CPU kernels) need only torch; importing
them through the installed `vllm` package would load the whole DeepSeek-V4 model code first,
and would test the venv's applied copy rather than this checkout. The overlay tree is mounted
as a stand-in package `_overlay` whose subpackages mirror its folders without running their
`__init__.py` (no kernel registration), so relative imports between overlay files work and
every module has a name derived from its path alone (spawned workers find the same module).
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from types import ModuleType

OVERLAY = Path(__file__).resolve().parents[2] / "overlay"
ROOT_PACKAGE = "_overlay"


def load_overlay_module(rel_path: str) -> ModuleType:
    """overlay/<rel_path>, e.g. "vllm/v1/spec_decode/dspark/context_store.py", loaded once per process."""
    path = OVERLAY / rel_path
    if path.suffix != ".py" or not path.is_file():
        raise FileNotFoundError(f"rel_path: no overlay source file {path}")
    parts = path.relative_to(OVERLAY).with_suffix("").parts
    for depth in range(len(parts)):  # the root and every folder: stand-ins, __init__ not run
        name = ".".join((ROOT_PACKAGE, *parts[:depth]))
        if name not in sys.modules:
            stand_in = types.ModuleType(name)
            stand_in.__path__ = [str(OVERLAY.joinpath(*parts[:depth]))]
            sys.modules[name] = stand_in
    return importlib.import_module(".".join((ROOT_PACKAGE, *parts)))
