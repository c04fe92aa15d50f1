"""The step-cost benchmark's accounting (scripts/bench/step_cost.py), not its timings.

Oracle: a fake clock whose readings are written here, so each phase's exclusive time is known by
hand; scheduler outputs built here for the decode-only rule.
"""

from __future__ import annotations

from types import SimpleNamespace

from scripts.bench.step_cost import PhaseClock, _decode_only


def test_nested_wrapped_calls_count_each_phase_once():
    ticks = iter([0.0, 1.0, 3.0, 10.0])  # outer in, inner in, inner out, outer out
    clock = PhaseClock(lambda: next(ticks))
    obj = SimpleNamespace(inner=lambda: "x")
    obj.outer = lambda: obj.inner()
    assert clock.wrap(obj, "inner", "draft forward")
    assert clock.wrap(obj, "outer", "proposer glue")
    assert not clock.wrap(obj, "absent", "host plan")  # a renamed method is reported, not faked
    assert obj.outer() == "x"
    assert clock.step == {"draft forward": 2.0, "proposer glue": 8.0}


def _so(scheduled, spec=None, new=()):
    return SimpleNamespace(num_scheduled_tokens=scheduled, scheduled_spec_decode_tokens=spec or {},
                           scheduled_new_reqs=list(new))


def test_decode_only_steps_are_one_row_plus_the_drafts_per_request():
    assert _decode_only(_so({"a": 5, "b": 5}, {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}))
    assert _decode_only(_so({"a": 1}))
    assert not _decode_only(_so({"a": 5, "b": 64}, {"a": [1, 2, 3, 4]}))  # a prefill chunk
    assert not _decode_only(_so({"a": 1}, new=["a"]))  # a new request
    assert not _decode_only(_so({}))  # nothing scheduled
