"""The self-test's checks, run in order against one DSpark engine and its plain target.

Each check returns ``(status, detail)``; the runner records it. Greedy outputs are judged by
teacher forcing with the plain target (``scripts/verify``), never by a value this code
computes itself; sampled requests must complete and a seeded one must give the same tokens
beside other neighbours. The CUDA-only checks return ``SKIPPED`` on other devices.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict

GREEDY_LENGTHS = (3, 17, 90, 200)  # with 64-token chunks: prefill chunks beside verify rows
GREEDY_TOKENS = 16
SAMPLED_TOKENS = 12
DECODE_BATCH, DECODE_TOKENS = 4, 24
MIN_ACCEPTANCE = 1.5


def prompts(lengths, vocab: int, seed: int) -> list[list[int]]:
    """Token ids of ordinary tokens (past the specials, before the chat tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(9, vocab - 3) for _ in range(n)] for n in lengths]


def _params(max_tokens: int, temperature: float = 0.0, seed: int | None = None, **kw):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          ignore_eos=True, **kw)


def run_batch(engine, requests: dict) -> tuple[dict[str, list[int]], list[float]]:
    """Add ``requests`` (id -> (prompt, params)), step to completion: outputs, step seconds."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    outputs: dict[str, list[int]] = {}
    steps = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        steps.append(time.perf_counter() - t0)
    return outputs, steps


def _drafter_counters(worker) -> dict:
    return worker.model_runner.drafter.counters.as_dict()


def _reset_counters(worker) -> None:
    worker.model_runner.drafter.reset_counters()


def greedy_lossless(engine, target, vocab: int) -> tuple[str, str, dict]:
    """Greedy batch mixing prefill chunks and verify rows, scored by teacher forcing."""
    from scripts.selftest.engines import acceptance

    batch = prompts(GREEDY_LENGTHS, vocab, seed=1)
    engine.collective_rpc(_reset_counters)
    before = acceptance(engine)
    outs, _ = run_batch(engine, {f"g{i}": (p, _params(GREEDY_TOKENS)) for i, p in enumerate(batch)})
    outputs = [outs[f"g{i}"] for i in range(len(batch))]
    after = acceptance(engine)
    counters = engine.collective_rpc(_drafter_counters)[0]
    rep = target.teacher_force(batch, outputs)
    drafts = after["drafts"] - before["drafts"]
    accepted = (after["length"] - 1) * after["drafts"] - (before["length"] - 1) * before["drafts"]
    length = 1.0 + accepted / drafts if drafts else 0.0
    facts = {"worst_deficit": rep.worst_deficit, "epsilon": rep.epsilon,
             "violations": rep.violations[:5], "acceptance_length": length,
             "drafting_steps": drafts, "counters": counters}
    problems = []
    if not rep.ok:
        problems.append(f"{len(rep.violations)} tokens above epsilon")
    if any(len(o) != GREEDY_TOKENS for o in outputs):
        problems.append("an output is short")
    if counters["ragged_steps"] == 0:
        problems.append("no step mixed prefill chunks and verify rows")
    if counters["rejected_rows"] == 0:
        problems.append("no draft was rejected: the rejection path did not run")
    detail = (f"worst deficit {rep.worst_deficit:.3f} nats (epsilon {rep.epsilon:g}), "
              f"{len(batch)} requests of {'/'.join(map(str, GREEDY_LENGTHS))} prompt tokens, "
              f"{counters['ragged_steps']} mixed steps, {counters['accepted_tokens']} drafts "
              f"accepted, {counters['rejected_rows']} rejected")
    return ("FAIL" if problems else "PASS"), "; ".join([detail, *problems]), facts


def acceptance_check(length: float, drafts: int) -> tuple[str, str]:
    ok = length > MIN_ACCEPTANCE
    return ("PASS" if ok else "FAIL"), (
        f"acceptance length {length:.2f} over {drafts} drafting steps "
        f"({'above' if ok else 'not above'} {MIN_ACCEPTANCE}: accepted drafts exercised)")


def sampled(engine, vocab: int) -> tuple[str, str]:
    """Sampled requests complete; a seeded one reproduces beside other neighbours."""
    p = prompts((5, 40, 70), vocab, seed=2)
    seeded = _params(SAMPLED_TOKENS, temperature=0.8, seed=1234, top_p=0.95)
    first, _ = run_batch(engine, {
        "s": (p[0], seeded),
        "u0": (p[1], _params(SAMPLED_TOKENS, temperature=1.0, top_k=50)),
        "u1": (p[2], _params(SAMPLED_TOKENS, temperature=0.7, top_p=0.9)),
    })
    second, _ = run_batch(engine, {
        "s2": (p[0], seeded),
        "u2": (p[2], _params(SAMPLED_TOKENS, temperature=1.0)),
    })
    problems = [f"{rid} emitted {len(t)} tokens" for rid, t in {**first, **second}.items()
                if len(t) != SAMPLED_TOKENS]
    if first["s"] != second["s2"]:
        problems.append(f"seeded request differs: {first['s']} vs {second['s2']}")
    if problems:
        return "FAIL", "; ".join(problems)
    return "PASS", (f"5 sampled requests completed ({SAMPLED_TOKENS} tokens each); the seeded "
                    "one gave the same tokens beside other neighbours")


def mixed_batch(engine, vocab: int) -> None:
    """Greedy and seeded sampled requests whose prefills are chunked beside verify rows."""
    p = prompts(GREEDY_LENGTHS, vocab, seed=4)
    run_batch(engine, {
        f"m{i}": (prompt, _params(GREEDY_TOKENS, temperature=0.8 * (i % 2), seed=i))
        for i, prompt in enumerate(p)
    })


def step_times(engine, target, vocab: int) -> tuple[float, float, float]:
    """(plain decode step ms, DSpark step ms, tokens per DSpark step) on a decode batch.

    Plain: the target's greedy decode of ``DECODE_TOKENS`` minus a 1-token run, per token.
    DSpark: the median engine step after the prefill step.
    """
    batch = prompts([8] * DECODE_BATCH, vocab, seed=3)
    target.greedy(batch, 1)  # warm
    t0 = time.perf_counter()
    target.greedy(batch, 1)
    t1 = time.perf_counter()
    target.greedy(batch, DECODE_TOKENS + 1)
    t2 = time.perf_counter()
    plain_ms = ((t2 - t1) - (t1 - t0)) / DECODE_TOKENS * 1e3
    reqs = {f"d{i}": (p, _params(DECODE_TOKENS)) for i, p in enumerate(batch)}
    _, steps = run_batch(engine, reqs)
    decode = steps[1:] or steps
    return plain_ms, statistics.median(decode) * 1e3, DECODE_TOKENS / len(decode)


def cuda_only(name: str, device: str) -> tuple[str, str] | None:
    """``SKIPPED`` with the reason on a non-CUDA device, else ``None`` (the check runs)."""
    if device != "cuda":
        return "SKIPPED", f"{name}: needs CUDA (device here: {device})"
    return None


def as_json(obj):
    return asdict(obj) if hasattr(obj, "__dataclass_fields__") else obj
