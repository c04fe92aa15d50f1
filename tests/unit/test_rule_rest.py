"""When the cut rule rests: counted against a hand-written sequence of steps."""

from __future__ import annotations

import pytest

from tests.support.overlay import load_overlay_module

RuleRest = load_overlay_module("vllm/v1/spec_decode/dspark/rule_rest.py").RuleRest


def test_rests_after_a_run_of_uncut_steps_and_wakes_after_the_rest():
    rest = RuleRest(rest_after=2, rest_for=3)
    # (judged, admitted all) per proposal and what the tracker must say.
    steps = [
        ((True, True), None),  # uncut 1
        ((False, False), None),  # not judged (a prefill, an exploring step): no change
        ((True, False), None),  # a draft cut: back to 0
        ((True, True), None),  # 1
        ((True, True), RuleRest.REST),  # 2 in a row: rest 3 proposals
        ((True, True), None),  # resting (2 left)
        ((True, False), None),  # resting (1 left): what it verifies does not count
        ((False, False), RuleRest.WAKE),
        ((True, True), None),  # counting again from 0
    ]
    for i, ((judged, admitted_all), want) in enumerate(steps):
        assert rest.step(judged, admitted_all) == want, i
    assert rest.rests == 1 and not rest.resting and rest.uncut == 1


@pytest.mark.parametrize("after,rest_for", [(0, 5), (3, 0)])
def test_counts_must_be_positive(after, rest_for):
    with pytest.raises(ValueError, match="rest_after and rest_for"):
        RuleRest(after, rest_for)


def test_the_defaults_rest_after_64_uncut_steps_for_512_proposals():
    rest = RuleRest()
    said = [rest.step(True, True) for _ in range(64)]
    assert said == [None] * 63 + [RuleRest.REST]
    said = [rest.step(True, True) for _ in range(512)]
    assert said == [None] * 511 + [RuleRest.WAKE] and not rest.resting


def test_the_shortest_rest_one_step_after_one_uncut_step():
    rest = RuleRest(rest_after=1, rest_for=1)  # the smallest allowed
    assert rest.step(True, True) == RuleRest.REST and rest.resting
    assert rest.step(True, True) == RuleRest.WAKE and not rest.resting
