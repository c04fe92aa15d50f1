"""Subprocess driver of the real-checkpoint-format end-to-end test (real vLLM, CPU, V1).

    python -m tests.e2e.runners.real_format --model REAL --twin TWIN \
        --out R.json

``REAL`` is the tiny checkpoint in the published FP8 block + MXFP4 format, ``TWIN`` its exact
bf16 dequantisation. DSpark serves ``REAL`` with the DSpark end-to-end runner's settings
(probabilistic drafting, greedy verification, 64-token chunked prefill) for 4 concurrent
prompts of 2..300 tokens, scored by teacher forcing with the plain ``REAL`` target. The same
sequences are then scored by the plain ``TWIN`` target: its prompt logprobs differ from
``REAL``'s only by how the kernels round (same weight values), reported beside the noise
floor of ``REAL`` itself (each sequence scored alone instead of batched). The report also
names the kernels the draft's FP8 linears and MXFP4 experts ran.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scripts.selftest.engines import kernels
from scripts.verify.plain_target import PlainTarget
from tests.e2e.runners.dspark import engine_kwargs, lossless_phase, make_engine, prompts


def logprob_gaps(a: list, b: list) -> dict:
    """Largest |logprob difference| of the tokens present, and argmax agreement."""
    worst, positions, same_best = 0.0, 0, 0
    for seq_a, seq_b in zip(a, b, strict=True):
        for pos_a, pos_b in zip(seq_a[1:], seq_b[1:], strict=True):
            positions += 1
            for token in pos_a.keys() & pos_b.keys():
                worst = max(worst, abs(pos_a[token] - pos_b[token]))
            same_best += max(pos_a, key=pos_a.get) == max(pos_b, key=pos_b.get)
    return {"max_abs_diff": worst, "positions": positions, "same_argmax": same_best}


REQUESTS = ["L1", "L3", "L5", "L7"]  # 2, 33, 130 and 300 prompt tokens, 12 new tokens


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--twin", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    all_prompts = prompts()
    with PlainTarget(engine_kwargs(args.model, None, speculative=False)) as target:
        engine = make_engine(engine_kwargs(args.model, None, speculative=True))
        drafter = engine.collective_rpc(lambda worker: worker.model_runner.drafter)[0]
        result = {"kernels": kernels(drafter.model)}
        result["lossless"] = lossless_phase(engine, drafter, target, all_prompts, REQUESTS)
        outputs = result["lossless"]["outputs"]
        sequences = [all_prompts[r] + outputs[r] for r in sorted(outputs)]
        real_logprobs = target.prompt_logprobs(sequences, 1)
        result["noise_floor"] = logprob_gaps(
            real_logprobs, target.prompt_logprobs(sequences, 1, alone=True)
        )
    with PlainTarget(engine_kwargs(args.twin, None, speculative=False)) as twin:
        twin_logprobs = twin.prompt_logprobs(sequences, 1)
    result["twin_logprobs"] = logprob_gaps(real_logprobs, twin_logprobs)
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
