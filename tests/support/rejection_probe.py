"""Probe of vLLM's CPU rejection sampling, run as a subprocess by test_cpu_rejection_sampling.

    python -m tests.support.rejection_probe   # prints one JSON object (repo root)

A fresh process matters twice: numba is imported first (as in any process that already ran
an ngram engine), so the CPU platform's kernel-override registration must survive llvmlite
being loaded; and the overrides rebind vLLM's kernels process-wide, which the pytest process
must not see. After registering them the way a worker does, the probe calls vLLM's own
sampling functions on hand-made batches and reports raw results; the test holds the oracles.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

VOCAB = 8
REQUESTS = 8000  # half greedy, half sampled: one draft token each
TEMPERATURE = 0.7
BONUS_MARK = 1000  # bonus token id outside the vocabulary: shows when a row took its bonus


def expansion(rs) -> dict:
    """Per-request values expanded to per-token ones, as apply_sampling_constraints does."""
    cu = torch.tensor([2, 5, 5, 6, 10], dtype=torch.int32)
    values = {
        "temperature": torch.tensor([0.0, 0.8, 0.5, 0.0, 1.3]),
        "top_k": torch.tensor([1024, 50, 7, 1024, 3], dtype=torch.int32),
        "top_p": torch.tensor([1.0, 0.9, 0.5, 1.0, 0.95]),
        "int64": torch.tensor([4, 0, 9, 0, 2]),
    }
    out = {"cu_num_tokens": cu.tolist()}
    for name, x in values.items():
        # vLLM maps greedy temperature to 1 and expands top-k/top-p without replacement.
        replace = {"replace_from": 0, "replace_to": 1} if name in ("temperature", "int64") else {}
        expanded = rs.expand_batch_to_tokens(x, cu, 10, **replace)
        out[name] = {"input": x.tolist(), "output": expanded.tolist(), "dtype": str(expanded.dtype)}
    return out


def mixed_batch(rs, with_draft_probs: bool) -> dict:
    """One verify step of REQUESTS rows, greedy and sampled interleaved, on a tiny vocabulary."""
    gen = torch.Generator().manual_seed(19)
    logits = torch.randn(VOCAB, generator=gen) * 0.5  # every token likely enough to count
    draft_dist = torch.softmax(torch.randn(VOCAB, generator=gen), dim=-1)
    drafts = torch.multinomial(draft_dist, REQUESTS, replacement=True, generator=gen)
    greedy = torch.arange(REQUESTS) % 2 == 0
    meta = SimpleNamespace(
        temperature=torch.where(greedy, 0.0, TEMPERATURE),
        all_greedy=False,
        all_random=False,
        top_k=None,
        top_p=None,
        generators={},
    )
    cu = torch.arange(1, REQUESTS + 1, dtype=torch.int32)
    target = rs.apply_sampling_constraints(logits.expand(REQUESTS, VOCAB).clone(), cu, meta)
    torch.manual_seed(0)
    tokens = rs.rejection_sample(
        drafts.to(torch.int32),
        [1] * REQUESTS,
        1,
        cu,
        draft_dist.expand(REQUESTS, VOCAB).contiguous() if with_draft_probs else None,
        target,
        torch.full((REQUESTS, 1), BONUS_MARK, dtype=torch.int64),
        meta,
    )
    return {
        "logits": logits.tolist(),
        "draft_dist": draft_dist.tolist(),
        "drafts": drafts.tolist(),
        "greedy": greedy.tolist(),
        "first": tokens[:, 0].tolist(),
        "second": tokens[:, 1].tolist(),
    }


def no_draft_step(rs) -> list[int]:
    """A speculative step in which no request drafted, one sampled request using top-k only."""
    meta = SimpleNamespace(
        temperature=torch.tensor([0.0, 0.8]),
        all_greedy=False,
        all_random=False,
        top_k=torch.tensor([VOCAB, 3], dtype=torch.int32),
        top_p=None,
        generators={},
    )
    cu = torch.zeros(2, dtype=torch.int32)
    return list(rs.apply_sampling_constraints(torch.empty(0, VOCAB), cu, meta).shape)


def main() -> None:
    import numba  # noqa: F401  (loads llvmlite before the kernel overrides are registered)
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()
    from vllm.v1.sample import rejection_sampler as rs

    print(
        json.dumps(
            {
                "expansion": expansion(rs),
                "with_draft_probs": mixed_batch(rs, with_draft_probs=True),
                "without_draft_probs": mixed_batch(rs, with_draft_probs=False),
                "no_draft_step_shape": no_draft_step(rs),
                "placeholder": rs.PLACEHOLDER_TOKEN_ID,
                "temperature": TEMPERATURE,
                "bonus_mark": BONUS_MARK,
            }
        )
    )


if __name__ == "__main__":
    main()
