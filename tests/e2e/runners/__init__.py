"""Programs the end-to-end tests start as subprocesses: python -m tests.e2e.runners.NAME (repo root)."""
