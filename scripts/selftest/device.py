"""What the self-test ran on: a CUDA GPU's name and driver, or the CPU."""

from __future__ import annotations

import platform


def describe() -> dict:
    """``{"kind": "cuda" | "cpu", "name": ..., "driver": ...}`` for the record."""
    import torch

    if torch.cuda.is_available():
        driver = "unknown"
        try:
            import pynvml

            pynvml.nvmlInit()
            driver = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # the record says unknown; nothing else depends on it
            pass
        return {"kind": "cuda", "name": torch.cuda.get_device_name(0), "driver": str(driver)}
    return {"kind": "cpu", "name": "cpu", "driver": platform.processor() or platform.machine()}
