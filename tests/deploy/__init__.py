"""Deployment tests: docker image and compose, entrypoint, preflight, security, set-up, rehearsal node."""
