"""Subprocess driver for the adaptive-verification end-to-end test (real vLLM, CPU, V1).

    python -m tests.e2e.runners.adaptive --model DIR --out R.json --tables DIR \
        [--row-budget 12] [--modes fixed adaptive adaptive-async budget budget-async]

One process, one engine at a time, the plain target (the oracle, a child process) started
once; the report maps each mode to its result. Every mode runs the same 8 greedy prompts
(the e2e lossless set, 1..300 tokens, 64-token chunked prefill) through one DSpark engine with the trained tiny draft, and records what
the target verified each step: per request, its rows, the drafts it was scheduled (the
proposer's ``num_draft_tokens``) and whether it was still in prefill. ``adaptive`` turns on
``enable_adaptive_verification`` with a given step-time table (a verify row at 10% of the
fixed step time, so the cut does not depend on this machine's timing, and pays whatever
the confidence of the draft this machine trained: a draft below about 0.4 survival is
not worth its row), scores the greedy outputs with the greedy oracle (the plain target
by teacher forcing, in a child process) and runs the same seeded sampled requests twice,
one batch after the other.
``adaptive-async`` does the same with async scheduling, where the cut reaches the
scheduler as per-request draft budgets one step late. ``budget`` and ``budget-async`` run
``adaptive: auto`` as a deployment does (the table measured by the engine itself, into a
cache of its own under ``--tables``) under the row budget ``--row-budget``, set as a
deployment sets it (``DSPARK_VERIFY_ROW_BUDGET``), smaller than full width at 8 requests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from scripts.verify.plain_target import PlainTarget
from tests.e2e.runners.dspark import (
    add_all,
    drive,
    engine_kwargs,
    make_engine,
    params,
    prompts,
    score,
)
from tests.support.engine_teardown import release_engine_memory

GREEDY = [f"L{i}" for i in range(8)]
GREEDY_TOKENS = 16
SAMPLED = ["L1", "L3", "L5"]
SAMPLED_TOKENS = 16


def record_verify_steps(drafter) -> list[dict]:
    """Wrap ``drafter.propose`` to keep each step's scheduled draft counts (host data)."""
    steps: list[dict] = []
    propose = drafter.propose

    def recording(step):
        steps.append(
            {
                "drafts": [int(d) for d in step.num_draft_tokens],
                "prefilling": [bool(p) for p in step.prefilling],
                "rows": [int(n) for n in np.diff(step.query_start_loc_cpu)],
            }
        )
        return propose(step)

    drafter.propose = recording
    return steps


def greedy_phase(engine, drafter, all_prompts, steps: list[dict]) -> dict:
    first = len(steps)
    drafter.reset_counters()
    add_all(engine, all_prompts, GREEDY, GREEDY_TOKENS)
    outputs, _, num_steps = drive(engine, lambda _: None)
    return {
        "outputs": outputs,
        "steps": steps[first:],  # this phase's steps
        "engine_steps": num_steps,
        "counters": drafter.counters.as_dict(),
    }


def sampled_twice(engine, all_prompts) -> list[dict[str, list[int]]]:
    """The same seeded sampled requests, as the same batch, twice (the steps recorded by
    the caller's wrapper)."""
    runs = []
    for run in range(2):
        for i, rid in enumerate(SAMPLED):
            engine.add_request(
                f"{rid}-run{run}",
                {"prompt_token_ids": all_prompts[rid]},
                params(SAMPLED_TOKENS, temperature=0.9, seed=100 + i),
            )
        outputs, _, _ = drive(engine, lambda _: None)
        runs.append({rid.split("-run")[0]: toks for rid, toks in outputs.items()})
    return runs


def given_table(k: int, requests=(1, 2, 4, 8)):
    """Step time 1 + 10% per verify row at every grid point (at 2%, a well-trained draft's
    low-survival tail promised less than the rule's minimum gain: nothing was cut)."""
    from vllm.v1.spec_decode.dspark.cost_table import StepCostTable

    return StepCostTable(requests, tuple(tuple(1.0 + 0.1 * r * (w + 1) for w in range(k + 1))
                                         for r in requests))


def run(
    model: str, adaptive: bool, target: PlainTarget | None = None, async_scheduling=False,
    measured_table=False,
) -> dict:
    kwargs = engine_kwargs(model, None, speculative=True)
    kwargs["async_scheduling"] = async_scheduling
    kwargs["speculative_config"] = {
        **kwargs["speculative_config"],
        "enable_adaptive_verification": adaptive,
    }
    engine = make_engine(kwargs)
    drafter = engine.collective_rpc(lambda worker: worker.model_runner.drafter)[0]
    if adaptive and not measured_table:  # before the first step: the engine keeps it
        drafter.use_cost_table(given_table(drafter.num_speculative_tokens))
    all_prompts = prompts()
    steps = record_verify_steps(drafter)
    result = {
        "adaptive": drafter.adaptive,
        "row_budget": drafter.row_budget,
        "scheduler": type(engine.engine_core.engine_core.scheduler).__name__,
        "greedy": greedy_phase(engine, drafter, all_prompts, steps),
    }
    result["rule_on"] = drafter.rule_on
    result["table_ms"] = [list(row) for row in drafter.cost_table.ms] if drafter.cost_table else None
    if target is not None:
        outputs = result["greedy"]["outputs"]
        result["oracle"] = score(target, all_prompts, outputs, dict.fromkeys(outputs, GREEDY_TOKENS))
        first = len(steps)
        result["sampled"] = sampled_twice(engine, all_prompts)
        result["sampled_steps"] = steps[first:]
    engine.engine_core.shutdown()
    return result


MODES = ("fixed", "adaptive", "adaptive-async", "budget", "budget-async")


def run_mode(mode: str, model: str, target: PlainTarget, tables: Path, row_budget: int) -> dict:
    """One mode's engine, from its own settings in the environment, torn down after."""
    from vllm.v1.spec_decode.dspark import cost_table

    os.environ[cost_table.MODE_ENV] = "auto"
    os.environ[cost_table.CACHE_DIR_ENV] = str(tables / mode)  # measured afresh
    if mode.startswith("budget"):
        os.environ[cost_table.BUDGET_ENV] = str(row_budget)
    else:
        os.environ.pop(cost_table.BUDGET_ENV, None)
    if mode == "fixed":
        result = run(model, adaptive=False)
    else:
        result = run(model, adaptive=True, target=target,
                     async_scheduling=mode.endswith("-async"),
                     measured_table=mode.startswith("budget"))
    release_engine_memory()
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tables", type=Path, required=True, help="root of the table caches")
    ap.add_argument("--row-budget", type=int, default=12)
    args = ap.parse_args()
    with PlainTarget(engine_kwargs(args.model, None, speculative=False)) as target:
        results = {mode: run_mode(mode, args.model, target, args.tables, args.row_budget)
                   for mode in args.modes}
    Path(args.out).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
