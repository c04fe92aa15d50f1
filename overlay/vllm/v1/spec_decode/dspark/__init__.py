"""DSpark block speculative decoding on vLLM's V1 runner.

``proposer`` is the entry point the runner patch selects; ``runner_glue`` is the only module
that knows the runner's internals. Each step is one host plan (``step_plan``, which uses
``context_store`` and ``packed_prefill``) followed by device work that never reads device
data back; ``rings`` holds the per-request context KV, ``graphs`` the draft block as CUDA
graphs, ``counters`` and ``metrics`` what the step reports. The draft model itself lives in
``vllm.models.deepseek_v4.common.dspark``; this package imports it, never the reverse.

Nothing is imported here, so the pure-torch modules load without the rest of vLLM.
"""
