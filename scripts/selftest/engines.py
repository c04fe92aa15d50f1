"""The self-test's two engines: the profile's DSpark engine and its plain target.

Both take the profile's serving settings (runner, async scheduling, prefix caching, KV
dtype, probabilistic drafting, k, CUDA graphs on CUDA) with only what the self-test must
change: the shape-true tiny checkpoint, a short context, 64-token prefill chunks (so steps
mix prefill chunks and verify rows) and the tensor-parallel size asked for. The plain
target runs in a child process (``PlainTarget``), the DSpark engine in this one.
"""

from __future__ import annotations

from pathlib import Path

from scripts import recipe

CHUNK = 64  # prefill chunk: prompts longer than this are prefilled beside verify rows
MAX_MODEL_LEN = 1024


def engine_kwargs(profile: dict, model: Path, tp: int, speculative: bool) -> dict:
    """``vllm.LLM`` / ``EngineArgs`` keywords: the profile's, adapted as described above."""
    kwargs = recipe.engine_args(profile, speculative=speculative)
    kwargs.update(
        model=str(model),
        tensor_parallel_size=tp,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=CHUNK * 4 if tp > 1 else CHUNK,
        seed=0,
        trust_remote_code=False,
    )
    kwargs.pop("revision", None)
    if profile["device"] == "cpu":
        kwargs["enforce_eager"] = True
    else:
        kwargs["gpu_memory_utilization"] = profile["serving"]["gpu_memory_utilization"]
    return kwargs


def kernels(model) -> dict[str, list[str]]:
    """Class names of the FP8 linear kernels and MoE experts that ``model`` runs."""
    linear, experts = set(), set()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if hasattr(method, "fp8_linear"):
            linear.add(type(method.fp8_linear).__name__)
        kernel = getattr(method, "moe_kernel", None)
        if kernel is not None:
            experts.add(type(kernel.fused_experts).__name__)
    return {"fp8_linear": sorted(linear), "moe_experts": sorted(experts)}


def acceptance(engine) -> dict:
    """vLLM's own speculative-decoding counters: drafting steps and acceptance length."""
    drafts = accepted = 0.0
    for metric in engine.get_metrics():
        name = metric.name.removesuffix("_total")
        if name == "vllm:spec_decode_num_drafts":
            drafts += float(metric.value)
        elif name == "vllm:spec_decode_num_accepted_tokens":
            accepted += float(metric.value)
    return {"drafts": int(drafts), "length": 1.0 + accepted / drafts if drafts else 0.0}
