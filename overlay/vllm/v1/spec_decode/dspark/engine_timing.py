"""Timing one verify step with the runner's own dummy forwards, for ``cost_table``."""

from __future__ import annotations

import time

import torch
from vllm.v1.spec_decode.dspark import cost_table

__all__ = ["table_settings", "time_verify_step"]


def table_settings(proposer) -> dict:
    """What ``proposer``'s measured table depends on (its cache key)."""
    import vllm

    vc = proposer.vllm_config
    mc = vc.model_config
    return {
        "model": mc.model, "revision": mc.revision, "dtype": str(mc.dtype),
        "kv_cache_dtype": vc.cache_config.cache_dtype, "tp": proposer.tp_size,
        "device": cost_table.device_name(proposer.device.type),
        "max_num_seqs": proposer.max_num_seqs,
        "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
        "max_model_len": proposer.max_model_len, "k": proposer.num_speculative_tokens,
        "row_budget": proposer.row_budget, "sampling": proposer.probabilistic,
        "attention": str(getattr(getattr(vc, "attention_config", None), "backend", None)),
        "vllm": vllm.__version__,
    }


def time_verify_step(proposer, runner, requests: int, width: int) -> float:
    """ms of one verify step with ``requests`` requests of ``width`` drafts each."""
    from vllm.config import CUDAGraphMode

    rows = requests * (width + 1)
    context = min(proposer.max_model_len, cost_table.CONTEXT_TOKENS)
    uniform = runner.uniform_decode_query_len
    runner.uniform_decode_query_len = width + 1  # R requests of width + 1 rows each
    try:
        start = time.perf_counter()
        hidden, _ = runner._dummy_run(
            rows, cudagraph_runtime_mode=CUDAGraphMode.NONE, force_attention=True,
            uniform_decode=True, skip_eplb=True, randomize_inputs=True,
            profile_seq_lens=context,
        )
        with torch.inference_mode():
            runner.model.compute_logits(hidden[:rows])
            proposer.dummy_block(next(s for s in proposer.draft_sizes if s >= requests))
        if proposer.device.type == "cuda":
            torch.cuda.synchronize(proposer.device)
        return (time.perf_counter() - start) * 1e3
    finally:
        runner.uniform_decode_query_len = uniform
