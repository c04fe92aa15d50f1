"""DSpark under a grammar in real vLLM on CPU (run by test_dspark_grammar_e2e.py).

Three greedy requests under structured outputs (a JSON schema twice, a regex) run concurrently,
twice, on one DSpark engine with the cpu-tiny profile's demo settings (64-token prefill chunks,
so steps mix prefill chunks and verify rows) and compact JSON (vLLM's
``disable_any_whitespace``: the random model would otherwise spin in the whitespace JSON allows). First with the tiny checkpoint's own random
drafts, which the grammar nearly always cuts at once (vLLM drops a draft from its first token
the grammar forbids). Then with replayed drafts: each request's first-run output read ahead
from the anchor, what a draft that knows the answer proposes, with one slot of every third
block changed to another token, so verify steps under the grammar accept, reject and roll the
grammar back. Every output is scored under the grammar against the plain target
(support/grammar_oracle.py) with its prompt logprobs over the whole vocabulary.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from scripts.verify.plain_target import PlainTarget
from tests.e2e.runners.dspark import drive, engine_kwargs, make_engine
from tests.support import grammar_oracle as grammar
from tests.support.draft_hooks import replace_drafts, restore_drafts
from tests.support.oracle_drafts import external_id
from tests.support.runner_cli import model_and_out

KINDS = {"J0": "json", "R0": "regex", "J1": "json"}
PROMPT_LENS = {"J0": 40, "R0": 90, "J1": 150}
MAX_TOKENS = 40
CORRUPT_EVERY = 3  # one slot of every third draft block is changed


def prompts() -> dict[str, list[int]]:
    rng = random.Random(2468)
    return {rid: [rng.randrange(9, 1000) for _ in range(n)] for rid, n in PROMPT_LENS.items()}


def sampling(kind: str):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    constraint = (StructuredOutputsParams(json=grammar.SCHEMA) if kind == "json"
                  else StructuredOutputsParams(regex=grammar.REGEX))
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=constraint)


class ReplayedDrafts:
    """A draft hook (``support.draft_hooks``) proposing each request's known output after the anchor."""

    def __init__(self, all_prompts: dict[str, list[int]], outputs: dict[str, list[int]],
                 vocab_size: int):
        self.prompts, self.outputs, self.vocab_size = all_prompts, outputs, vocab_size
        self.calls = 0
        self.changed = 0

    def __call__(self, *, req_ids, anchor_positions, anchor_tokens, drafts):
        out = drafts.clone()
        n = drafts.shape[1]
        for row, req_id in enumerate(req_ids):
            rid = external_id(req_id)
            start = int(anchor_positions[row]) + 1 - len(self.prompts[rid])  # output index
            known = self.outputs[rid][max(start, 0): max(start, 0) + n]
            block = known + out[row, len(known):].tolist()
            if (self.calls + row) % CORRUPT_EVERY == 0 and start >= 0:
                slot = (self.calls + row) % n
                block[slot] = (block[slot] + 1) % self.vocab_size
                self.changed += 1
            out[row] = out.new_tensor(block)
        self.calls += 1
        return out


def run_once(engine, drafter, all_prompts) -> dict:
    drafter.reset_counters()
    for rid, kind in KINDS.items():
        engine.add_request(rid, {"prompt_token_ids": all_prompts[rid]}, sampling(kind))
    outputs, _, steps = drive(engine, lambda _: None)
    return {"outputs": outputs, "steps": steps, "counters": drafter.counters.as_dict()}


def score(target: PlainTarget, tokenizer, vocab: int, all_prompts, outputs) -> dict:
    """Per request: emitted tokens, how many the grammar allows in a row, worst deficit."""
    ids = sorted(outputs)
    scored = target.prompt_logprobs([all_prompts[r] + outputs[r] for r in ids], top=vocab)
    report = {}
    for rid, positions in zip(ids, scored, strict=True):
        emitted, start = outputs[rid], len(all_prompts[rid])
        allowed = grammar.allowed_sets(tokenizer, vocab, KINDS[rid], emitted,
                                       any_whitespace=False)
        deficits = grammar.grammar_deficits(positions[start: start + len(allowed)],
                                            emitted[: len(allowed)], allowed)
        report[rid] = {"emitted": len(emitted), "allowed": len(allowed),
                       "worst_deficit": max(deficits, default=0.0),
                       "text": tokenizer.decode(emitted, skip_special_tokens=True)}
    return report


def main() -> int:
    args = model_and_out()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    all_prompts = prompts()
    plain = {**engine_kwargs(args.model, None, speculative=False), "max_logprobs": -1}
    with PlainTarget(plain) as target:
        engine = make_engine({**engine_kwargs(args.model, None, speculative=True),
                              "structured_outputs_config": {"backend": "xgrammar",
                                                            "disable_any_whitespace": True}})
        drafter = engine.collective_rpc(lambda worker: worker.model_runner.drafter)[0]
        result = {"own": run_once(engine, drafter, all_prompts)}
        replay = ReplayedDrafts(all_prompts, result["own"]["outputs"], vocab)
        replace_drafts(drafter, replay)
        result["replayed"] = run_once(engine, drafter, all_prompts)
        restore_drafts(drafter)
        result["replayed"]["changed_drafts"] = replay.changed
        for run in ("own", "replayed"):
            result[run]["oracle"] = score(target, tokenizer, vocab, all_prompts,
                                          result[run]["outputs"])
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
