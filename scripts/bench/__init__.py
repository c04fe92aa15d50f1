"""Serving benchmark on `vllm bench serve`: `python -m scripts.bench --help` (repo root).

content: content-typed prompts; sweep: the levels, /metrics deltas, provenance; prometheus and
dspark: /metrics parsing (shared with the smoke check); report; ab: `make ab`. The roofline
beside every level is roofline.py; the micro-benchmarks (ragged, packed_prefill, proposer,
dsv4_cpu) run as `python -m scripts.bench.NAME`.
"""
