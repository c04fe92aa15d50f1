"""Integration tests: vLLM imported (the overlay applied to the venv), no engine."""
