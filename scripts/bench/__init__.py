"""Serving benchmark for vLLM's OpenAI server: `python -m scripts.bench --help` (from the repo root).

Modules, one job each: stream (one streaming request), server (discovery, tokenizer,
/metrics), prompts (exact-length cold prompts), sweep (the concurrency x prompt-length loop),
stats, prometheus (counters and per-level deltas), schema (the result format and its
validation), provenance (recipe, pins, machine), report (Markdown, plots), compare (two
results side by side), vllm_bench (vLLM's own `vllm bench serve` on the same load).
"""
