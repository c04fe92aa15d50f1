#!/usr/bin/env bash
# Entrypoint of the DSpark vLLM image; one image and one compose service for both Spark roles.
#
#   serve [EXTRA_ARGS...]  (default) refuse to start without the overlay marker, check this
#                          node's variables (the head refuses an empty VLLM_API_KEY unless
#                          ALLOW_UNAUTHENTICATED_API=1), unset empty NCCL/vLLM variables, resolve the RoCE v2
#                          GID index from sysfs, render `vllm serve` from the recipe profile
#                          (scripts/recipe.py), on a worker wait for the head's master port,
#                          log the command and exec it (on a node of a multi-node engine:
#                          run it as a child, exit 1 when it dies by itself or, on a worker
#                          (any NODE_RANK > 0), once the head is gone). EXTRA_ARGS go after
#                          the rendered ones.
#   print-command          the same checks and rendering, print the command, run nothing.
#   check-overlay          exit 0 if the installed vLLM carries the overlay marker.
#   health                 Docker healthcheck: the head's /health answers 200 (the worker
#                          reports the head's health: it serves nothing by itself).
#   smoke                  one chat completion + /metrics spec-decode counters (python -m scripts.smoke).
#   bench [ARGS...]        the serving sweep against the head's API (python -m scripts.bench),
#                          results in BENCH_DIR (default /tmp/dspark-bench); `make bench` on the head.
#   anything else          exec'd as given (e.g. bash).
#
# Environment: PROFILE (recipe profile name or path, default spark-2x), NODE_RANK, MASTER_ADDR,
# VLLM_HOST_IP, NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_IB_GID_INDEX (auto|nccl|N), VLLM_API_KEY
# (read by vLLM from the environment, never on the command line or in the log), API_HOST,
# HEAD_WAIT_TIMEOUT_S (worker: seconds to wait for the head, 0 = do not wait),
# HEAD_WATCH_INTERVAL_S / HEAD_WATCH_MISSES (worker: how it notices a dead head). Overridable for
# tests: DSPARK_HOME (recipe checkout, default: this script's ..), PYTHON, VLLM_BIN, SYSFS_ROOT.
set -euo pipefail

DSPARK_HOME="${DSPARK_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
PYTHON="${PYTHON:-python3}"
VLLM_BIN="${VLLM_BIN:-vllm}"
PROFILE="${PROFILE:-spark-2x}"
PREFLIGHT="$DSPARK_HOME/scripts/preflight.sh"
# The recipe tool and the smoke check are modules of the scripts package in DSPARK_HOME; the
# entrypoint runs from any directory, so the package's folder is named for those commands only.
SCRIPTS_PATH="$DSPARK_HOME${PYTHONPATH:+:$PYTHONPATH}"
MARKER_NAME=".dspark_overlay.json"

log() { printf '[entrypoint] %s\n' "$*"; }
die() {
    printf '[entrypoint] ERROR: %s\n' "$1" >&2
    shift
    local fix
    for fix in "$@"; do printf '[entrypoint]   fix: %s\n' "$fix" >&2; done
    exit 1
}

# Prints "<marker path> <overlay version> <vLLM version> <mode>"; exit 4 when the marker is
# missing (then prints the path it looked for), 3 when vLLM is not importable, 5 unreadable.
read_marker() {
    "$PYTHON" - "$MARKER_NAME" <<'PY'
import importlib.util, json, os, sys
spec = importlib.util.find_spec("vllm")  # locates the package without importing it
if spec is None or not spec.origin:
    print("no vllm package is importable by this Python")
    sys.exit(3)
path = os.path.join(os.path.dirname(spec.origin), sys.argv[1])
if not os.path.isfile(path):
    print(path)
    sys.exit(4)
try:
    with open(path) as f:
        marker = json.load(f)
    print(path, marker["overlay_version"], marker.get("vllm_version", "?"), marker.get("mode", "?"))
except (OSError, ValueError, KeyError) as exc:
    print(f"{path} is unreadable ({exc})")
    sys.exit(5)
PY
}

require_overlay() {
    local out rc=0 path version vllm_version mode
    out=$(read_marker) || rc=$?
    case $rc in
        0)
            read -r path version vllm_version mode <<<"$out"
            log "overlay $version ($mode) on vLLM $vllm_version: $path"
            ;;
        4)
            die "the DSpark overlay is not applied to this vLLM (no marker at $out); refusing to start stock vLLM" \
                "rebuild the image with 'make image' (the build applies scripts/apply_overlay.sh and fails if it does not apply)" \
                "or apply it to this interpreter: scripts/apply_overlay.sh --python $PYTHON"
            ;;
        *)
            die "cannot check the DSpark overlay: $out" "rebuild the image with 'make image'"
            ;;
    esac
}

# One pass over the recipe profile (scripts/recipe.py): the derived values (ports, node
# count) go into R_* shell variables, never exported (some names, e.g. VLLM_PORT, mean
# something else to vLLM itself); the profile's own `env:` section is exported unless this
# node already sets the variable.
load_profile() {
    local out line name
    out=$(PYTHONPATH="$SCRIPTS_PATH" "$PYTHON" - "$PROFILE" <<'PY' 2>&1
import shlex, sys
from scripts import recipe
try:
    profile = recipe.load_profile(sys.argv[1])
except recipe.RecipeError as exc:
    print("\n".join(exc.problems))
    sys.exit(2)
for key, value in recipe.profile_env(profile).items():
    print(f"R {key}={shlex.quote(value)}")
for key, value in profile.get("env", {}).items():
    print(f"E {key}={shlex.quote(str(value))}")
for key, value in recipe.vllm_env(profile).items():
    print(f"V {key}={shlex.quote(value)}")
PY
    ) || die "profile '$PROFILE' does not render: ${out//$'\n'/; }" \
        "set PROFILE to a profile in recipe/profiles/ (e.g. spark-2x) and fix what recipe.py reports"
    PROFILE_ENV=()
    VLLM_ENV=()
    while IFS= read -r line; do
        name=${line:2}
        name=${name%%=*}
        [[ $name =~ ^[A-Z_][A-Z0-9_]*$ ]] || continue
        case ${line:0:2} in
            "R ") eval "R_${line:2}" ;;
            "E ") PROFILE_ENV+=("${line:2}") ;;
            "V ") VLLM_ENV+=("${line:2}") ;;
        esac
    done <<<"$out"
}

export_profile_env() {
    local line name
    for line in "${PROFILE_ENV[@]}"; do
        name=${line%%=*}
        if [[ -n ${!name:-} ]]; then
            log "profile env $name: keeping this node's value"
            continue
        fi
        eval "export $line"
        log "profile env $line"
    done
}

# Variables vLLM reads that the profile decides (VLLM_USE_V2_MODEL_RUNNER from
# speculative.runner: which runner serves DSpark). The profile is the one place to choose; a
# node that sets a different value is refused rather than silently serving the other runner.
export_vllm_env() {
    local line name value
    for line in "${VLLM_ENV[@]}"; do
        name=${line%%=*}
        eval "value=${line#*=}"
        if [[ -n ${!name:-} && ${!name} != "$value" ]]; then
            die "$name=${!name} on this node contradicts profile '$PROFILE' ($name=$value)" \
                "remove $name from docker/.env; choose the runner with speculative.runner in the profile"
        fi
        export "$name=$value"
        log "$name=$value (profile)"
    done
}

# A defined-but-empty NCCL variable is not the same as an unset one (an empty
# NCCL_IB_GID_INDEX reads as index 0, the link-local IPv6 GID): drop the empty ones.
unset_empty() {
    local name
    while IFS= read -r name; do
        case $name in
            NCCL_* | GLOO_* | TP_SOCKET_* | UCX_* | VLLM_* | HF_* | PYTORCH_*)
                if [[ -z ${!name} ]]; then
                    unset "$name"
                    log "unset empty $name"
                fi
                ;;
        esac
    done < <(compgen -e)
}

resolve_gid_index() {
    local out
    case ${NCCL_IB_GID_INDEX:-auto} in
        nccl)
            unset NCCL_IB_GID_INDEX
            log "NCCL_IB_GID_INDEX: left to NCCL (NCCL_IB_GID_INDEX=nccl)"
            return
            ;;
    esac
    out=$(SYSFS_ROOT="${SYSFS_ROOT:-/sys}" "$PREFLIGHT" resolve-gid 2>&1) \
        || die "no usable RoCE v2 GID for NCCL_IB_HCA=${NCCL_IB_HCA:-} on ${NCCL_SOCKET_IFNAME:-}: ${out//$'\n'/; }" \
            "run scripts/preflight.sh on this node and fix what it reports (the container needs host networking and /dev/infiniband)"
    if [[ ${NCCL_IB_GID_INDEX:-auto} == auto ]]; then
        log "NCCL_IB_GID_INDEX=auto resolved from sysfs: $out"
    else
        log "NCCL_IB_GID_INDEX=$out (pinned, verified against sysfs)"
    fi
    export NCCL_IB_GID_INDEX="$out"
}

# One TCP connect to host:port, given up after 3 s (a powered-off peer never answers).
port_open() {
    # shellcheck disable=SC2016  # $0/$1 expand in the inner bash
    timeout 3 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$1" "$2" 2>/dev/null
}

wait_for_head() {
    local host=$1 port=$2 timeout=$3 start=$SECONDS next=0
    ((timeout > 0)) || return 0
    log "worker: waiting up to ${timeout}s for the head's torch.distributed store at $host:$port"
    while :; do
        if port_open "$host" "$port"; then
            log "head is up at $host:$port"
            return 0
        fi
        if ((SECONDS - start >= timeout)); then
            die "MASTER_ADDR=$host: the head's master port $port did not open within ${timeout}s (HEAD_WAIT_TIMEOUT_S)" \
                "start the head (make up on the node with NODE_RANK=0) and watch it with make logs" \
                "check that MASTER_ADDR=$host is the head's fabric IP and reachable from here (scripts/preflight.sh)"
        fi
        if ((SECONDS >= next)); then
            log "head not up yet at $host:$port ($((SECONDS - start))s)"
            next=$((SECONDS + 30))
        fi
        sleep "${HEAD_WAIT_POLL_S:-2}"
    done
}

# A fabric interface name that this node does not have would only show up much later, as a
# gloo/NCCL bootstrap failure deep in vLLM's start-up.
check_interfaces() {
    local name
    for name in NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME TP_SOCKET_IFNAME; do
        [[ -n ${!name:-} ]] || continue
        if [[ ! -e ${SYSFS_ROOT:-/sys}/class/net/${!name} ]]; then
            die "$name=${!name}: this node has no such network interface" \
                "set $name to this node's fabric interface (ip -br link; ibdev2netdev)"
        fi
    done
}

# The key travels in the environment only: on the command line it would show in ps, in this
# log and in vLLM's own argument log.
refuse_key_args() {
    local arg
    for arg in "$@"; do
        case $arg in
            --api-key | --api-key=*)
                die "--api-key on the command line would show in ps and in the logs" \
                    "set VLLM_API_KEY in docker/.env instead (vLLM reads it from the environment)"
                ;;
        esac
    done
}

# Renders the command into CMD (array) after all the checks.
prepare() {
    local argv_text
    refuse_key_args "$@"
    require_overlay
    load_profile
    local nnodes=${R_NNODES:-1}
    local -a node_args=()
    if ((nnodes > 1)); then
        local checked problems
        if ! checked=$(PYTHONPATH="$SCRIPTS_PATH" "$PYTHON" -m scripts.recipe check-env --container --nnodes "$nnodes" 2>&1); then
            printf '%s\n' "$checked"
            problems=$(sed -n 's/^FAIL  env  *//p' <<<"$checked" | paste -sd ';' -)
            die "this node's variables are not usable: ${problems//;/; }" "fix them in docker/.env, then make up"
        fi
        printf '%s\n' "$checked"
        node_args=(--node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR")
    fi
    unset_empty
    if ((nnodes > 1)); then check_interfaces; fi
    if ((nnodes > 1)); then
        if [[ ${NCCL_NET:-IB} == Socket ]]; then
            unset NCCL_IB_GID_INDEX
            log "NCCL_NET=Socket: RDMA is not used, no GID index to resolve (debugging only: slow)"
        else
            resolve_gid_index
        fi
    fi
    export_profile_env
    export_vllm_env
    if [[ -n ${API_HOST:-} ]]; then node_args+=(--api-host "$API_HOST"); fi
    argv_text=$(PYTHONPATH="$SCRIPTS_PATH" "$PYTHON" -m scripts.recipe render "$PROFILE" --as argv "${node_args[@]}" 2>&1) \
        || die "cannot render the serve command from profile '$PROFILE': ${argv_text//$'\n'/; }"
    mapfile -t CMD <<<"$argv_text"
    CMD=("$VLLM_BIN" serve "${CMD[@]}" "$@")
    local role="single node"
    if ((nnodes > 1)); then
        role="head (node rank 0 of $nnodes)"
        ((NODE_RANK > 0)) && role="worker (node rank $NODE_RANK of $nnodes, headless)"
    fi
    log "profile $PROFILE, $role"
    if [[ -n ${VLLM_API_KEY:-} ]]; then
        log "API key: set (${#VLLM_API_KEY} characters); /health answers without it"
    elif [[ $role != worker* ]]; then
        log "API key: none (ALLOW_UNAUTHENTICATED_API=${ALLOW_UNAUTHENTICATED_API:-}): the API is open"
    fi
    local name
    for name in VLLM_HOST_IP NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME TP_SOCKET_IFNAME NCCL_IB_HCA \
        NCCL_IB_GID_INDEX NCCL_NET NCCL_DEBUG; do
        # `if`, not `&&`: a failed test as the function's last command would be its status,
        # and `set -e` would end the container without a word.
        if [[ -n ${!name:-} ]]; then log "$name=${!name}"; fi
    done
}

# Every node of a multi-node engine (two or four) runs vLLM as a child in its own process
# group, for two reasons. A worker (every NODE_RANK > 0, each watching only the head): vLLM's
# headless worker never notices that the head went away (it waits for the
# head's next message forever), and a restarted head cannot form the engine again with it. So
# this shell watches the head's torch.distributed store (open as long as the head's engine
# lives): once it is closed HEAD_WATCH_MISSES probes in a row, HEAD_WATCH_INTERVAL_S apart,
# vLLM is stopped (SIGTERM, SIGKILL after HEAD_WATCH_GRACE_S) and the worker exits 1.
# The head: when any worker dies its engine fails at the next collective, but vLLM's API
# server then shuts down with status 0, which reads as a clean stop. Here vLLM exiting by
# itself is an error (exit 1); only a stop this shell was asked for (SIGTERM/SIGINT, passed to
# vLLM's group) exits 143/130. Either way the restart policy starts the node again. So one dead
# worker of four takes the head down, and the head's closed port the other workers.
serve_pair_node() {
    local watch_host=$1 port=$2 interval=${HEAD_WATCH_INTERVAL_S:-3}
    local misses=${HEAD_WATCH_MISSES:-2} missed=0 rc=0
    setsid "${CMD[@]}" &
    VLLM_PID=$!
    trap 'stop_vllm TERM; exit 143' TERM
    trap 'stop_vllm INT; exit 130' INT
    if [[ -z $watch_host ]]; then
        log "head: vLLM pid $VLLM_PID"
        wait "$VLLM_PID" || rc=$?
    else
        log "worker: vLLM pid $VLLM_PID; watching the head at $watch_host:$port every ${interval}s"
        while kill -0 "$VLLM_PID" 2>/dev/null; do
            sleep "$interval" &
            wait $! || true
            if port_open "$watch_host" "$port"; then
                missed=0
                continue
            fi
            missed=$((missed + 1))
            if ((missed >= misses)); then
                log "ERROR: the head's master port $watch_host:$port is closed (${missed} probes, ${interval}s apart): the head is gone; stopping this worker"
                stop_vllm TERM
                log "worker stopped; it must start again after the head (the restart policy does)"
                exit 1
            fi
        done
        wait "$VLLM_PID" || rc=$?
    fi
    if ((rc == 0)); then
        log "ERROR: vLLM exited by itself (status 0): its engine died, e.g. the other node went away; exiting 1"
        exit 1
    fi
    log "ERROR: vLLM exited with status $rc"
    exit "$rc"
}

# Signal vLLM's process group; whatever is left after HEAD_WATCH_GRACE_S gets SIGKILL.
stop_vllm() {
    local signal=$1 killer
    kill -"$signal" -- "-$VLLM_PID" 2>/dev/null || return 0
    (
        sleep "${HEAD_WATCH_GRACE_S:-10}"
        kill -KILL -- "-$VLLM_PID" 2>/dev/null && log "vLLM did not stop in time: SIGKILL"
    ) &
    killer=$!
    wait "$VLLM_PID" 2>/dev/null || true
    # vLLM's worker processes (same group) can outlive it by a moment.
    while kill -0 -- "-$VLLM_PID" 2>/dev/null && kill -0 "$killer" 2>/dev/null; do
        sleep 0.5
    done
    kill "$killer" 2>/dev/null || true
}

serve() {
    prepare "$@"
    if ((${R_NNODES:-1} > 1 && NODE_RANK > 0)); then
        wait_for_head "$MASTER_ADDR" "${R_MASTER_PORT:?profile has no master port}" "${HEAD_WAIT_TIMEOUT_S:-900}"
    fi
    # The DSpark drafter runs in a worker process: its /metrics series travel through
    # prometheus_client's multiprocess mode, which needs a fresh, empty directory.
    if [[ -z ${PROMETHEUS_MULTIPROC_DIR:-} ]]; then
        PROMETHEUS_MULTIPROC_DIR=$(mktemp -d /tmp/vllm-metrics.XXXXXX) \
            || die "cannot create a metrics directory under /tmp"
        export PROMETHEUS_MULTIPROC_DIR
    fi
    local quoted
    printf -v quoted '%q ' "${CMD[@]}"
    if ((${R_NNODES:-1} > 1)); then
        log "run ${quoted% }"
        local watch=""
        if ((NODE_RANK > 0)); then watch=$MASTER_ADDR; fi
        serve_pair_node "$watch" "$R_MASTER_PORT"
    fi
    log "exec ${quoted% }"
    exec "${CMD[@]}"
}

# Where the head's API answers from this container (host networking): the worker asks the
# head's fabric address, the head its own API_HOST (loopback when that is every interface).
head_host() {
    if [[ -n ${NODE_RANK:-} && $NODE_RANK != 0 && -n ${MASTER_ADDR:-} ]]; then
        printf '%s' "$MASTER_ADDR"
    elif [[ -n ${API_HOST:-} && $API_HOST != 0.0.0.0 ]]; then
        printf '%s' "$API_HOST"
    else
        printf '127.0.0.1'
    fi
}

main() {
    local cmd=${1:-serve}
    (($#)) && shift
    case $cmd in
        serve) serve "$@" ;;
        print-command)
            prepare "$@"
            printf '%q ' "${CMD[@]}"
            printf '\n'
            ;;
        check-overlay) require_overlay ;;
        health) PYTHONPATH="$SCRIPTS_PATH" exec "$PYTHON" -m scripts.smoke --profile "$PROFILE" --host "$(head_host)" --health "$@" ;;
        smoke) PYTHONPATH="$SCRIPTS_PATH" exec "$PYTHON" -m scripts.smoke --profile "$PROFILE" --host "$(head_host)" "$@" ;;
        bench) PYTHONPATH="$SCRIPTS_PATH" exec "$PYTHON" -m scripts.bench --profile "$PROFILE" --host "$(head_host)" \
                   --out-dir "${BENCH_DIR:-/tmp/dspark-bench}" "$@" ;;
        # the overlay's DSpark on this GPU with the profile's settings (scripts/selftest)
        selftest)
            require_overlay
            HF_HUB_OFFLINE=1 PYTHONPATH="$SCRIPTS_PATH" exec "$PYTHON" -m scripts.selftest --profile "$PROFILE" \
                --model "${SELFTEST_MODEL:-/cache/jit/dspark-selftest/tiny-dsv4-dspark-shape-true}" \
                --record-dir "${SELFTEST_DIR:-/records}" "$@"
            ;;
        *) exec "$cmd" "$@" ;;
    esac
}

main "$@"
