"""The tiny checkpoints, and a DSpark draft and proposer built from them without an engine."""

from __future__ import annotations

import os
from pathlib import Path

from scripts.tiny import ensure as tiny
from tests.support.net import free_port
from tests.support.paths import REPO

TINY_MODEL = tiny.TINY_MODEL


def ensure_tiny_model(path: Path = TINY_MODEL, compress_ratios: str | None = None) -> Path:
    """A tiny DeepSeek-V4-DSpark checkpoint, generated on first use.

    The default checkpoint (the demo's) also gets its trained draft, once per machine.
    """
    return tiny.ensure_tiny_model(path, train=path == TINY_MODEL, compress_ratios=compress_ratios)


def generate_tiny_model(out: Path, *args: str) -> Path:
    """A tiny checkpoint generated in this process (``make_tiny_model`` OPTIONS) at ``out``."""
    from scripts.tiny import make_tiny_model

    assert make_tiny_model.main(["--out", str(out), "--quiet", *args]) == 0
    return out


def run_engine_script(module: str, out: Path, *args: str, timeout: float) -> dict:
    """Run an in-process vLLM program (``python -m module --out OUT ARGS``, from the repo
    root) on CPU; its JSON report.

    A failure fails the calling test with the script's stderr tail.
    """
    import json
    import subprocess
    import sys

    import pytest

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-m", module, "--out", str(out), *args], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{module} failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


REAL_FORMAT_MODEL = REPO / "models" / "tiny-dsv4-dspark-real"
REAL_FORMAT_TWIN = REPO / "models" / "tiny-dsv4-dspark-real-twin"


def ensure_real_format_models() -> tuple[Path, Path]:
    """The tiny checkpoint in the published FP8/MXFP4 format and its exact bf16 twin."""
    if not all((m / "config.json").exists() for m in (REAL_FORMAT_MODEL, REAL_FORMAT_TWIN)):
        tiny.run_tool("make_tiny_model", "--dspark", "--format", "real", "--quiet", "--force",
                      "--out", str(REAL_FORMAT_MODEL), "--bf16-twin", str(REAL_FORMAT_TWIN))
    return REAL_FORMAT_MODEL, REAL_FORMAT_TWIN


_DIST = {"ready": False}


def vllm_single_process(model_dir: Path):
    """A VllmConfig for ``model_dir`` plus a 1-rank gloo model-parallel group."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    mc = ModelConfig(
        model=str(model_dir), dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True
    )
    vc = VllmConfig(model_config=mc)
    if not _DIST["ready"]:
        with set_current_vllm_config(vc):
            init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
                backend="gloo",
            )
            initialize_model_parallel(1, 1)
        _DIST["ready"] = True
    return vc


def build_draft(model_dir: Path):
    """The DSpark draft of ``model_dir`` with checkpoint weights and the target's heads."""
    import torch
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.models.deepseek_v4.cpu.dspark import DSparkDeepseekV4ForCausalLM
    from vllm.utils.torch_utils import set_default_torch_dtype

    vc = vllm_single_process(model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    with set_current_vllm_config(vc), set_default_torch_dtype(torch.bfloat16):
        draft = DSparkDeepseekV4ForCausalLM(vllm_config=vc)
        shape = draft.shape
        embed = VocabParallelEmbedding(shape.vocab_size, shape.hidden_size)
        head = ParallelLMHead(shape.vocab_size, shape.hidden_size)
    loaded = draft.load_weights(tensors.items())
    missing = {n for n, _ in draft.named_parameters()} - loaded
    assert not missing, f"draft weights not loaded: {sorted(missing)}"
    embed.weight.data.copy_(tensors["embed.weight"])
    head.weight.data.copy_(tensors["head.weight"])
    with set_current_vllm_config(vc):
        for module in (draft, embed, head):
            process_weights_after_loading(module, vc.model_config, torch.device("cpu"))
    draft.share_target_heads(embed, head)
    draft.eval()
    return draft, vc


def make_proposer(
    draft, vc, *, num_spec=None, probabilistic=False, max_num_seqs=8, adaptive=False
):
    """A DSparkProposer around an already built draft, without an engine.

    The proposer reads a few speculative settings; the engine-less VllmConfig has no
    speculative config, so a minimal one stands in for it.
    """
    from types import SimpleNamespace

    from vllm.v1.spec_decode.dspark.proposer import DSparkProposer

    hf = vc.model_config.hf_config
    vc.speculative_config = SimpleNamespace(
        use_dspark=lambda: True,
        num_speculative_tokens=num_spec or hf.dspark_block_size,
        draft_sample_method="probabilistic" if probabilistic else "greedy",
        enable_adaptive_verification=adaptive,
        draft_model_config=None,
    )
    vc.scheduler_config.max_num_seqs = max_num_seqs
    try:
        proposer = DSparkProposer(vc, "cpu")
    finally:
        vc.speculative_config = None
    proposer.attach_model(draft)
    return proposer
