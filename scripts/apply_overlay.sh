#!/usr/bin/env bash
# Apply the DSpark overlay onto a vLLM tree of the pinned version (recipe/pins.yaml).
#   scripts/apply_overlay.sh --target DIR      DIR contains the vllm/ package (checkout or site-packages)
#   scripts/apply_overlay.sh --python PY       the vllm that PY imports
# Options: --check (0 applied, 1 not applied, 3 drifted, 4 stale, 5/6/7 an interrupted
# apply/revert/update), --revert, --link (symlinks). A killed run is recovered by the next one.
# Needs python3 with PyYAML (vLLM depends on it) and GNU patch.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${OVERLAY_PYTHON:-}"
if [ -z "$py" ]; then
    # Prefer the interpreter being patched (it has PyYAML), then the repo venv, then python3.
    prev=""
    for arg in "$@"; do
        if [ "$prev" = "--python" ]; then py="$arg"; fi
        case "$arg" in --python=*) py="${arg#--python=}" ;; esac
        prev="$arg"
    done
    if [ -z "$py" ] && [ -x "$here/../.venv/bin/python" ]; then py="$here/../.venv/bin/python"; fi
    py="${py:-python3}"
fi
command -v patch >/dev/null || { echo "apply_overlay: GNU patch is required (apt-get install patch)" >&2; exit 2; }
exec "$py" "$here/apply_overlay.py" "$@"
