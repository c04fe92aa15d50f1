"""Greedy losslessness by teacher forcing: one scoring core for the demo and the tests.

Greedy speculative decoding is lossless when every emitted token is the plain target's
argmax given that run's own prefix. The check scores ``prompt + output`` with the plain
target (vLLM ``prompt_logprobs``) and measures, per emitted token, its *deficit*: the best
logprob at its position minus its own. On bf16 hardware the target's logits depend on how a
step is batched (GEMMs block by row count), so a correct token can score slightly below the
best at a near-tie; a deficit above ``EPSILON_NATS`` is a real violation. Token-for-token
equality with a separate greedy run is reported as information, never required.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Bound on the deficit of a correct token, in nats. The plain target's own greedy tokens,
# scored the same way, show the noise a correct token carries: `make demo` measures and prints
# it every run (0.0000 on 2026-12-03, AMD EPYC AVX2, default, torch kernels forced and
# ONEDNN_MAX_CPU_ISA=SSE41). scripts/dev/measure_bf16_noise.py once saw 0.344 nats on an AMX
# host, but only for prompts decoded alone and scored batched, which no check here does.
# 0.25 stays far below the deficit of a wrong token (1.9-3.7 nats in the lossy-sampler test).
EPSILON_NATS: float = 0.25


@dataclass(frozen=True)
class OracleReport:
    """The teacher-forcing verdict over a batch of greedy outputs."""

    worst_deficit: float
    epsilon: float
    violations: list[tuple[int, int, float]]  # (request index, output token index, deficit)
    token_identical: int | None  # outputs equal to reference_outputs, if one was given
    request_worst: tuple[float, ...] = ()  # worst deficit of each request

    @property
    def ok(self) -> bool:
        return self.worst_deficit <= self.epsilon

    def summary(self, num_requests: int) -> str:
        """One line for humans: verdict, worst deficit, epsilon, token-identical count."""
        same = (
            ""
            if self.token_identical is None
            else f", token-identical {self.token_identical}/{num_requests}"
        )
        return (
            f"lossless: {'YES' if self.ok else 'NO'} (worst deficit {self.worst_deficit:.4f} "
            f"nats, epsilon {self.epsilon:g}{same})"
        )


def token_deficits(
    position_logprobs: Sequence[Mapping[int, Any] | None],
    prompt_len: int,
    output: Sequence[int],
) -> list[float]:
    """Deficit of each emitted token against the best token at its position.

    ``position_logprobs[p]`` maps token id -> logprob (a float or an object with
    ``.logprob``, as vLLM returns) for position ``p`` of ``prompt + output``; it must hold
    the token actually there and the top-1 token.
    """
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be >= 1 (position 0 has no logprob), got {prompt_len}")
    if len(position_logprobs) != prompt_len + len(output):
        raise ValueError(
            f"position_logprobs must have prompt_len + len(output) = "
            f"{prompt_len + len(output)} entries, got {len(position_logprobs)}"
        )
    deficits = []
    for j, token in enumerate(output):
        scores = position_logprobs[prompt_len + j]
        if not scores or token not in scores:
            raise ValueError(
                f"position_logprobs[{prompt_len + j}] has no logprob for the emitted token "
                f"{token} (output index {j})"
            )
        values = {t: float(getattr(v, "logprob", v)) for t, v in scores.items()}
        deficits.append(max(values.values()) - values[token])
    return deficits


def report(
    deficits: Sequence[Sequence[float]],
    epsilon: float,
    token_identical: int | None = None,
) -> OracleReport:
    """Fold per-request deficits into an ``OracleReport``."""
    worst = max((d for row in deficits for d in row), default=0.0)
    violations = [
        (i, j, d) for i, row in enumerate(deficits) for j, d in enumerate(row) if d > epsilon
    ]
    per_request = tuple(max(row, default=0.0) for row in deficits)
    return OracleReport(worst, epsilon, violations, token_identical, per_request)


def _check_batch(name: str, rows: Sequence[Sequence[int]], n: int) -> None:
    if len(rows) != n:
        raise ValueError(f"{name} must have one entry per prompt ({n}), got {len(rows)}")


def prompt_logprobs(
    llm, sequences: list[list[int]], top: int, alone: bool = False
) -> list[list[dict[int, float] | None]]:
    """Per sequence and position: token id -> logprob for the ``top`` best tokens and the
    token actually there (``None`` at position 0). ``alone``: one engine call per sequence,
    so each is scored in a batch of its own."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top, detokenize=False)
    batches = [[s] for s in sequences] if alone else [sequences]
    results = [
        res
        for batch in batches
        for res in llm.generate(
            [{"prompt_token_ids": list(s)} for s in batch], params, use_tqdm=False
        )
    ]
    return [
        [None if d is None else {t: v.logprob for t, v in d.items()} for d in res.prompt_logprobs]
        for res in results
    ]


def teacher_force(
    llm,
    prompts: list[list[int]],
    outputs: list[list[int]],
    reference_outputs: list[list[int]] | None = None,
    epsilon: float = EPSILON_NATS,
) -> OracleReport:
    """Score every ``prompt + output`` with ``llm`` (a ``vllm.LLM`` on the plain target).

    ``reference_outputs`` (greedy without speculation, say) only feeds the token-identical
    count. Raises ``ValueError`` on mismatched batch sizes or empty prompts, before scoring.
    """
    _check_batch("outputs", outputs, len(prompts))
    if reference_outputs is not None:
        _check_batch("reference_outputs", reference_outputs, len(prompts))
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompts[{i}] is empty: position 0 has no logprob to score")
    # top-1 is enough: the best logprob at each position is all the deficit needs, and vLLM
    # always adds the logprob of the token actually at that position.
    scored = prompt_logprobs(
        llm, [list(p) + list(o) for p, o in zip(prompts, outputs, strict=True)], top=1
    )
    deficits = [
        token_deficits(scores, len(p), o)
        for scores, p, o in zip(scored, prompts, outputs, strict=True)
    ]
    identical = None
    if reference_outputs is not None:
        identical = sum(list(o) == list(r) for o, r in zip(outputs, reference_outputs, strict=True))
    return report(deficits, epsilon, identical)
