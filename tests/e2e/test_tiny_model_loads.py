"""The tiny checkpoint loads into vLLM's own DeepSeek-V4 model class: every parameter, nothing
unknown (a subprocess builds the model as the engine's loader does)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import vllm_tree as tree
from tests.support.paths import REPO

_LOAD_CHECK = r"""
import json, sys, tempfile
from pathlib import Path
import vllm.v1.worker.cpu.shm  # noqa: F401  (the CPU worker's torch.cuda.Event stand-ins)
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader.utils import initialize_model
from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

model = Path(sys.argv[1])
cfg = EngineArgs(model=str(model), dtype="bfloat16", enforce_eager=True, max_model_len=512,
                 max_num_batched_tokens=512).create_engine_config()
with set_current_vllm_config(cfg):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{tempfile.mktemp()}")
    initialize_model_parallel(1, 1)
    m = initialize_model(vllm_config=cfg)
    files = [str(model / "model.safetensors")]
    loaded = set(m.load_weights(safetensors_weights_iterator(files, False)))
    params = {n for n, _ in m.named_parameters()}
print(json.dumps({"type": type(m).__name__, "missing": sorted(params - loaded),
                  "unknown": sorted(loaded - params)}))
"""


@pytest.mark.e2e
def test_checkpoint_loads_into_vllms_deepseek_v4_model(dspark):
    """Every parameter of vLLM's CPU DeepseekV4ForCausalLM is loaded from the checkpoint
    (the mtp.* draft stages are skipped by the target model's weight mapper)."""
    res = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _LOAD_CHECK, str(dspark)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=tree.subprocess_env(None),
    )
    assert res.returncode == 0, res.stderr[-4000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report == {"type": "DeepseekV4ForCausalLM", "missing": [], "unknown": []}
