"""The greedy oracle's scoring logic on a fake target (no engine): what passes, what fails.

The fake target is a bigram table: the logits of the next token depend on the previous one
only, so greedy continuations and every deficit can be computed here independently.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from vllm.logprobs import FlatLogprobs, Logprob

from tests.support.greedy_oracle import EPSILON_NATS, OracleReport, teacher_force, token_deficits

VOCAB = 40


class BigramTarget:
    """A stand-in for ``vllm.LLM``: ``generate`` answers prompt logprobs from a table."""

    def __init__(self, seed: int = 0, flat: bool = False):
        gen = torch.Generator().manual_seed(seed)
        self.logprobs = torch.log_softmax(
            torch.randn(VOCAB, VOCAB, generator=gen, dtype=torch.float64) * 3, dim=-1
        )
        self.flat = flat
        self.calls = 0

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        seq = list(prompt)
        for _ in range(n):
            seq.append(int(self.logprobs[seq[-1]].argmax()))
        return seq[len(prompt) :]

    def gap(self, prev: int, token: int) -> float:
        row = self.logprobs[prev]
        return float(row.max() - row[token])

    def generate(self, prompts, params, use_tqdm=True):
        assert params.max_tokens == 1 and params.prompt_logprobs >= 1
        self.calls += 1
        results = []
        for p in prompts:
            seq = p["prompt_token_ids"]
            out = FlatLogprobs() if self.flat else []
            out.append(None)
            for pos in range(1, len(seq)):
                row = self.logprobs[seq[pos - 1]]
                best = int(row.argmax())
                out.append(
                    {
                        seq[pos]: Logprob(float(row[seq[pos]])),
                        best: Logprob(float(row[best]), rank=1),
                    }
                )
            results.append(SimpleNamespace(prompt_logprobs=out))
        return results


PROMPTS = [[3], [5, 9, 1], [7, 7, 7, 7, 2]]


@pytest.mark.parametrize("flat", [False, True])
def test_greedy_outputs_pass_with_zero_deficit(flat):
    llm = BigramTarget(flat=flat)
    outputs = [llm.greedy(p, 6) for p in PROMPTS]
    rep = teacher_force(llm, PROMPTS, outputs, reference_outputs=outputs)
    assert isinstance(rep, OracleReport)
    assert rep.ok and rep.worst_deficit == 0.0 and rep.violations == []
    assert rep.epsilon == EPSILON_NATS
    assert rep.token_identical == len(PROMPTS)
    assert llm.calls == 1  # one batched scoring call


def test_a_wrong_token_is_a_violation_at_its_index_with_its_gap():
    llm = BigramTarget()
    outputs = [llm.greedy(p, 6) for p in PROMPTS]
    reference = [list(o) for o in outputs]
    prev = outputs[1][2]
    wrong = int(llm.logprobs[prev].argsort()[0])  # the least likely token after prev
    # The tokens after the corruption are the greedy continuation of the corrupted prefix:
    # only index 3 is wrong, later tokens are right given that run's own prefix.
    outputs[1] = outputs[1][:3] + [wrong] + llm.greedy([wrong], 2)
    rep = teacher_force(llm, PROMPTS, outputs, reference_outputs=reference)
    want = llm.gap(prev, wrong)
    assert want > 1.0  # a real error is far above the noise bound
    assert not rep.ok
    assert [(i, j) for i, j, _ in rep.violations] == [(1, 3)]
    assert math.isclose(rep.violations[0][2], want, rel_tol=1e-6)
    assert math.isclose(rep.worst_deficit, want, rel_tol=1e-6)
    assert rep.token_identical == len(PROMPTS) - 1
    assert "lossless: NO" in rep.summary(len(PROMPTS))


def test_a_near_tie_within_epsilon_passes_and_is_reported():
    llm = BigramTarget()
    prev = 4
    row = llm.logprobs[prev].clone()
    best = int(row.argmax())
    runner_up = int(row.argsort()[-2])
    tie = 0.25 * EPSILON_NATS  # a bf16-sized difference, as when batching rounds differently
    row[runner_up] = row[best] - tie
    llm.logprobs[prev] = row
    rep = teacher_force(llm, [[prev]], [[runner_up]], reference_outputs=[[best]])
    assert rep.ok and rep.violations == []
    assert math.isclose(rep.worst_deficit, tie, rel_tol=1e-9)
    assert rep.token_identical == 0  # not identical, still lossless
    assert rep.summary(1).startswith("lossless: YES")
    strict = teacher_force(llm, [[prev]], [[runner_up]], epsilon=0.5 * tie)
    assert not strict.ok and strict.violations == [(0, 0, pytest.approx(tie))]


def test_no_reference_means_no_token_identical_count():
    llm = BigramTarget()
    rep = teacher_force(llm, PROMPTS, [llm.greedy(p, 2) for p in PROMPTS])
    assert rep.token_identical is None and rep.ok


@pytest.mark.parametrize(
    ("prompts", "outputs", "reference", "field"),
    [
        (PROMPTS, [[1]], None, "outputs"),
        (PROMPTS, [[1], [2], [3]], [[1]], "reference_outputs"),
        ([[1], []], [[1], [2]], None, r"prompts\[1\]"),
    ],
)
def test_bad_batches_raise_before_scoring(prompts, outputs, reference, field):
    llm = BigramTarget()
    with pytest.raises(ValueError, match=field):
        teacher_force(llm, prompts, outputs, reference_outputs=reference)
    assert llm.calls == 0


def test_token_deficits_refuses_a_position_without_the_emitted_token():
    scores = [None, {5: Logprob(-0.1)}, {6: Logprob(-0.2)}]
    assert token_deficits(scores, 2, [6]) == [0.0]
    with pytest.raises(ValueError, match=r"position_logprobs\[2\].*emitted token 9"):
        token_deficits(scores, 2, [9])
    with pytest.raises(ValueError, match="prompt_len \\+ len\\(output\\) = 4"):
        token_deficits(scores, 2, [6, 7])
    with pytest.raises(ValueError, match="prompt_len must be >= 1"):
        token_deficits(scores, 0, [1, 2, 3])
