"""Serving benchmark on `vllm bench serve`: `python -m scripts.bench --help` (repo root).

The sweep: content (content-typed prompts), sweep (levels, provenance), levels (/metrics deltas;
parsing lives in scripts/node/metrics.py, shared with the health check), report, ab (`make ab`).
figures writes every benchmark's JSON + PNG. The other modules are single-module benchmarks, run
as `python -m scripts.bench.NAME` (scripts/bench/README.md).
"""
