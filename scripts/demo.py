"""`make demo`: DSpark speculative decoding inside real vLLM (CPU build), end to end.

1. Generates the tiny DeepSeek-V4-DSpark checkpoint if it is missing.
2. Starts the plain target (no speculation) in a child process: it decodes the greedy
   reference, drafts the oracle continuations and scores every output by teacher forcing.
3. Decodes a batch of prompts of very different lengths (1 to ~300 tokens) with DSpark on
   vLLM's V1 runner (the overlay's proposer), with the cpu-tiny profile's demo chunk size so
   engine steps mix prefill chunks and verify rows.
4. Runs the batch once more with "oracle" drafts (test hook): the target's own greedy
   continuation of each request's current prefix, so the verify path accepts whole blocks
   (the random tiny draft model itself almost never guesses right).
5. Prints the outputs, the teacher-forcing verdict (``lossless: YES/NO``, worst deficit,
   epsilon), token-identical counts against the greedy reference (information only: bf16
   kernels round differently under different batch shapes), the proposer's flat vs ragged
   step counts, drafted/accepted tokens and tokens/s. Exits 1 only on a real violation.

Usage: python scripts/demo.py [--profile cpu-tiny] [--model DIR] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from oracle_drafts import OracleDrafts
from plain_target import ENGINE_ENV_DEFAULTS, PlainTarget
from teacher_forcing import report

import recipe

REPO = Path(__file__).resolve().parent.parent

for key, value in ENGINE_ENV_DEFAULTS.items():  # this process runs an engine too
    os.environ.setdefault(key, value)

_TEXT = (
    "Speculative decoding drafts a block of tokens with a small model and lets the large "
    "model verify the whole block in one step. The draft keeps a window of context for "
    "every request, keyed by the request, so requests may arrive, finish and move around "
    "the batch without mixing their histories. "
)


def prompts(tokenizer) -> list[list[int]]:
    """Eight prompts from 1 to ~300 tokens."""
    ids = tokenizer.encode(_TEXT * 12, add_special_tokens=False)
    lengths = [1, 4, 11, 27, 64, 130, 201, 300]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return [(bos + ids)[:n] for n in lengths]


def ensure_model(path: Path) -> Path:
    if (path / "config.json").exists():
        return path
    cmd = [sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), "--dspark"]
    print(f">> generating the tiny DeepSeek-V4-DSpark checkpoint: {path}")
    subprocess.run([*cmd, "--out", str(path), "--quiet", "--force"], check=True)
    return path


def make_engine(engine_kwargs: dict):
    """An in-process V1 engine with DSpark and the demo's chunked prefill."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(**engine_kwargs, seed=0))
    if not engine.vllm_config.scheduler_config.enable_chunked_prefill:
        raise SystemExit(
            "vLLM turned chunked prefill off for DeepSeek-V4 on this CPU; the overlay keeps "
            "it on: is it applied (make setup)?"
        )
    return engine


def generate(engine, batch, max_tokens: int) -> tuple[list[list[int]], float, int]:
    """Decode ``batch`` (token-id lists) greedily; returns (outputs, seconds, steps)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, toks in enumerate(batch):
        engine.add_request(f"p{i}", {"prompt_token_ids": toks}, sp)
    outputs: dict[str, list[int]] = {}
    steps, t0 = 0, time.monotonic()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
    seconds = time.monotonic() - t0
    return [outputs[f"p{i}"] for i in range(len(batch))], seconds, steps


def print_outputs(tok, batch, reference, runs) -> None:
    """One line per prompt: worst deficit and token identity per run, first tokens."""
    names = "  ".join(f"{name + ' deficit':>14} {'same':5}" for name, _, _ in runs)
    print(f"{'prompt':>6} {'len':>4}  {names}  output with oracle drafts (first tokens)")
    for i, p in enumerate(batch):
        cells = "  ".join(
            f"{rep.request_worst[i]:14.4f} {str(outs[i] == reference[i]):5}"
            for _, outs, rep in runs
        )
        last = runs[-1][1][i]
        text = tok.decode(last[:12]).replace("\n", " ")
        print(f"{'p' + str(i):>6} {len(p):>4}  {cells}  {last[:6]} {text[:32]!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="cpu-tiny", help="recipe profile (engine settings)")
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: profile's)")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)

    profile = recipe.load_profile(args.profile)
    spec_kwargs = recipe.engine_args(profile, demo=True)
    # The plain target runs the same settings: its greedy run is the no-speculation baseline.
    target_kwargs = recipe.engine_args(profile, speculative=False, demo=True)
    model = ensure_model((args.model or Path(spec_kwargs["model"])).resolve())
    spec_kwargs["model"] = target_kwargs["model"] = str(model)
    chunk = spec_kwargs["max_num_batched_tokens"]
    num_spec = spec_kwargs["speculative_config"]["num_speculative_tokens"]
    print(f">> model: {model.relative_to(REPO) if model.is_relative_to(REPO) else model}")
    print(f">> profile {profile['name']}: {chunk}-token chunked prefill, {num_spec} drafts/step")


    print(">> [1/3] greedy decoding without speculation (plain target, child process)")
    with PlainTarget({**target_kwargs, "seed": 0}) as target:
        engine = make_engine(spec_kwargs)
        tok = engine.get_tokenizer()
        batch = prompts(tok)
        t0 = time.monotonic()
        reference = target.greedy(batch, args.max_tokens)
        base_seconds = time.monotonic() - t0

        print(">> [2/3] DSpark on vLLM's V1 runner (draft model of the checkpoint's mtp.* stages)")
        drafter = engine.collective_rpc(lambda worker: worker.model_runner.drafter)[0]
        drafter.reset_counters()
        outputs, seconds, steps = generate(engine, batch, args.max_tokens)
        real = drafter.counters.as_dict()

        print(">> [3/3] DSpark with oracle drafts (the target's greedy continuation, test hook)")
        drafter.reset_counters()
        oracle_hook = OracleDrafts(
            target, {f"p{i}": p for i, p in enumerate(batch)}, args.max_tokens + num_spec + 1
        )
        drafter.draft_override = oracle_hook
        oracle_outputs, oracle_seconds, oracle_steps = generate(engine, batch, args.max_tokens)
        drafter.draft_override = None
        oracle = drafter.counters.as_dict()

        print(">> scoring every output by teacher forcing with the plain target")
        real_rep = target.teacher_force(batch, outputs, reference)
        oracle_rep = target.teacher_force(batch, oracle_outputs, reference)

    n = len(batch)
    n_tokens = n * args.max_tokens
    print()
    print_outputs(
        tok, batch, reference, [("real", outputs, real_rep), ("oracle", oracle_outputs, oracle_rep)]
    )
    both = report([real_rep.request_worst, oracle_rep.request_worst], real_rep.epsilon)
    print()
    print(
        f"lossless: {'YES' if both.ok else 'NO'} (teacher forcing: every emitted token is the "
        f"plain target's argmax given its run's own prefix, within epsilon "
        f"{both.epsilon:g} nats of the best)"
    )
    for name, rep in (("real drafts", real_rep), ("oracle drafts", oracle_rep)):
        print(f"  {name + ':':15}{rep.summary(n)}")
        for i, j, d in rep.violations[:5]:
            print(f"    VIOLATION: prompt p{i}, output token {j}: {d:.3f} nats below the best")
    print(
        "  token-identical counts equality with greedy decoding without speculation: "
        "information only (bf16 kernels round differently under different batch shapes)"
    )
    print(
        f"engine steps: DSpark {steps} "
        f"(proposer: {real['flat_steps']} flat + {real['ragged_steps']} ragged, "
        f"{real['packed_steps']} with packed prefill; {chunk}-token chunked prefill), "
        f"oracle {oracle_steps} ({oracle['flat_steps']} flat + {oracle['ragged_steps']} ragged)"
    )
    print(
        f"context rows ingested: {real['ingested_rows']} (rejected verify rows, never "
        f"stored: {real['rejected_rows']}; drafts discarded while in chunked prefill: "
        f"{real['discarded_drafts']})"
    )
    print(
        f"drafted/accepted: random draft {real['drafted_tokens']} drafted, "
        f"{real['accepted_tokens']}/{real['verified_tokens']} verified accepted; "
        f"oracle {oracle['accepted_tokens']}/{oracle['verified_tokens']} accepted "
        f"({oracle['accepted_tokens'] / max(1, oracle_steps):.1f} per step; continuation "
        f"recomputed after a near-tie {oracle_hook.recomputed} times)"
    )
    print(
        f"tokens/s ({n_tokens} output tokens, 2 CPU cores): no speculation "
        f"{n_tokens / base_seconds:.1f}, DSpark {n_tokens / seconds:.1f}, "
        f"DSpark+oracle drafts {n_tokens / oracle_seconds:.1f} (its time includes the plain "
        "target computing the oracle drafts; all three swing with load on shared cores)"
    )
    return 0 if both.ok else 1


if __name__ == "__main__":
    sys.exit(main())
