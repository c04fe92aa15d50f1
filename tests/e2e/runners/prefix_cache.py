"""Subprocess driver for the DSpark + prefix caching end-to-end test (real vLLM on CPU).

    python -m tests.e2e.runners.prefix_cache --model DIR --out R.json

One DSpark engine with prefix caching on (as ``spark-2x`` serves), the cpu-tiny profile's
demo settings otherwise (64-token chunked prefill), beside the plain target in a child
process (the greedy oracle). Three waves of greedy requests:

- ``warm``: two long shared prefixes (A, B), each with its own suffix, and a fresh prompt.
- ``hits``: new suffixes on A and B (prefix-cache hits) mixed with fresh prompts, at once.
  Both waves use the draft's real drafts and are scored by teacher forcing.
- ``holes``: the draft never sees cached positions, so after a hit its window would have
  masked holes until W new positions arrive, unless enough is recomputed. This wave
  measures the cost with oracle drafts made window-sensitive: a request gets the target's
  greedy continuation only when its window is complete, else the draft model's own
  (random-weight) drafts, the worst case of a draft useless with any hole. Suffixes of 8
  and 140 tokens after the cached prefix, against fresh prompts of the same length.

The report carries outputs, oracle verdicts, vLLM's per-request ``num_cached_tokens``, the
proposer's counters and, per request, the first position the proposer saw and the draft
steps it drafted with holes.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from scripts.verify.plain_target import PlainTarget
from tests.e2e.runners.dspark import engine_kwargs, make_engine, params, score
from tests.support.draft_hooks import replace_drafts, restore_drafts
from tests.support.oracle_drafts import OracleDrafts, external_id
from tests.support.runner_cli import model_and_out

# Hits align to the largest KV group block span (256 tokens with C4A layers, block 64), and
# DSpark, like EAGLE, drops the last matched block (vLLM recomputes it for the draft): a
# shared prefix needs two aligned blocks (512 tokens) for a 256-token hit.
PREFIX_A, PREFIX_B = 600, 560
MAX_MODEL_LEN = 1024
MAX_TOKENS = 10
HOLES_MAX_TOKENS = 24
HOLE_SUFFIXES = (8, 140)


def prompts() -> dict[str, list[int]]:
    """Every prompt by request id: A*/B* share a prefix, F* are fresh (deterministic ids)."""
    rng = random.Random(4321)

    def tokens(n):
        return [rng.randrange(9, 1000) for _ in range(n)]

    a, b = tokens(PREFIX_A), tokens(PREFIX_B)
    out = {
        # warm: fill the cache
        "A0": a + tokens(11),
        "B0": b + tokens(30),
        "F0": tokens(90),
        # hits: the same prefixes again, new suffixes, mixed with fresh prompts
        "A1": a + tokens(5),
        "A2": a + tokens(47),
        "B1": b + tokens(17),
        "F1": tokens(330),
        "F2": tokens(40),
    }
    for n in HOLE_SUFFIXES:  # holes: hits with short / medium / long suffixes vs fresh
        out[f"HA{n}"] = a + tokens(n)
        out[f"HF{n}"] = tokens(PREFIX_A + n)
    return out


WAVES = {
    "warm": ["A0", "B0", "F0"],
    "hits": ["A1", "B1", "F1", "A2", "F2"],
    "holes": [f"H{kind}{n}" for n in HOLE_SUFFIXES for kind in "AF"],
}


class FirstSight:
    """Step observer: the first position the proposer saw per request, and holey drafts."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.first: dict[str, int] = {}
        self.holey_steps: dict[str, int] = {}
        self.steps: dict[str, int] = {}

    def __call__(self, rec):
        qsl = rec.query_start_loc.tolist()
        window = self.drafter.window
        for i, req_id in enumerate(rec.req_ids):
            rid = external_id(req_id)
            self.first.setdefault(rid, int(rec.positions[qsl[i]]))
            anchor = int(rec.anchor_positions[i])
            visible = int(rec.window[i].sum())
            self.steps[rid] = self.steps.get(rid, 0) + 1
            if visible < min(anchor, window):
                self.holey_steps[rid] = self.holey_steps.get(rid, 0) + 1


def window_has_holes(drafter, req_id: str, anchor: int) -> bool:
    """Whether the request's ring lacks any of the W positions before its anchor."""
    import torch
    from vllm.v1.spec_decode.dspark.context_store import window_mask

    # Asked during the request's step: it holds a row, which ``assign`` hands back.
    slots = torch.tensor(drafter.slot_table.assign([req_id]), device=drafter.device)
    anchors = torch.tensor([anchor], dtype=torch.int64, device=drafter.device)
    mask = window_mask(drafter.kv_pos, slots, anchors, drafter.window)
    return int(mask.sum()) < min(anchor, drafter.window)


class WindowSensitiveOracle:
    """Oracle drafts only where the window is complete; the draft's own drafts elsewhere."""

    def __init__(self, drafter, oracle: OracleDrafts):
        self.drafter = drafter
        self.oracle = oracle

    def __call__(self, *, req_ids, anchor_positions, anchor_tokens, drafts):
        perfect = self.oracle(
            req_ids=req_ids,
            anchor_positions=anchor_positions,
            anchor_tokens=anchor_tokens,
            drafts=drafts,
        )
        out = drafts.clone()
        for i, req_id in enumerate(req_ids):
            if not window_has_holes(self.drafter, req_id, int(anchor_positions[i])):
                out[i] = perfect[i]
        return out


def run_wave(engine, all_prompts, ids, max_tokens):
    """Add ``ids`` at once, step to completion; outputs and num_cached_tokens by id."""
    for rid in ids:
        engine.add_request(rid, {"prompt_token_ids": all_prompts[rid]}, params(max_tokens))
    outputs, cached, steps = {}, {}, 0
    while engine.has_unfinished_requests() and steps < 600:
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
                cached[out.request_id] = int(out.num_cached_tokens or 0)
        steps += 1
    return outputs, cached, steps


def run(model: str, target: PlainTarget) -> dict:
    from tests.support.dspark_steps import observe_steps

    all_prompts = prompts()
    kwargs = engine_kwargs(model, None, speculative=True)
    kwargs.update(enable_prefix_caching=True, max_model_len=MAX_MODEL_LEN)
    engine = make_engine(kwargs)
    drafter = engine.collective_rpc(lambda worker: worker.model_runner.drafter)[0]
    coordinator = engine.engine_core.engine_core.scheduler.kv_cache_manager.coordinator
    result = {
        "hit_alignment": int(coordinator.scheduler_block_size),
        "prefix_caching": bool(engine.vllm_config.cache_config.enable_prefix_caching),
        "window": drafter.window,
        "num_speculative_tokens": drafter.num_speculative_tokens,
    }
    for wave in ("warm", "hits"):
        drafter.reset_counters()
        sight = FirstSight(drafter)
        observe_steps(drafter, sight)
        outputs, cached, steps = run_wave(engine, all_prompts, WAVES[wave], MAX_TOKENS)
        observe_steps(drafter, None)
        result[wave] = {
            "outputs": outputs,
            "num_cached_tokens": cached,
            "first_position": sight.first,
            "holey_steps": sight.holey_steps,
            "steps": steps,
            "counters": drafter.counters.as_dict(),
            "oracle": score(target, all_prompts, outputs, dict.fromkeys(outputs, MAX_TOKENS)),
        }

    ids = WAVES["holes"]
    n_spec = drafter.num_speculative_tokens
    oracle = OracleDrafts(
        target, {r: all_prompts[r] for r in ids}, HOLES_MAX_TOKENS + n_spec + 1
    )
    drafter.reset_counters()
    replace_drafts(drafter, WindowSensitiveOracle(drafter, oracle))
    sight = FirstSight(drafter)
    observe_steps(drafter, sight)
    per_request = {}
    # One request at a time: each one's acceptance is its own (no shared counters).
    outputs, cached = {}, {}
    for rid in ids:
        before = drafter.counters.as_dict()
        out, hit, _ = run_wave(engine, all_prompts, [rid], HOLES_MAX_TOKENS)
        after = drafter.counters.as_dict()
        outputs.update(out)
        cached.update(hit)
        per_request[rid] = {
            k: after[k] - before[k] for k in ("verified_tokens", "accepted_tokens")
        }
    restore_drafts(drafter)
    observe_steps(drafter, None)
    result["holes"] = {
        "outputs": outputs,
        "num_cached_tokens": cached,
        "first_position": sight.first,
        "holey_steps": sight.holey_steps,
        "draft_steps": sight.steps,
        "acceptance": per_request,
        "oracle": score(target, all_prompts, outputs, dict.fromkeys(outputs, HOLES_MAX_TOKENS)),
    }
    return result


def main() -> int:
    args = model_and_out()
    plain = {**engine_kwargs(args.model, None, speculative=False), "max_model_len": MAX_MODEL_LEN}
    with PlainTarget(plain) as target:
        result = run(args.model, target)
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
