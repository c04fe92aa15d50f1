"""Per-node policy for the two-Spark deployment, reached through `scripts/recipe.py` subcommands.

report (PASS/WARN/FAIL lines in preflight's format), env (the node .env file: parsing and the
schema of its variables), cache (is the profile's model complete in the HF cache). The
hardware probes (sysfs GIDs, MTU, nvidia-smi, docker, ports) stay in scripts/preflight.sh.
"""
