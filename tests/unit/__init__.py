"""Unit tests: no vLLM import, seconds each."""
