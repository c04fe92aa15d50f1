"""Torch stand-ins for the DeepSeek-V4 metadata Triton kernels (overlay, CPU without Triton).

* unit tests of the pure-torch implementations on small hand-checked inputs (no vLLM);
* oracle: every kernel, launched through vLLM's own launchers on randomized batches (empty,
  single-token, window/compression boundaries, replay, padding, images, DCP), gives exactly
  the outputs of the Triton kernel run by Triton's interpreter (TRITON_INTERPRET=1). Triton
  is only the oracle: it lives in .cache/triton-oracle, never in the product venv;
* wiring: with the overlay applied, vLLM's CpuPlatform registers the overrides and the same
  launches give the oracle-checked outputs; with the overlay reverted they fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support import dsv4_kernel_cases as cases
from tests.support import vllm_tree as tree
from tests.support.paths import REPO

ORACLE_DIR = Path(os.environ.get("TRITON_ORACLE_DIR", REPO / ".cache/triton-oracle"))
ORACLE_INSTALL = (
    ".venv/bin/python -m pip install --no-deps --target .cache/triton-oracle triton==3.9.0"
)

impl = cases.load_impl()


def i32(*v):
    return torch.tensor(v, dtype=torch.int32)


# ------------------------------------------------------------------ pure torch, hand-checked


def test_grid_forms():
    assert impl._grid_programs((5,)) == 5
    assert impl._grid_programs((5, 1, 1)) == 5
    assert impl._grid_programs(0) == 0
    with pytest.raises(ValueError, match="1-D launch grid"):
        impl._grid_programs((2, 2))
    with pytest.raises(TypeError, match="meta-parameter"):
        impl._grid_programs(lambda meta: (1,))


def test_bind_launch_drops_launch_options_and_checks_arguments():
    names = ("a", "b", "C")
    assert impl._bind_launch(names, (1,), {"b": 2, "C": 3, "num_warps": 4}) == {
        "a": 1,
        "b": 2,
        "C": 3,
    }
    with pytest.raises(TypeError, match="missing"):
        impl._bind_launch(names, (1,), {})
    with pytest.raises(TypeError, match="twice"):
        impl._bind_launch(names, (1, 2, 3), {"a": 1})


def test_flat_reads_past_a_view_like_a_pointer():
    buf = torch.arange(12, dtype=torch.int32).view(3, 4)
    view = buf[1:, :2]  # a kernel given view's pointer sees the rest of the storage
    assert impl._flat(view)[:6].tolist() == [4, 5, 6, 7, 8, 9]


def test_token_request_mapping():
    out = torch.full((8,), 9, dtype=torch.int32)
    # requests of 3, 0 (padding request), 2 tokens; 2 padded tokens map to 0.
    impl.token_request_mapping_impl((1,), i32(0, 3, 3, 5), out, 3, 5, 7)
    assert out.tolist() == [0, 0, 0, 2, 2, 0, 0, 9]


def swa_rows(idx, lens, valid, block_table, block_size):
    """The SWA kernels' shared output and paging arguments: one request, every token in it."""
    return dict(
        swa_indices_ptr=idx,
        swa_indices_stride=idx.shape[1],
        swa_lens_ptr=lens,
        index_width=idx.shape[1],
        token_to_req_indices_ptr=torch.zeros(len(valid), dtype=torch.int32),
        is_valid_token_ptr=valid,
        block_table_ptr=block_table,
        block_table_stride=block_table.shape[1],
        block_size=block_size,
        token_offset=0,
        TRITON_BLOCK_SIZE=1024,
    )


def test_swa_indices_window_replay_and_invalid_rows():
    bs = 4
    bt = i32(5, 1, 7, 2)[None]  # one request, blocks 5,1,7,2
    qsl, seq = i32(0, 3), i32(10)  # tokens at positions 7, 8, 9
    idx = torch.full((4, 6), 0, dtype=torch.int32)
    lens = torch.full((4,), 9, dtype=torch.int32)
    valid = torch.tensor([True, False, True])
    impl.compute_swa_indices_and_lens_impl(
        (3,),
        **swa_rows(idx, lens, valid, bt, block_size=bs),
        window_size=4,
        left_visible_ptr=lens,
        right_visible_ptr=lens,
        query_start_loc_ptr=qsl,
        seq_lens_ptr=seq,
        replay_start_ptr=i32(5),
        HAS_IMAGE=False,
    )
    slot = lambda p: int(bt[0, p // bs]) * bs + p % bs  # noqa: E731
    # token 0 (pos 7): window 4 -> positions 4..7; replay_start 5 clips to 5..7
    assert lens.tolist() == [3, 0, 4, 9]
    assert idx[0].tolist() == [slot(5), slot(6), slot(7), -1, -1, -1]
    assert idx[1].tolist() == [-1] * 6
    assert idx[2].tolist() == [slot(6), slot(7), slot(8), slot(9), -1, -1]
    assert idx[3].tolist() == [0] * 6  # past the grid: untouched


def test_dspark_noncausal_window_covers_the_whole_block():
    bt = i32(3, 0)[None]
    idx = torch.zeros((2, 8), dtype=torch.int32)
    lens = torch.zeros(2, dtype=torch.int32)
    # block of 2 tokens after a prefix of 5; window 3 -> positions 2..6 for both tokens
    valid = torch.tensor([True, True])
    impl.compute_dspark_noncausal_swa_indices_impl(
        (2,),
        **swa_rows(idx, lens, valid, bt, block_size=4),
        window_size=3,
        query_start_loc_ptr=i32(0, 2),
        seq_lens_ptr=i32(7),
    )
    expect = [14, 15, 0, 1, 2, -1, -1, -1]  # block 3 -> slots 12..15, block 0 -> 0..3
    assert lens.tolist() == [5, 5]
    assert idx.tolist() == [expect, expect]


def test_prefill_metadata_gather_lengths():
    out = torch.zeros(3, dtype=torch.int32)
    # one decode, then prefills (prefix 200, query 10, replay 150) and (prefix 0, query 4)
    impl.compute_prefill_metadata_impl(
        (1,), out, i32(9, 210, 4), i32(0, 1, 11, 15), i32(0, 150, 0), 2, 1, 128, 2
    )
    assert out.tolist() == [10 + 50, 4 + 0, 0]


def test_compressed_slot_mapping_last_token_of_each_group():
    out = torch.full((6,), 99, dtype=torch.int64)
    slot = torch.tensor([10, 11, -1, 13, 14, 15])
    # one request, prefix 1: positions 1..6; ratio 2, 2 states per block, blocks [8, 9]
    impl.compressed_slot_mapping_impl(
        (1,), out, slot, i32(0, 6), i32(7), i32(8, 9), 2, 2, 1, 1, 2, -1, 1024
    )
    # positions 1..6 with ratio 2: pos 1 -> state 0, pos 3 -> state 1 (slot -1: PAD),
    # pos 5 -> state 2 (block 9, offset 0)
    assert out.tolist() == [8 * 2 + 0, -1, -1, -1, 9 * 2 + 0, -1]


def test_prepare_uniform_decode():
    seq = i32(10, 0)  # second request is padding
    bt = torch.arange(8, dtype=torch.int32).view(2, 4)
    dsl = torch.full((5,), 7, dtype=torch.int32)
    exp = torch.full((4, 3), 7, dtype=torch.int32)
    dl = torch.full((5,), 7, dtype=torch.int32)
    impl.prepare_uniform_decode_impl((4,), seq, dsl, bt, 4, exp, 3, dl, 2, 1024)
    assert dsl.tolist() == [9, 10, 0, 0, 7]
    assert exp.tolist() == [[0, 1, 2], [0, 1, 2], [4, 5, 6], [4, 5, 6]]
    assert dl.tolist() == [1, 1, 1, 1, 7]


def test_build_prefill_chunk_metadata():
    t2s = torch.full((4,), -1, dtype=torch.int32)
    ks = torch.full((5,), -1, dtype=torch.int32)
    ke = torch.full((5,), -1, dtype=torch.int32)
    # two requests: (prefix 6, query 3) -> 2 compressed rows; (prefix 0, query 2) -> 0 rows
    # ... plus 2 rows of a third request of (prefix 8, query 0)
    qsl, useq, cu = i32(0, 3, 5, 5), i32(9, 2, 8), i32(0, 2, 2, 4)
    impl.build_prefill_chunk_metadata_impl(
        (3,), qsl, useq, cu, cu, t2s, ks, ke, 1, 5, 0, 1, 1, 1024, 4
    )
    # tokens 1..4 (slice [1, 5)): request 0 positions 7, 8 and request 1 positions 0, 1
    assert ks.tolist() == [0, 0, 2, 2, -1]
    assert ke.tolist() == [0 + 8 // 4, 0 + 9 // 4, 2 + 1 // 4, 2 + 2 // 4, -1]
    assert t2s.tolist() == [0, 0, 2, 2]


def test_every_registered_kernel_has_an_impl_with_the_grid_first():
    import inspect

    assert len(impl.KERNEL_IMPLS) == 7
    for name, fn in impl.KERNEL_IMPLS.items():
        assert next(iter(inspect.signature(fn).parameters)) == "grid", name


# ------------------------------------------------------------------------ Triton oracle


@pytest.fixture(scope="module")
def oracle_report(tmp_path_factory):
    if not (ORACLE_DIR / "triton" / "__init__.py").is_file():
        pytest.skip(f"Triton oracle not installed in {ORACLE_DIR}; run: {ORACLE_INSTALL}")
    # the oracle's stock Triton is the folder on the child's path (never the product venv)
    report = _run_cases("oracle", ORACLE_DIR, tmp_path_factory.mktemp("oracle") / "report.json")
    print(f"\noracle timings: {report['seconds']}")
    return report


@pytest.mark.parametrize("batch", [b.name for b in cases.batches()])
def test_torch_kernels_equal_triton_interpreter(oracle_report, batch):
    results = oracle_report["cases"][batch]
    assert results, "no outputs compared"
    bad = {k: v for k, v in results.items() if v != "ok"}
    assert not bad, bad


def test_oracle_covers_every_kernel(oracle_report):
    compared = {key.split("/")[0] for res in oracle_report["cases"].values() for key in res}
    assert compared == set(cases.KERNELS)
    assert set(oracle_report["overridden"]) == set(impl.KERNEL_IMPLS)
    assert set(oracle_report["overridden"].values()) == {"GridKernelOverride"}


# ------------------------------------------------------------------ overlay wiring in vLLM


def _run_overlay_mode(target: Path, out: Path) -> dict:
    return _run_cases("overlay", target, out)


def _run_cases(mode: str, path: Path | None, out: Path) -> dict:
    """The kernel cases in ``mode`` in a child importing from ``path`` first; its report."""
    res = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", cases.__name__, mode, "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=tree.subprocess_env(path),
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def overlay_tree(tmp_path_factory):
    target = tmp_path_factory.mktemp("vllm-overlay")
    tree.pristine_vllm_tree(target)
    tree.apply_overlay(target)
    return target


def test_cpu_platform_registers_the_overrides(overlay_tree, tmp_path, request):
    report = _run_overlay_mode(overlay_tree, tmp_path / "overlay.json")
    assert report["has_triton"] is False
    assert report["impl_module"] == str(
        overlay_tree / "vllm/v1/attention/ops/torch_metadata_kernels.py"
    )
    assert set(report["overridden"]) == set(impl.KERNEL_IMPLS)
    assert set(report["overridden"].values()) == {"GridKernelOverride"}
    assert "error" not in report, report.get("error")
    if (ORACLE_DIR / "triton" / "__init__.py").is_file():
        oracle = request.getfixturevalue("oracle_report")
        assert report["digests"] == oracle["digests"]


def test_reverted_overlay_leaves_the_kernels_unlaunchable(overlay_tree, tmp_path):
    tree.revert_overlay(overlay_tree)
    try:
        report = _run_overlay_mode(overlay_tree, tmp_path / "reverted.json")
    finally:
        tree.apply_overlay(overlay_tree)
    assert report["impl_module"] is None
    assert "not subscriptable" in report.get("error", ""), report.get("error")
