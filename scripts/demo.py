#!/usr/bin/env python3
"""`make demo`: DSpark speculative decoding inside real vLLM (CPU build), end to end.

1. Generates the tiny DeepSeek-V4-DSpark checkpoint if it is missing.
2. Decodes a batch of prompts of very different lengths (1 to ~300 tokens) greedily
   without speculation (in a child process, so the two engines never share state).
3. Decodes the same batch with DSpark on vLLM's V1 runner (the overlay's proposer), with
   64-token chunked prefill so engine steps mix prefill chunks and verify rows; prints: the
   outputs, whether they equal the greedy outputs token for token, the proposer's flat vs
   ragged step counts, drafted/accepted tokens, and tokens/s.
4. Runs the batch once more with "oracle" drafts (the known greedy continuation, through
   the proposer's test hook) to show the verify path accepting whole blocks: the random
   tiny draft model itself almost never guesses right.

Usage: python scripts/demo.py [--model models/tiny-dsv4-dspark] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "models" / "tiny-dsv4-dspark"
MAX_MODEL_LEN = 512
NUM_SPEC = 4

for key, value in {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}.items():
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


CHUNK = 64  # token budget per engine step: prefills are chunked and mixed with verify rows


def make_engine(model: Path, spec: bool):
    """An in-process V1 engine with 64-token chunked prefill."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    kwargs = {}
    if spec:
        kwargs["speculative_config"] = {"method": "dspark", "num_speculative_tokens": NUM_SPEC}
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=str(model),
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=8,
            max_num_batched_tokens=CHUNK,
            enable_prefix_caching=False,
            seed=0,
            **kwargs,
        )
    )
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


def baseline_child(model: Path, max_tokens: int, out: Path) -> None:
    engine = make_engine(model, spec=False)
    batch = prompts(engine.get_tokenizer())
    outputs, seconds, steps = generate(engine, batch, max_tokens)
    out.write_text(json.dumps({"outputs": outputs, "seconds": seconds, "steps": steps}))


def run_baseline(model: Path, max_tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "baseline.json"
        cmd = [
            sys.executable,
            __file__,
            "--model",
            str(model),
            "--max-tokens",
            str(max_tokens),
            "--_baseline-json",
            str(out),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit("baseline run (no speculation) failed")
        return json.loads(out.read_text())


def oracle_override(batch, continuation):
    """Test hook: draft the greedy continuation (what a perfect draft model would say)."""
    import torch

    full = {f"p{i}": batch[i] + continuation[i] for i in range(len(batch))}

    def override(*, req_ids, anchor_positions, anchor_tokens, drafts):
        out = drafts.clone()
        for i, rid in enumerate(req_ids):
            seq = full[rid.rsplit("-", 1)[0]]
            p = int(anchor_positions[i])
            out[i] = torch.tensor(
                [seq[q] if q < len(seq) else 0 for q in range(p + 1, p + 1 + out.shape[1])],
                dtype=out.dtype,
            )
        return out

    return override


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--_baseline-json", dest="baseline_json", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.baseline_json is not None:
        baseline_child(args.model, args.max_tokens, args.baseline_json)
        return 0

    model = ensure_model((args.model or DEFAULT_MODEL).resolve())
    print(f">> model: {model.relative_to(REPO) if model.is_relative_to(REPO) else model}")
    print(">> [1/3] greedy decoding without speculation (baseline engine, child process)")
    base = run_baseline(model, args.max_tokens)

    from vllm.v1.spec_decode.dspark_proposer import DSparkCounters

    print(">> [2/3] DSpark on vLLM's V1 runner (draft model of the checkpoint's mtp.* stages)")
    engine = make_engine(model, spec=True)
    tok = engine.get_tokenizer()
    batch = prompts(tok)
    drafter = engine.collective_rpc(lambda worker: worker.model_runner.drafter)[0]
    drafter.counters = DSparkCounters()
    outputs, seconds, steps = generate(engine, batch, args.max_tokens)
    real = drafter.counters.as_dict()

    print(">> [3/3] DSpark with oracle drafts (test hook: the known greedy continuation)")
    drafter.counters = DSparkCounters()
    drafter.draft_override = oracle_override(batch, base["outputs"])
    oracle_outputs, oracle_seconds, oracle_steps = generate(engine, batch, args.max_tokens)
    drafter.draft_override = None
    oracle = drafter.counters.as_dict()

    ref = [o[: args.max_tokens] for o in base["outputs"]]
    n_tokens = len(batch) * args.max_tokens
    base_steps = base["steps"]
    print()
    print(f"{'prompt':>6} {'len':>4}  {'equal':5}  output (first tokens, decoded)")
    for i, (p, out) in enumerate(zip(batch, outputs, strict=True)):
        text = tok.decode(out[:12]).replace("\n", " ")
        print(f"{'p' + str(i):>6} {len(p):>4}  {str(out == ref[i]):5}  {out[:8]} {text[:40]!r}")
    lossless = outputs == ref and oracle_outputs == ref
    print()
    print(
        f"lossless (DSpark greedy == greedy without speculation, token for token): "
        f"{'YES' if lossless else 'NO'}"
    )
    print(f"  real drafts:   {outputs == ref}   oracle drafts: {oracle_outputs == ref}")
    print(
        f"engine steps: baseline {base_steps}, DSpark {steps} "
        f"(proposer: {real['flat_steps']} flat + {real['ragged_steps']} ragged, "
        f"{real['packed_steps']} with packed prefill; {CHUNK}-token chunked prefill), "
        f"oracle {oracle_steps} "
        f"({oracle['flat_steps']} flat + {oracle['ragged_steps']} ragged)"
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
        f"({oracle['accepted_tokens'] / max(1, oracle_steps):.1f} per step)"
    )
    print(
        f"tokens/s ({n_tokens} output tokens, 2 CPU cores): baseline "
        f"{n_tokens / base['seconds']:.1f}, DSpark {n_tokens / seconds:.1f}, "
        f"DSpark+oracle drafts {n_tokens / oracle_seconds:.1f}"
    )
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main())
