"""DSpark under constrained decoding in real vLLM on CPU (V1 runner, overlay applied).

``tests/e2e/runners/grammar.py`` runs greedy requests under a JSON schema and a regex on one DSpark
engine, with the tiny draft's own drafts and then with replayed drafts that know the answer
(one slot of every third block changed), so verify steps under the grammar accept, reject and
roll the grammar back. Oracle: an independent grammar matcher over the emitted tokens (every
token allowed, exactly) and the plain target by teacher forcing over the allowed set (each
token within EPSILON_NATS of the best allowed one).
"""

from __future__ import annotations

import pytest
import vllm.v1.spec_decode.dspark.proposer  # noqa: F401  (fails if the overlay is not applied)

from scripts.verify.teacher_forcing import EPSILON_NATS
from tests.e2e.runners import grammar as runner
from tests.support.tiny import ensure_tiny_model, run_engine_script

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("grammar") / "report.json"
    return run_engine_script(runner.__name__, out, "--model", str(ensure_tiny_model()),
                             timeout=1200)


@pytest.mark.parametrize("run", ["own", "replayed"])
def test_every_token_is_allowed_and_the_targets_best_allowed(report, run):
    oracle = report[run]["oracle"]
    assert sorted(oracle) == sorted(runner.KINDS)
    for rid, row in oracle.items():
        assert row["emitted"] > 0 and row["allowed"] == row["emitted"], (run, rid, row)
        assert row["worst_deficit"] <= EPSILON_NATS, (run, rid, row)
        print(f"{run} {rid} ({runner.KINDS[rid]}): {row['emitted']} tokens, worst deficit "
              f"{row['worst_deficit']:.4f} nats: {row['text']!r}")


def test_replayed_drafts_are_verified_accepted_and_rejected_under_the_grammar(report):
    own, replayed = report["own"]["counters"], report["replayed"]["counters"]
    print(f"own drafts: {own}\nreplayed drafts: {replayed}, "
          f"changed {report['replayed']['changed_drafts']}")
    assert replayed["verified_tokens"] > 0 and report["replayed"]["changed_drafts"] > 0
    # Knowing the answer, most verified drafts are accepted; changed slots are not.
    assert replayed["accepted_tokens"] * 2 > replayed["verified_tokens"]
    assert replayed["accepted_tokens"] < replayed["verified_tokens"]
    assert replayed["accepted_tokens"] > own["accepted_tokens"]
    # Fewer model steps (the proposer's count): the engine's own step count also holds the
    # empty steps spent waiting for the grammar to compile, which a busy machine lengthens.
    assert replayed["steps"] < own["steps"]
