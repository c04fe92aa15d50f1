# shellcheck shell=bash
# Sourced by scripts/preflight.sh (uses its pass/warn/fail/oneline, PY, REPO, P_SPEC_RUNNER,
# IMAGE_ID and GPU_NAME).
# check_selftest: the overlay's runner has never served on this GPU until `make selftest`
# passed here for this very image (scripts/selftest/record.py judges the records).
check_selftest() {
    local out dir=${SELFTEST_DIR:-$REPO/.cache/selftest}
    if [[ ${P_SPEC_RUNNER:-} != overlay ]]; then
        pass selftest "runner ${P_SPEC_RUNNER:-?}: upstream's DSpark needs no self-test record"
        return
    fi
    if [[ -z $IMAGE_ID ]]; then
        warn selftest "skipped: the image check did not pass"
        return
    fi
    if [[ -z $GPU_NAME ]]; then
        GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
        GPU_NAME=${GPU_NAME%%,*}
    fi
    if out=$(PYTHONPATH="$REPO" "$PY" -m scripts.selftest.record verdict --dir "$dir" \
        --image-id "$IMAGE_ID" --gpu "${GPU_NAME:-none}" 2>&1); then
        pass selftest "$(oneline "$out")"
    else
        fail selftest "$(oneline "$out")" \
            "make selftest (on this node, a few minutes; make selftest PAIR=1 for TP=2 across both)" \
            "or serve upstream's DSpark instead: PROFILE=spark-2x-upstream in docker/.env on both nodes"
    fi
}
