"""Load the overlay's pure-torch modules from ``overlay/`` without importing vLLM.

The DSpark step cores (ring store, packed prefill, step plan, Markov sampling) import
each other by their vLLM names. Registering each file under that name in ``sys.modules``
lets benchmarks and ``gpu_check.py`` run them on a machine with torch alone (a GPU box
without vLLM) and always on this checkout's code, not on an installed copy.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

OVERLAY = Path(__file__).resolve().parents[1] / "overlay"

# In dependency order: each module imports only the ones above it.
PURE_TORCH = (
    "vllm.v1.spec_decode.dspark_ragged",
    "vllm.models.deepseek_v4.common.packed_prefill",
    "vllm.v1.spec_decode.dspark_step",
    "vllm.models.deepseek_v4.common.dspark_markov",
)


def load(name: str) -> ModuleType:
    """The overlay module ``name`` (one of ``PURE_TORCH``), loaded by path once."""
    if name not in PURE_TORCH:
        raise ValueError(f"{name} is not one of the overlay's pure-torch modules {PURE_TORCH}")
    for dep in PURE_TORCH[: PURE_TORCH.index(name) + 1]:
        module = sys.modules.get(dep)
        if module is None or not getattr(module, "__file__", "").startswith(str(OVERLAY)):
            path = OVERLAY / (dep.replace(".", "/") + ".py")
            spec = importlib.util.spec_from_file_location(dep, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[dep] = module
            spec.loader.exec_module(module)
    return sys.modules[name]
