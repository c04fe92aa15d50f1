"""Project tools, run from the repo root as modules: `python -m scripts.demo`, `python -m scripts.bench.ragged`.

Top level: the user commands (apply_overlay, recipe, serve, smoke, demo, rehearse; preflight.sh).
node/: per-node policy; rehearsal/: parts of `make rehearse`; setup/: the venv; tiny/: the tiny
checkpoint and its trained draft; verify/: the verification harness; bench/: benchmarks;
dev/: maintainer tools.
"""
