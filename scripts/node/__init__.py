"""Per-node policy for the two-Spark deployment, reached through `scripts/recipe.py` subcommands.

report (PASS/WARN/FAIL lines in preflight's format), env (the node .env file: parsing and the
schema of its variables), api (API key and bind address rules), cache (is the profile's model
complete in the HF cache), audit (the listening sockets of a running node). The
hardware probes (sysfs GIDs, MTU, nvidia-smi, docker, ports) stay in scripts/preflight.sh.
"""
