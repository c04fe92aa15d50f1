"""End-to-end tests: real vLLM engines and servers on CPU (marker e2e)."""
