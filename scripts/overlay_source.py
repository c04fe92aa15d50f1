"""Import an overlay file from this checkout for the micro-benchmarks, without importing vLLM.

The pure-torch cores (ragged store, packed prefill) need only torch; importing them through the
installed `vllm` package would load the whole DeepSeek-V4 model code first. The file is loaded
as a module of a stand-in package for its folder (relative imports work, the folder's
`__init__.py` never runs), registered under a name derived from the path, so spawned
torch.distributed workers find the same module. (The tests have their own copy of this rule in
tests/support/overlay.py: scripts never import from tests/.)
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from types import ModuleType

OVERLAY = Path(__file__).resolve().parents[1] / "overlay"


def load_overlay_module(rel_path: str) -> ModuleType:
    """overlay/<rel_path>, e.g. "vllm/v1/spec_decode/dspark_ragged.py", loaded once per process."""
    path = OVERLAY / rel_path
    if path.suffix != ".py" or not path.is_file():
        raise FileNotFoundError(f"rel_path: no overlay source file {path}")
    package = "_overlay_" + "_".join(path.parent.relative_to(OVERLAY).parts)
    if package not in sys.modules:
        stand_in = types.ModuleType(package)
        stand_in.__path__ = [str(path.parent)]
        sys.modules[package] = stand_in
    return importlib.import_module(f"{package}.{path.stem}")
