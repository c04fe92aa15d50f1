#!/usr/bin/env python3
"""Per-step cost of the DSpark proposer inside real vLLM (CPU build), V1 runner.

Runs an in-process engine on the tiny DeepSeek-V4-DSpark checkpoint with the recipe
profile's demo settings (cpu-tiny: k=4, 64-token chunked prefill) and 8 prompts of 1 to
300 tokens, so steps mix prefill chunks and verify rows,
and wraps ``DSparkProposer.propose``. Two passes over the same workload:

1. counting: per ``propose`` call, the top-level aten ops (torch profiler: ``aten::``
   events without an ``aten::`` parent) and the data-dependent host reads (a torch
   function mode that sees every ``item``/``tolist``/``bool``/``int``/``float``/
   ``index``/``numpy`` of a tensor, every ``nonzero``/``unique``/``masked_select``/
   ``repeat_interleave`` without ``output_size`` (their output shape depends on data)
   and every ``torch.tensor``/``as_tensor`` built from Python data);
2. timing (no instruments): proposer ms per step and its share of the engine step.

On a GPU each host read is a blocking sync inside vLLM's async-scheduled step and each
top-level op an eager launch; on CPU this counts them, it does not time a GPU.

Writes ``bench-results/bench_proposer.json``; with ``--baseline OLD.json`` (an earlier
run, e.g. before a change) prints after/before ratios. Usage::

    HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \\
        .venv/bin/python -m scripts.bench.proposer [--profile cpu-tiny] [--max-tokens 24] [--baseline OLD.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT_DIR = REPO / "bench-results"

for key, value in {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}.items():
    os.environ.setdefault(key, value)

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from scripts.bench.figures import save_png, subplots, write_json_png  # noqa: E402
from scripts.tiny.ensure import ensure_tiny_model  # noqa: E402
from scripts.verify.engine import engine_kwargs, make_engine  # noqa: E402
from scripts.verify.prompts import MIXED_LENGTHS, random_prompts  # noqa: E402

# Tensor methods that copy tensor data into Python: a device-to-host sync on a GPU.
_READS = {"item", "tolist", "__bool__", "__int__", "__index__", "__float__", "numpy"}
# Ops whose output shape depends on the data: the host must wait for the values.
_DATA_SHAPED = {"nonzero", "unique", "unique_consecutive", "masked_select", "argwhere"}
# Tensors built from Python data: a (pageable) host-to-device copy per call on a GPU.
_FROM_PYTHON = {"tensor", "as_tensor"}


def _tensor_repeats(args, kwargs) -> bool:
    """``repeat_interleave`` reads its repeats only when they are a tensor of counts."""
    if "repeats" in kwargs:
        return isinstance(kwargs["repeats"], torch.Tensor)
    if len(args) == 1:  # repeat_interleave(repeats): the counts themselves
        return True
    return len(args) > 1 and isinstance(args[1], torch.Tensor)


def _caller() -> str:
    """file:line of the nearest frame outside torch (where the read is written)."""
    frame = sys._getframe(2)
    while frame is not None and "/torch/" in frame.f_code.co_filename:
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"


class HostReadCounter(TorchFunctionMode):
    """Counts the calls that would make the host wait for the device, by kind."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: collections.Counter[str] = collections.Counter()
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        data_shaped = name in _DATA_SHAPED or (
            name == "repeat_interleave"
            and kwargs.get("output_size") is None
            and _tensor_repeats(args, kwargs)
        )
        if name in _READS or data_shaped or name in _FROM_PYTHON:
            self.kinds[name] += 1
            self.sites[_caller()] += 1
        return func(*args, **kwargs)


BLOCK = "dspark_draft_block"
# Ops that only make a new view of memory, allocate it, or return their input: on a GPU
# none of them launches a kernel. A top-level op "launches" when some op in its subtree
# is not one of these (a real dtype cast, a copying reshape and all arithmetic do).
_METADATA_OPS = frozenset(
    "aten::" + name
    for name in (
        "view _unsafe_view reshape _reshape_alias slice select unsqueeze squeeze expand "
        "flatten unflatten alias as_strided split split_with_sizes unbind chunk narrow "
        "permute transpose t detach resolve_conj resolve_neg lift_fresh empty "
        "empty_strided to _to_copy numpy"
    ).split()
)


def _launches(event) -> bool:
    """Whether the op or one below it does work on the data (see ``_METADATA_OPS``)."""
    return event.name not in _METADATA_OPS or any(_launches(c) for c in event.cpu_children)


def top_level_aten_ops(prof, by_name: collections.Counter | None = None) -> tuple[int, int, int]:
    """(all top-level aten ops, those inside the draft block, those that launch work).

    The draft block has static shapes and no host reads: on a GPU it is one CUDA graph
    replay, so only the ops outside it launch one by one. ``by_name`` (if given) is
    updated with each top-level op's name, prefixed ``block:`` inside the draft block.
    """
    total = in_block = launching = 0
    for event in prof.events():
        parent = event.cpu_parent
        if not event.name.startswith("aten::") or (
            parent is not None and parent.name.startswith("aten::")
        ):
            continue
        total += 1
        launching += _launches(event)
        while parent is not None and parent.name != BLOCK:
            parent = parent.cpu_parent
        in_block += parent is not None
        if by_name is not None:
            by_name[("block:" if parent is not None else "") + event.name] += 1
    return total, in_block, launching


def run(engine, tag: str, max_tokens: int) -> list[float]:
    """Add the 8 prompts, step until done; returns each engine step's wall ms."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(random_prompts(MIXED_LENGTHS, seed=0)):
        engine.add_request(f"{tag}{i}", {"prompt_token_ids": ids}, params)
    step_ms = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        step_ms.append((time.perf_counter() - t0) * 1e3)
    return step_ms


def summarize(values: list[float]) -> dict:
    return {
        "median": statistics.median(values),
        "max": max(values),
        "min": min(values),
        "n": len(values),
    }


def plot(result: dict, path: Path) -> None:
    """Median ops per step (all, launching, outside the block), with the baseline's if any."""
    keys = [
        k
        for k in (
            "aten_ops_per_step",
            "aten_ops_launching_per_step",
            "aten_ops_outside_draft_block",
        )
        if k in result
    ]
    runs = [r for r in (result.get("baseline"), result) if r is not None]
    fig, ax = subplots(figsize=(7, 3.5))
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        values = [run.get(k, {}).get("median", 0) for k in keys]
        ax.bar([j + i * width for j in range(len(keys))], values, width, label=run["label"])
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(keys))])
    ax.set_xticklabels(["all top-level", "launching work", "outside draft block"])
    ax.set_ylabel("aten ops per propose() step (median)")
    ax.legend()
    save_png(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="cpu-tiny", help="recipe profile (engine settings)")
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: profile's)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--label", default="current", help="name stored in the JSON")
    ap.add_argument("--baseline", type=Path, help="an earlier JSON to compare against")
    ap.add_argument("--out", type=Path, default=OUT_DIR / "bench_proposer.json")
    args = ap.parse_args(argv)

    kwargs = engine_kwargs(args.profile, seed=0)
    model = ensure_tiny_model(args.model or Path(kwargs["model"]), train=False)
    engine = make_engine({**kwargs, "model": str(model)})
    drafter = engine.collective_rpc(lambda worker: worker.model_runner.drafter)[0]
    propose = drafter.propose
    ops, outside_block, launching, reads, propose_ms = [], [], [], [], []
    kinds, sites, op_names = collections.Counter(), collections.Counter(), collections.Counter()

    block = getattr(drafter, "draft_block", None)  # absent before the plan/run split
    if block is not None:

        def labelled_block(*a, **kw):
            with torch.profiler.record_function(BLOCK):
                return block(*a, **kw)

        drafter.draft_block = labelled_block

    def counting(*a, **kw):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with HostReadCounter() as counter:
                out = propose(*a, **kw)
        total, in_block, launches = top_level_aten_ops(prof, op_names)
        ops.append(total)
        launching.append(launches)
        outside_block.append(total - in_block)
        reads.append(sum(counter.kinds.values()))
        kinds.update(counter.kinds)
        sites.update(counter.sites)
        return out

    def timing(*a, **kw):
        t0 = time.perf_counter()
        out = propose(*a, **kw)
        propose_ms.append((time.perf_counter() - t0) * 1e3)
        return out

    drafter.propose = counting
    run(engine, "count", args.max_tokens)
    drafter.propose = timing
    step_ms = run(engine, "time", args.max_tokens)
    drafter.propose = propose

    result = {
        "label": args.label,
        "machine": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "workload": {
            "prompt_lens": list(MIXED_LENGTHS),
            "chunk": kwargs["max_num_batched_tokens"],
            "k": kwargs["speculative_config"]["num_speculative_tokens"],
            "max_tokens": args.max_tokens,
        },
        "steps": len(ops),
        "aten_ops_per_step": summarize(ops),
        "aten_ops_outside_draft_block": summarize(outside_block),
        "aten_ops_launching_per_step": summarize(launching),
        "host_reads_per_step": summarize(reads),
        "aten_ops_by_name_per_step": {
            name: round(count / len(ops), 2) for name, count in op_names.most_common()
        },
        "host_reads_by_kind": dict(kinds),
        "host_reads_by_site": dict(sites.most_common()),
        "propose_ms": summarize(propose_ms),
        "engine_step_ms": summarize(step_ms),
        "propose_share_of_step": sum(propose_ms) / sum(step_ms),
        "counters": drafter.counters.as_dict(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(f"{result['steps']} propose() steps ({args.label})")
    keys = (
        "aten_ops_per_step",
        "aten_ops_launching_per_step",
        "aten_ops_outside_draft_block",
        "host_reads_per_step",
    )
    for key in (*keys, "propose_ms", "engine_step_ms"):
        s = result[key]
        print(f"  {key:28s} median {s['median']:8.2f}  max {s['max']:8.2f}")
    print(f"  host reads by kind   {dict(kinds)}")
    print(f"  host reads by site   {dict(sites.most_common())}")
    print(f"  proposer share of the engine step: {result['propose_share_of_step']:.1%}")
    if args.baseline is not None:
        old = json.loads(args.baseline.read_text())
        print(f"vs {old['label']} ({args.baseline}):")
        for key in (*keys, "propose_ms"):
            if key not in old:
                continue
            before, after = old[key]["median"], result[key]["median"]
            print(f"  {key:28s} {before:8.2f} -> {after:8.2f}  ({after / max(before, 1e-9):.2f}x)")
        result["baseline"] = old
    write_json_png(args.out, result, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
