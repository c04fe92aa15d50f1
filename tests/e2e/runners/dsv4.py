"""Greedy generation with a tiny DeepSeek-V4 checkpoint in real vLLM on CPU (one engine).

Run from the repo root in a subprocess whose PYTHONPATH selects the vLLM tree (overlay
applied or not), or holds the stock Triton of the kernel oracle for ``--interpreter``:

  python -m tests.e2e.runners.dsv4 MODEL_DIR --out R.json [--lens 1,7,130,300]
         [--max-tokens 10] [--batched-tokens 64] [--interpreter]

It generates the prompts batched, then each prompt alone, with chunked prefill limited to
``--batched-tokens`` so steps mix prefill chunks and decodes, scores both by teacher forcing
with the same engine (the greedy oracle: every token must be the argmax given its own
prefix; token equality of batched and alone is reported, not required, since bf16 kernels
round differently per batch shape), and writes the tokens, the oracle's reports, the
engine settings that matter, what the scheduler did in the batched run (steps mixing
prefill chunks and decodes, prefills split over several steps), how often each DeepSeek-V4
CPU kernel was called, which of them are the overlay's torch versions, and the timings as
JSON. ``--interpreter`` runs vLLM's Triton kernels in Triton's interpreter instead of the
overlay's torch kernels (the "before" of the overlay, for timing only).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

from scripts.dev.triton_interpreter import use_triton_interpreter
from tests.support.greedy_oracle import teacher_force


def prompts_for(lens: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    """Deterministic token-id prompts (ids 16.. avoid the special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(n)] for n in lens]


# DeepSeek-V4 CPU kernels whose Python call sites are counted (module attribute lookups at
# call time: vllm._custom_ops for the indexer/attention, the compressor's own imports).
KERNELS = (
    "save_partial_states_cpu",
    "compress_norm_rope_store_cpu",
    "compress_norm_rope_store_indexer_cpu",
    "fused_indexer_q_rope_quant_cpu",
    "fp8_paged_mqa_logits_cpu",
    "topk_transform_512_cpu",
)


def count_kernel_calls() -> dict[str, int]:
    """Wrap the kernels' Python call sites; the returned dict fills in as the model runs."""
    import importlib

    calls = dict.fromkeys(KERNELS, 0)
    for mod_name in ("vllm._custom_ops", "vllm.models.deepseek_v4.cpu.cpu_compressor"):
        mod = importlib.import_module(mod_name)
        for name in KERNELS:
            fn = getattr(mod, name, None)
            if fn is None:
                continue

            def counted(*args, _fn=fn, _name=name, **kwargs):
                calls[_name] += 1
                return _fn(*args, **kwargs)

            setattr(mod, name, counted)
    return calls


def record_schedule(llm) -> list[dict[str, int]]:
    """Per engine step of ``llm``: requests in prefill (and of those, chunks that leave part
    of the prompt for a later step) and decoding requests."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    steps: list[dict[str, int]] = []
    schedule = scheduler.schedule

    def recorded(*args, **kwargs):
        before = {
            rid: (r.num_computed_tokens, r.num_prompt_tokens)
            for rid, r in scheduler.requests.items()
        }
        out = schedule(*args, **kwargs)
        step = {"prefill": 0, "partial_prefill": 0, "decode": 0}
        for rid, n in out.num_scheduled_tokens.items():
            done, prompt = before[rid]
            if done < prompt:
                step["prefill"] += 1
                step["partial_prefill"] += int(done + n < prompt)
            else:
                step["decode"] += 1
        if out.num_scheduled_tokens:
            steps.append(step)
        return out

    scheduler.schedule = recorded
    return steps


def torch_kernels() -> list[str] | None:
    """The ``_C`` kernels the overlay registered as torch versions (None: no overlay)."""
    try:
        from vllm.models.deepseek_v4.cpu import torch_compressor_ops, torch_ops
    except ImportError:
        return None
    return sorted(
        torch_ops.MISSING_BEFORE_REGISTRATION + torch_compressor_ops.MISSING_BEFORE_REGISTRATION
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--lens", default="1,7,130,300")
    p.add_argument("--max-tokens", type=int, default=10)
    p.add_argument("--batched-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--interpreter", action="store_true",
                   help="vLLM's Triton kernels in the interpreter (stock Triton on PYTHONPATH)")
    a = p.parse_args(argv)
    if a.interpreter:
        use_triton_interpreter()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    lens = [int(x) for x in a.lens.split(",")]
    vocab = json.loads((a.model / "config.json").read_text())["vocab_size"]
    token_prompts = prompts_for(lens, vocab)
    t0 = time.perf_counter()
    llm = LLM(
        model=str(a.model),
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=a.max_model_len,
        max_num_batched_tokens=a.batched_tokens,
        max_num_seqs=8,
        enable_chunked_prefill=True,
        enable_prefix_caching=False,
        seed=0,
    )
    t1 = time.perf_counter()
    sched = llm.llm_engine.vllm_config.scheduler_config
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in token_prompts]
    calls = count_kernel_calls()
    steps = record_schedule(llm)
    tg, cg = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    t2, c2 = time.perf_counter(), time.process_time()
    batched_steps = list(steps)
    batched = [list(o.outputs[0].token_ids) for o in outs]
    single = [
        list(llm.generate([pr], params, use_tqdm=False)[0].outputs[0].token_ids) for pr in prompts
    ]
    t3, c3 = time.perf_counter(), time.process_time()
    oracle = {
        "batched": asdict(teacher_force(llm, token_prompts, batched, reference_outputs=single)),
        "single": asdict(teacher_force(llm, token_prompts, single)),
    }
    report = {
        "lens": lens,
        "batched": batched,
        "single": single,
        "oracle": oracle,
        "chunked_prefill": bool(sched.enable_chunked_prefill),
        "max_num_batched_tokens": int(sched.max_num_batched_tokens),
        "batched_steps": batched_steps,
        "kernel_calls": calls,
        "torch_kernels": torch_kernels(),
        "interpreter": a.interpreter,
        "seconds": {"init": t1 - t0, "generate_batched": t2 - tg, "generate_single": t3 - t2},
        # CPU time of this process (all its threads): less sensitive to other load than wall.
        "cpu_seconds": {"generate_batched": c2 - cg, "generate_single": c3 - c2},
    }
    a.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
