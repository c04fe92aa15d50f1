"""DSpark block speculative decoding on vLLM's V1 runner (overlay/README.md).

``proposer`` is the entry point the runner patch selects; ``runner_glue`` is the only module
that knows the runner's internals. The draft model lives in
``vllm.models.deepseek_v4.common.dspark``; this package imports it, never the reverse.
Nothing is imported here, so the pure-torch modules load without the rest of vLLM.
"""
