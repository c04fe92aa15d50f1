"""The confidence head's online calibration against a per-request, per-slot count in Python."""

from __future__ import annotations

import random

import pytest
import torch

from tests.support.overlay import load_overlay_module

SlotCalibration = load_overlay_module("vllm/v1/spec_decode/dspark/calibration.py").SlotCalibration

K, SLOTS = 4, 6


def _oracle_scale(steps, decay, prior):
    """Per slot: (decayed accepted drafts + prior) / (decayed confidence of the drafts the
    target got to judge + prior). A draft is judged when it was verified and every draft
    before it was accepted."""
    accepted, predicted = [0.0] * K, [0.0] * K
    drafted = {}  # ring row -> confidence of the block it drafted last
    for rows, block in steps:
        accepted = [a * decay for a in accepted]
        predicted = [p * decay for p in predicted]
        for slot, verified, rejected in rows:
            conf = drafted.get(slot)
            if conf is None:  # nothing drafted on this ring row yet: nothing to compare
                continue
            kept = verified - rejected
            for j in range(verified):
                if j > kept:
                    break
                predicted[j] += conf[j]
                accepted[j] += j < kept
        drafted.update(block)
    return [(a + prior) / (p + prior) for a, p in zip(accepted, predicted, strict=True)]


def _run(calibration, steps):
    for rows, block in steps:
        if rows:
            slots, verified, rejected = (torch.tensor(c) for c in zip(*rows, strict=True))
            calibration.observe(slots, verified, rejected)
        else:
            calibration.observe(*(torch.zeros(0, dtype=torch.int64) for _ in range(3)))
        slots = torch.tensor(list(block))
        calibration.remember(slots, torch.tensor(list(block.values())))


def _random_steps(rng, num_steps):
    steps = []
    for _ in range(num_steps):
        slots = rng.sample(range(SLOTS), rng.randint(1, SLOTS))
        rows = []
        for slot in slots:
            verified = rng.randint(0, K)
            rows.append((slot, verified, rng.randint(0, verified)))
        block = {slot: [rng.random() for _ in range(K)] for slot in slots}
        steps.append((rows, block))
    return steps


@pytest.mark.parametrize("seed", range(5))
def test_scale_matches_a_per_request_count(seed):
    steps = _random_steps(random.Random(seed), 40)
    calibration = SlotCalibration(SLOTS, K, "cpu")
    _run(calibration, steps)
    want = _oracle_scale(steps, SlotCalibration.DECAY, SlotCalibration.PRIOR)
    torch.testing.assert_close(calibration.scale, torch.tensor(want), rtol=1e-5, atol=1e-6)


def test_a_head_that_predicts_half_of_what_is_accepted_is_scaled_up_and_clamped():
    """Every draft accepted at confidence 0.5: the scale climbs towards 2 with outcomes (the
    prior holds it near 1 at first), and the calibrated confidence never exceeds 1."""
    calibration = SlotCalibration(SLOTS, K, "cpu")
    half = torch.full((2, K), 0.5)
    slots = torch.tensor([0, 1])
    scales = []
    for _ in range(60):
        calibration.observe(slots, torch.full((2,), K), torch.zeros(2, dtype=torch.int64))
        calibration.remember(slots, half)
        scales.append(calibration.scale[0].item())
    assert scales[0] == 1.0  # nothing was drafted before the first step: nothing compared
    assert 1.0 < scales[1] < 1.2 and scales[-1] > 1.8
    assert scales == sorted(scales)
    assert calibration.apply(torch.full((1, K), 0.9)).max().item() == 1.0
    # NaN from the head counts as 0, as the rule reads it.
    assert calibration.apply(torch.full((1, K), float("nan"))).max().item() == 0.0


def test_after_forget_no_outcome_counts_until_a_block_is_remembered_again():
    """The rule was off for a while (nothing remembered): the ring rows' old blocks are not
    the ones the target judges now."""
    calibration = SlotCalibration(SLOTS, K, "cpu")
    slots, verified = torch.tensor([0, 1]), torch.full((2,), K)
    none_rejected = torch.zeros(2, dtype=torch.int64)
    calibration.remember(slots, torch.full((2, K), 0.5))
    calibration.forget()
    calibration.observe(slots, verified, none_rejected)
    assert calibration.scale.tolist() == [1.0] * K
    calibration.remember(slots, torch.full((2, K), 0.5))
    calibration.observe(slots, verified, none_rejected)
    torch.testing.assert_close(calibration.scale, torch.full((K,), (2 + 8) / (1 + 8)))


def test_an_outcome_fades_by_half_in_about_34_steps():
    """The sums decay 2% a step (0.98 ** 34 = 0.503): they remember about the last 50 steps."""
    cal = SlotCalibration(SLOTS, K, "cpu")
    slots = torch.tensor([0])
    cal.remember(slots, torch.full((1, K), 0.5))
    cal.observe(slots, torch.tensor([1]), torch.tensor([0]))  # slot 0's draft accepted
    for _ in range(34):  # steps that judged nothing
        cal.observe(slots, torch.tensor([0]), torch.tensor([0]))
    assert cal.accepted[0].item() == pytest.approx(0.503, abs=0.002)
    assert cal.predicted[0].item() == pytest.approx(0.5 * 0.503, abs=0.001)


def test_a_pad_row_uses_the_scratch_row_and_a_nan_confidence_predicts_nothing():
    cal = SlotCalibration(SLOTS, K, "cpu")
    assert cal.drafted.shape == (SLOTS + 1, K)  # one scratch row, for pad rows
    slots = torch.tensor([2, SLOTS])  # a request's ring row and a pad row
    confidence = torch.tensor([[float("nan"), 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]])
    cal.remember(slots, confidence)
    cal.observe(slots[:1], torch.tensor([1]), torch.tensor([0]))  # its first draft accepted
    # Accepted 1, predicted 0 (NaN read as 0): (1 + 8) / (0 + 8).
    assert cal.scale[0].item() == pytest.approx(9.0 / 8.0)


def test_the_rule_reads_confidences_clamped_to_zero_one():
    cal = SlotCalibration(SLOTS, K, "cpu")
    out = cal.apply(torch.tensor([[-0.5, 0.2, 1.5, float("nan")]]))
    assert out[0].tolist() == pytest.approx([0.0, 0.2, 1.0, 0.0])
