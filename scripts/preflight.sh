#!/usr/bin/env bash
# Preflight for one DGX Spark node, run before `make up` (make up runs it for you). The policy
# (the .env schema, the model-cache check) lives in scripts/recipe.py subcommands, shared with
# the container entrypoint; this script keeps the hardware probes (sysfs GIDs, MTU, GPU,
# docker, ports). Testing hooks: SYSFS_ROOT (default /sys) and PROC_ROOT (default /proc) point
# at fake trees; nvidia-smi, docker and ping are looked up on PATH; PYTHON picks the
# interpreter for the recipe tool (default: the repo's .venv, else python3).
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
SYSFS_ROOT="${SYSFS_ROOT:-/sys}"
PROC_ROOT="${PROC_ROOT:-/proc}"
MIN_MTU="${MIN_MTU:-9000}"
IB_DIR="$SYSFS_ROOT/class/infiniband"
NET_DIR="$SYSFS_ROOT/class/net"
ALL_CHECKS="env compose gpu image overlay selftest cache rdma mtu head ports stale"
COMPOSE_PROJECT="dspark"

FAILS=0
WARNS=0

pass() { printf 'PASS  %-8s %s\n' "$1" "$2"; }
warn() { printf 'WARN  %-8s %s\n' "$1" "$2"; WARNS=$((WARNS + 1)); }
# fail CHECK PROBLEM FIX...
fail() {
    local check=$1 problem=$2
    shift 2
    printf 'FAIL  %-8s %s\n' "$check" "$problem"
    local fix
    for fix in "$@"; do printf '      %-8s fix: %s\n' "" "$fix"; done
    FAILS=$((FAILS + 1))
}
# oneline TEXT: the non-empty lines of TEXT joined with "; " (command output in one report line).
oneline() {
    local line joined=""
    while IFS= read -r line; do
        [[ -n ${line//[[:space:]]/} ]] && joined+="${joined:+; }$line"
    done <<<"$1"
    printf '%s' "$joined"
}
usage() {
    cat <<'EOF'
Usage:
  scripts/preflight.sh [--env-file docker/.env] [--only CHECKS] [--skip CHECKS]
      Every check for this node's role (NODE_RANK in the env file: 0 head, 1..N-1 workers).
      CHECKS is a comma list of: env compose gpu image overlay selftest cache rdma mtu head ports stale
      Prints PASS/WARN/FAIL per check; every FAIL says what to fix. Exit 1 on any FAIL.
  scripts/preflight.sh check-env [--env-file FILE]
      Only the format of the variables in the env file (scripts/recipe.py check-env).
  scripts/preflight.sh resolve-gid
      Print the RoCE v2 IPv4 GID index NCCL should use for NCCL_IB_HCA on NCCL_SOCKET_IFNAME
      (read from the environment). With NCCL_IB_GID_INDEX=auto it is resolved from sysfs, a
      number is verified, `nccl` prints nothing (NCCL picks). docker/entrypoint.sh runs it at
      every start: the index moves across reboots.
  scripts/preflight.sh audit [--env-file docker/.env]
      After start (make audit): the listening TCP sockets of this node's vLLM processes
      (ss -ltnp, pids from docker top) judged by scripts/recipe.py audit. The API port may
      listen anywhere; every inter-node port must be on the fabric address, the fabric
      interface or loopback (or be listed in FIREWALLED_PORTS). Exit 1 on any FAIL.
Needs python3 with PyYAML on the host (sudo apt install python3-yaml).
EOF
}

# sread VAR FILE: first line of a (sysfs) file into VAR; fails quietly (no fork, so it is
# cheap enough for GID tables with hundreds of entries).
sread() {
    local -n _sread_out=$1
    _sread_out=""
    { IFS= read -r _sread_out || [[ -n $_sread_out ]]; } 2>/dev/null <"$2"
}

# ---------------------------------------------------------------------------------------
# Recipe (profile-derived values: ports, model, number of nodes) through scripts/recipe.py
# ---------------------------------------------------------------------------------------
PROFILE_STATE=""   # "", ok, failed
pick_python() {
    if [[ -n ${PYTHON:-} ]]; then
        PY=$PYTHON
    elif [[ -x $REPO/.venv/bin/python ]]; then
        PY=$REPO/.venv/bin/python
    else
        PY=python3
    fi
}

# recipe ARGS...: scripts/recipe.py with the host's Python (it reads the recipe and the .env).
recipe() {
    if ! "$PY" -c 'import yaml' 2>/dev/null; then
        echo "'$PY' cannot import yaml: install PyYAML (sudo apt install python3-yaml)" >&2
        return 2
    fi
    # a module of the scripts package in REPO; named here because preflight runs from any folder
    PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m scripts.recipe "$@"
}

# report TEXT: print recipe.py's PASS/WARN/FAIL lines and count them.
report() {
    local line
    while IFS= read -r line; do
        [[ -n $line ]] || continue
        printf '%s\n' "$line"
        case $line in
            FAIL*) FAILS=$((FAILS + 1)) ;;
            WARN*) WARNS=$((WARNS + 1)) ;;
        esac
    done <<<"$1"
}

# load_env_file FILE: export the file's variables that the environment does not set (parsed
# by recipe.py with docker compose's rules, never sourced).
load_env_file() {
    local out
    if ! out=$(recipe env-file "$1" 2>&1); then
        [[ $out == *FAIL* ]] || out="FAIL  env      cannot read $1: $out"
        report "$out"
        return 1
    fi
    eval "$out"
}

# check_vars MODE: the variables' formats (recipe.py check-env); MODE host or container.
check_vars() {
    local out rc
    local -a flags=(--nnodes "${NNODES_HINT:-2}")
    [[ $1 == container ]] && flags+=(--container)
    out=$(recipe check-env "${flags[@]}" 2>&1)
    rc=$?
    report "$out"
    return "$rc"
}

load_profile() {
    [[ -n $PROFILE_STATE ]] && [[ $PROFILE_STATE == ok ]] && return 0
    [[ $PROFILE_STATE == failed ]] && return 1
    local out line key
    if ! out=$(recipe render "$PROFILE" --as env 2>&1); then
        fail profile "profile '$PROFILE' does not render: $(oneline "$out")" \
            "set PROFILE to a name in recipe/profiles/ (e.g. spark-2x) and fix what recipe.py reports"
        PROFILE_STATE=failed
        return 1
    fi
    while IFS= read -r line; do
        key=${line%%=*}
        [[ $key =~ ^[A-Z_][A-Z0-9_]*$ ]] || continue
        # recipe.py quotes values for sh; the P_ prefix keeps them out of the environment.
        eval "P_$line"
    done <<<"$out"
    PROFILE_STATE=ok
    NNODES_HINT=${P_NNODES:-2}
    return 0
}

# ---------------------------------------------------------------------------------------
# RoCE: HCA selection (NCCL_IB_HCA grammar) and RoCE v2 IPv4 GID resolution from sysfs
# ---------------------------------------------------------------------------------------
# Sets MEMBERS=(hca:port ...) from an NCCL_IB_HCA value, or SEL_ERR.
select_members() {
    local spec=$1 exclude=0 exact=0 item name port hca d skip found
    local -a all=() items=()
    MEMBERS=()
    SEL_ERR=""
    [[ $spec == ^* ]] && { exclude=1; spec=${spec#^}; }
    [[ $spec == =* ]] && { exact=1; spec=${spec#=}; }
    for d in "$IB_DIR"/*; do [[ -e $d ]] && all+=("${d##*/}"); done
    if ((${#all[@]} == 0)); then
        SEL_ERR="no RDMA devices under $IB_DIR"
        return 1
    fi
    IFS=, read -ra items <<<"$spec"
    _hca_matches() { if ((exact)); then [[ $1 == "$2" ]]; else [[ $1 == "$2"* ]]; fi; }
    _add_ports() {
        local h=$1 p=$2 pd
        if [[ -n $p ]]; then
            if [[ ! -d $IB_DIR/$h/ports/$p ]]; then
                SEL_ERR="NCCL_IB_HCA asks for $h port $p, which does not exist"
                return 1
            fi
            MEMBERS+=("$h:$p")
        else
            for pd in "$IB_DIR/$h/ports"/*; do [[ -d $pd ]] && MEMBERS+=("$h:${pd##*/}"); done
        fi
    }
    if ((exclude)); then
        for hca in "${all[@]}"; do
            skip=0
            for item in "${items[@]}"; do _hca_matches "$hca" "${item%%:*}" && skip=1; done
            ((skip)) || _add_ports "$hca" "" || return 1
        done
    else
        for item in "${items[@]}"; do
            name=${item%%:*}
            port=""
            [[ $item == *:* ]] && port=${item#*:}
            found=0
            for hca in "${all[@]}"; do
                if _hca_matches "$hca" "$name"; then
                    found=1
                    _add_ports "$hca" "$port" || return 1
                fi
            done
            if ((!found)); then
                SEL_ERR="NCCL_IB_HCA names '$name' but there is no such RDMA device (present: ${all[*]})"
                return 1
            fi
        done
    fi
    if ((${#MEMBERS[@]} == 0)); then
        SEL_ERR="NCCL_IB_HCA='$NCCL_IB_HCA' selects no HCA port (present: ${all[*]})"
        return 1
    fi
}

# member_netdev HCA: the network interface of that RDMA device (its PCI function's net/).
member_netdev() {
    local d
    MEMBER_NETDEV=""
    for d in "$IB_DIR/$1/device/net"/*; do
        [[ -e $d ]] && { MEMBER_NETDEV=${d##*/}; return 0; }
    done
    return 1
}

# scan_gids HCA PORT NETDEV: sets GID_V2V4=(index ...), GID_V2V4_IP[index]=a.b.c.d and the
# counts of the entries that do not qualify (to explain an empty result).
scan_gids() {
    local hca=$1 port=$2 netdev=$3 dir="$IB_DIR/$1/ports/$2" f i gid type ndev a b
    GID_V2V4=()
    GID_V2V4_IP=()
    N_V1=0
    N_V2V6=0
    N_OTHER_DEV=0
    for f in "$dir/gids"/*; do
        i=${f##*/}
        [[ $i =~ ^[0-9]+$ ]] || continue
        sread gid "$f" || continue
        [[ -z $gid || $gid == 0000:0000:0000:0000:0000:0000:0000:0000 ]] && continue
        sread type "$dir/gid_attrs/types/$i" || continue
        if [[ $type != "RoCE v2" ]]; then
            [[ $type == *v1* ]] && N_V1=$((N_V1 + 1))
            continue
        fi
        if [[ ! $gid =~ ^0000:0000:0000:0000:0000:ffff:([0-9a-fA-F]{4}):([0-9a-fA-F]{4})$ ]]; then
            N_V2V6=$((N_V2V6 + 1))
            continue
        fi
        a=${BASH_REMATCH[1]}
        b=${BASH_REMATCH[2]}
        if [[ -n $netdev && -e $dir/gid_attrs/ndevs/$i ]]; then
            sread ndev "$dir/gid_attrs/ndevs/$i"
            if [[ $ndev != "$netdev" ]]; then
                N_OTHER_DEV=$((N_OTHER_DEV + 1))
                continue
            fi
        fi
        GID_V2V4+=("$((10#$i))")
        printf -v "GID_V2V4_IP[$((10#$i))]" '%d.%d.%d.%d' "0x${a:0:2}" "0x${a:2:2}" "0x${b:0:2}" "0x${b:2:2}"
    done
}

# resolve_gid: uses NCCL_IB_HCA, NCCL_SOCKET_IFNAME, VLLM_HOST_IP, NCCL_IB_GID_INDEX.
# Sets GID_INDEX (empty for `nccl`), GID_MEMBER_LINES (one PASS line per HCA port), and on
# failure GID_ERR + GID_FIX (array).
resolve_gid() {
    local mode=${NCCL_IB_GID_INDEX:-auto} m hca port state phys layer idx common="" per="" summary=""
    local socket_hca="" d
    GID_INDEX=""
    GID_ERR=""
    GID_FIX=()
    GID_MEMBER_LINES=()
    GID_NOTES=()
    OWN_INDEX=""
    if ! select_members "${NCCL_IB_HCA:-}"; then
        GID_ERR=$SEL_ERR
        GID_FIX=("list the RDMA devices with 'ibdev2netdev' (or ls /sys/class/infiniband) and set NCCL_IB_HCA to the ones on the cabled port, e.g. =rocep1s0f0,roceP2p1s0f0")
        return 1
    fi
    for d in "$NET_DIR/${NCCL_SOCKET_IFNAME:-}/device/infiniband"/*; do
        [[ -e $d ]] && socket_hca=${d##*/}
    done
    declare -gA GID_SETS=()
    for m in "${MEMBERS[@]}"; do
        hca=${m%%:*}
        port=${m#*:}
        member_netdev "$hca" || MEMBER_NETDEV=""
        sread state "$IB_DIR/$hca/ports/$port/state" || state="?"
        sread phys "$IB_DIR/$hca/ports/$port/phys_state" || phys="?"
        sread layer "$IB_DIR/$hca/ports/$port/link_layer" || layer="?"
        if [[ $state != *ACTIVE* ]]; then
            GID_ERR="HCA $hca port $port${MEMBER_NETDEV:+ ($MEMBER_NETDEV)} is not up (state '$state', phys_state '$phys')"
            GID_FIX=("check the QSFP cable and that ${MEMBER_NETDEV:-its interface} is up on both nodes (ip link show ${MEMBER_NETDEV:-IFACE}; sudo netplan apply)"
                "or drop $hca from NCCL_IB_HCA if that port is not cabled")
            return 1
        fi
        if [[ $layer != Ethernet ]]; then
            GID_ERR="HCA $hca port $port has link layer '$layer', not Ethernet (RoCE)"
            GID_FIX=("set NCCL_IB_HCA to the RoCE devices of the Spark-to-Spark port (ibdev2netdev)")
            return 1
        fi
        scan_gids "$hca" "$port" "$MEMBER_NETDEV"
        if ((${#GID_V2V4[@]} == 0)); then
            GID_ERR="HCA $hca port $port${MEMBER_NETDEV:+ ($MEMBER_NETDEV)} has no RoCE v2 GID with an IPv4 address (RoCE v1: $N_V1, RoCE v2 IPv6: $N_V2V6, other interfaces: $N_OTHER_DEV)"
            GID_FIX=("give ${MEMBER_NETDEV:-that interface} a static IPv4 address (netplan, one /24 per port twin) and check 'ip -4 addr show ${MEMBER_NETDEV:-IFACE}'"
                "the RoCE v2 IPv4 GID appears as soon as the address is up; then run preflight again")
            return 1
        fi
        GID_SETS[$m]=" ${GID_V2V4[*]} "
        local ips=""
        for idx in "${GID_V2V4[@]}"; do ips+="${ips:+, }$idx=${GID_V2V4_IP[$idx]}"; done
        GID_MEMBER_LINES+=("$hca port $port${MEMBER_NETDEV:+ ($MEMBER_NETDEV)}: ACTIVE, Ethernet, RoCE v2 IPv4 GIDs $ips")
        per+="${per:+; }$hca:$port -> ${GID_V2V4[*]}"
        if [[ $hca == "$socket_hca" && -n ${VLLM_HOST_IP:-} ]]; then
            local own=""
            for idx in "${GID_V2V4[@]}"; do [[ ${GID_V2V4_IP[$idx]} == "$VLLM_HOST_IP" ]] && own=$idx; done
            if [[ -z $own ]]; then
                GID_ERR="VLLM_HOST_IP=$VLLM_HOST_IP is not an address of $NCCL_SOCKET_IFNAME (its RoCE v2 IPv4 GIDs: $ips)"
                GID_FIX=("set VLLM_HOST_IP to this node's address on $NCCL_SOCKET_IFNAME (ip -4 addr show $NCCL_SOCKET_IFNAME)")
                return 1
            fi
            OWN_INDEX=$own
        fi
    done
    # NCCL applies one GID index to every HCA it uses: keep the indexes valid on all of them.
    local first=1 cand
    for m in "${MEMBERS[@]}"; do
        if ((first)); then
            common=${GID_SETS[$m]}
            first=0
        else
            local next=" "
            for cand in $common; do [[ ${GID_SETS[$m]} == *" $cand "* ]] && next+="$cand "; done
            common=$next
        fi
    done
    read -ra common_list <<<"$common"
    if ((${#common_list[@]} == 0)); then
        GID_ERR="no GID index is a RoCE v2 IPv4 entry on every HCA in NCCL_IB_HCA ($per); NCCL uses one index for all of them"
        GID_FIX=("make the port twins' addresses come up in the same order (netplan), or list only the HCAs that share an index in NCCL_IB_HCA")
        return 1
    fi
    local best=${common_list[0]}
    for cand in "${common_list[@]}"; do ((cand < best)) && best=$cand; done
    if [[ -n ${OWN_INDEX:-} && $common == *" $OWN_INDEX "* ]]; then best=$OWN_INDEX; fi
    summary="valid on every HCA: ${common_list[*]}"
    case $mode in
        nccl)
            GID_INDEX=""
            GID_NOTES=("NCCL_IB_GID_INDEX=nccl: NCCL picks the index itself (RoCE v2 IPv4 would be $best; $summary)")
            ;;
        auto)
            GID_INDEX=$best
            GID_NOTES=("NCCL_IB_GID_INDEX=auto resolves to $best ($summary); the container resolves it again at every start")
            ;;
        *)
            if [[ $common != *" $((10#$mode)) "* ]]; then
                GID_ERR="NCCL_IB_GID_INDEX=$mode is not a RoCE v2 IPv4 GID on every HCA any more ($per): the index moved"
                GID_FIX=("set NCCL_IB_GID_INDEX=auto in docker/.env: the container resolves the index from sysfs at every start (today it is $best)")
                return 1
            fi
            GID_INDEX=$((10#$mode))
            GID_NOTES=("NCCL_IB_GID_INDEX=$mode is valid today ($summary), but GID indexes move across reboots: prefer auto")
            ;;
    esac
    return 0
}

# ---------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------
check_compose() {
    local out
    if ! docker compose version >/dev/null 2>&1; then
        fail compose "'docker compose' (Compose v2) is not available" "install the Docker Compose plugin (sudo apt install docker-compose-plugin)"
        return
    fi
    if out=$(docker compose -f "$REPO/docker/compose.yaml" --env-file "$ENV_FILE" config --quiet 2>&1); then
        pass compose "docker/compose.yaml renders with $ENV_FILE"
    else
        fail compose "docker compose rejects docker/compose.yaml with $ENV_FILE: $(oneline "$out")" "set the variable it names in $ENV_FILE (docker/.env.example documents each one)"
    fi
}

check_gpu() {
    local out name cap
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        fail gpu "nvidia-smi not found: no NVIDIA driver on this host" "install the DGX OS NVIDIA driver stack"
        return
    fi
    if ! out=$(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader 2>&1) || [[ -z $out ]]; then
        fail gpu "nvidia-smi sees no GPU: $(oneline "$out")" "check the driver (nvidia-smi), reboot after a driver update"
        return
    fi
    IFS=, read -r name cap <<<"${out%%$'\n'*}"
    cap=${cap// /}
    GPU_NAME=$name
    if [[ $cap != 12.1 ]]; then
        warn gpu "GPU '$name' has compute capability $cap; this image is built for GB10 (12.1, sm_121)"
    else
        pass gpu "$name (compute capability $cap)"
    fi
    local runtimes
    if runtimes=$(docker info --format '{{json .Runtimes}}' 2>/dev/null) && [[ $runtimes != *nvidia* ]]; then
        warn gpu "Docker lists no 'nvidia' runtime; GPU containers need the NVIDIA Container Toolkit (sudo nvidia-ctk runtime configure --runtime=docker && sudo systemctl restart docker)"
    fi
}

IMAGE_OK=0
IMAGE_ID=""
GPU_NAME=""
check_image() {
    local out id vver vcommit over content want_commit want_version want_overlay want_content
    if ! command -v docker >/dev/null 2>&1; then
        fail image "docker not found" "install Docker Engine (DGX OS ships it)"
        return
    fi
    if ! out=$(docker image inspect --format '{{.Id}}|{{index .Config.Labels "dspark.vllm.version"}}|{{index .Config.Labels "dspark.vllm.commit"}}|{{index .Config.Labels "dspark.overlay.version"}}|{{index .Config.Labels "dspark.content.sha256"}}' "$IMAGE" 2>&1); then
        fail image "image $IMAGE is not on this node (docker: $(oneline "$out"))" \
            "build it on this node: make image (both nodes need the same image)" \
            "if docker cannot reach its daemon: sudo systemctl start docker; sudo usermod -aG docker \$USER (then log in again)"
        return
    fi
    IFS='|' read -r id vver vcommit over content <<<"$out"
    local pins
    pins=$(recipe pins --as make 2>/dev/null)
    want_commit=$(sed -n 's/^VLLM_GIT_COMMIT := //p' <<<"$pins")
    want_version=$(sed -n 's/^VLLM_VERSION := //p' <<<"$pins")
    want_overlay=$("$PY" -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["overlay_version"])' "$REPO/overlay/manifest.yaml" 2>/dev/null)
    # what the image was built from (overlay/, recipe/, docker/) against this checkout
    want_content=$(PYTHONPATH="$REPO" "$PY" -m scripts.node.content_hash 2>/dev/null)
    local problems=()
    [[ $content == "<no value>" ]] && content=""
    [[ $vver == "<no value>" ]] && vver=""
    [[ $vcommit == "<no value>" ]] && vcommit=""
    [[ $over == "<no value>" ]] && over=""
    [[ -z $vcommit || -z $over ]] && problems+=("it has no dspark.vllm.commit / dspark.overlay.version labels (not built by make image)")
    [[ -n $want_commit && -n $vcommit && $vcommit != "$want_commit" ]] && problems+=("vLLM commit $vcommit, recipe/pins.yaml pins $want_commit")
    [[ -n $want_version && -n $vver && $vver != "$want_version" ]] && problems+=("vLLM $vver, recipe pins $want_version")
    [[ -n $want_overlay && -n $over && $over != "$want_overlay" ]] && problems+=("overlay $over, this checkout is overlay $want_overlay")
    if [[ -z $content ]]; then
        problems+=("it has no dspark.content.sha256 label (built before the image carried the hash of overlay/, recipe/, docker/)")
    elif [[ -n $want_content && $content != "$want_content" ]]; then
        problems+=("built from other overlay/, recipe/ or docker/ files (content ${content:0:12}, this checkout ${want_content:0:12}: git pull or an edit since make image)")
    fi
    if ((${#problems[@]})); then
        local joined
        printf -v joined '%s; ' "${problems[@]}"
        fail image "image $IMAGE does not match this checkout: ${joined%; }" "rebuild it: make image (on both nodes)"
        return
    fi
    IMAGE_OK=1
    IMAGE_ID=$id
    pass image "$IMAGE ${id:0:19} (vLLM $vver @$vcommit, overlay $over); the other node must show the same ID"
}

check_overlay() {
    local out
    if ((!IMAGE_OK)); then
        warn overlay "skipped: the image check did not pass"
        return
    fi
    if out=$(docker run --rm --network none --entrypoint /opt/dspark/docker/entrypoint.sh "$IMAGE" check-overlay 2>&1); then
        pass overlay "${out##*$'\n'}"
    else
        fail overlay "the overlay marker is missing in $IMAGE: $(oneline "$out")" "rebuild the image: make image (the build applies the overlay and fails if it does not apply)"
    fi
}

# check_selftest: a passing `make selftest` record for this image and GPU, in its own file.
# shellcheck source=scripts/node/selftest_gate.sh disable=SC1091  # checked on its own (make lint)
source "$HERE/node/selftest_gate.sh"

check_cache() {
    local out
    out=$(recipe check-cache "$PROFILE" --cache-dir "$MODEL_CACHE_DIR" --image "$IMAGE" \
        --container-uid "${CONTAINER_UID:-1000}" 2>&1)
    report "$out"
}

check_rdma() {
    local line
    if resolve_gid; then
        for line in "${GID_MEMBER_LINES[@]}"; do pass rdma "$line"; done
        if [[ -n ${NCCL_SOCKET_IFNAME:-} && ! -e $NET_DIR/$NCCL_SOCKET_IFNAME/device/infiniband ]]; then
            warn rdma "NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME is not an RDMA port; bootstrap traffic will not use the fabric link"
        fi
        case ${NCCL_IB_GID_INDEX:-auto} in
            auto) pass gid "${GID_NOTES[0]}" ;;
            *) warn gid "${GID_NOTES[0]}" ;;
        esac
    else
        fail rdma "$GID_ERR" "${GID_FIX[@]}"
    fi
}

check_mtu() {
    local nd mtu m hca
    local -a devs=()
    [[ -n ${NCCL_SOCKET_IFNAME:-} ]] && devs+=("$NCCL_SOCKET_IFNAME")
    if select_members "${NCCL_IB_HCA:-}"; then
        for m in "${MEMBERS[@]}"; do
            hca=${m%%:*}
            member_netdev "$hca" && [[ " ${devs[*]} " != *" $MEMBER_NETDEV "* ]] && devs+=("$MEMBER_NETDEV")
        done
    fi
    for nd in "${devs[@]}"; do
        if [[ ! -e $NET_DIR/$nd ]]; then
            local present=()
            for m in "$NET_DIR"/*; do [[ -e $m ]] && present+=("${m##*/}"); done
            fail mtu "interface $nd does not exist (present: ${present[*]})" "set NCCL_SOCKET_IFNAME to this node's fabric interface (ibdev2netdev)"
            continue
        fi
        sread mtu "$NET_DIR/$nd/mtu" || mtu=0
        if ((mtu < MIN_MTU)); then
            fail mtu "$nd has MTU $mtu; the Spark-to-Spark RoCE link needs $MIN_MTU on both nodes" \
                "set 'mtu: $MIN_MTU' for $nd in /etc/netplan/*.yaml and run 'sudo netplan apply' on both nodes (firmware updates can reset it)"
        else
            pass mtu "$nd MTU $mtu"
        fi
    done
}

# check_head: a worker's link to the head (route, reachability, MTU), in its own file.
# shellcheck source=scripts/node/head_link.sh disable=SC1091  # checked on its own (make lint)
source "$HERE/node/head_link.sh"

# port_listening PORT: a TCP listener on PORT in /proc/net/tcp{,6}.
port_listening() {
    local hex f local_addr st
    printf -v hex '%04X' "$1"
    for f in "$PROC_ROOT/net/tcp" "$PROC_ROOT/net/tcp6"; do
        [[ -r $f ]] || continue
        while read -r _ local_addr _ st _; do
            [[ $st == 0A && ${local_addr##*:} == "$hex" ]] && return 0
        done <"$f"
    done
    return 1
}

check_ports() {
    if [[ ${NODE_RANK:-0} != 0 ]]; then
        pass ports "worker: it listens on no fixed port"
        return
    fi
    local port what
    for port in "${P_API_PORT:-}" "${P_MASTER_PORT:-}"; do
        [[ -z $port ]] && continue
        what="API port"
        [[ $port == "${P_MASTER_PORT:-}" ]] && what="torch.distributed master port"
        if port_listening "$port"; then
            fail ports "$what $port is already in use on this node" \
                "stop what listens there (sudo ss -ltnp 'sport = :$port'); if it is this recipe's container: make down"
        else
            pass ports "$what $port is free"
        fi
    done
}

check_stale() {
    local out
    command -v docker >/dev/null 2>&1 || return
    if ! out=$(docker ps --filter "label=com.docker.compose.project=$COMPOSE_PROJECT" \
        --filter status=running --filter status=restarting --format '{{.Names}} ({{.Status}})' 2>&1); then
        warn stale "cannot list containers: $(oneline "$out")"
        return
    fi
    if [[ -n $out ]]; then
        fail stale "this node already runs the recipe: ${out//$'\n'/, }" \
            "make down first (restarting one rank while the other loads leaves a stale rank); make logs to watch it instead"
    else
        pass stale "no recipe container running on this node"
    fi
}

# ---------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------
# Loads the .env a subcommand was given (--env-file FILE, default docker/.env); its only option.
load_env_arg() {
    local cmd=$1 env_file="$REPO/docker/.env"
    shift
    while (($#)); do
        case $1 in
            --env-file) env_file=$2; shift 2 ;;
            *) echo "$cmd: unknown argument $1" >&2; return 2 ;;
        esac
    done
    load_env_file "$env_file" || return 1
}

run_check_env() {
    load_env_arg check-env "$@" || return
    PROFILE=${PROFILE:-spark-2x}
    load_profile  # the profile's node count bounds NODE_RANK
    check_vars host
}

run_resolve_gid() {
    if [[ ${NCCL_IB_GID_INDEX:-auto} == nccl ]]; then
        return 0
    fi
    if resolve_gid; then
        [[ -n $GID_INDEX ]] && printf '%s\n' "$GID_INDEX"
        return 0
    fi
    printf 'resolve-gid: %s\n' "$GID_ERR" >&2
    local fix
    for fix in "${GID_FIX[@]}"; do printf 'resolve-gid: fix: %s\n' "$fix" >&2; done
    return 1
}

# The probes only (ss, docker top); scripts/recipe.py audit judges what they saw.
run_audit() {
    local ids id pids="" saved out rc
    load_env_arg audit "$@" || return
    if ! command -v ss >/dev/null 2>&1; then
        fail audit "ss not found: cannot list listening sockets" "sudo apt install iproute2"
        return 1
    fi
    if command -v docker >/dev/null 2>&1 &&
        ids=$(docker ps -q --filter "label=com.docker.compose.project=$COMPOSE_PROJECT" 2>/dev/null); then
        for id in $ids; do
            pids+=" $(docker top "$id" -eo pid 2>/dev/null | tail -n +2 | tr '\n' ' ')"
        done
    fi
    saved=$(mktemp)
    ss -ltnp >"$saved" 2>&1
    local -a by_pid=()
    [[ -n ${pids// /} ]] && by_pid=(--pids "$pids")
    out=$(recipe audit "${PROFILE:-spark-2x}" --ss "$saved" "${by_pid[@]}" 2>&1)
    rc=$?
    rm -f "$saved"
    report "$out"
    if ((rc)); then
        echo "audit: FAILED ($FAILS problem(s)); fix the FAIL lines above"
        return 1
    fi
    echo "audit: OK ($WARNS warning(s))"
}

main() {
    local only="" skip="" c
    ENV_FILE="$REPO/docker/.env"
    case ${1:-} in
        check-env) shift; pick_python; run_check_env "$@"; return $? ;;
        resolve-gid) shift; run_resolve_gid; return $? ;;
        audit) shift; pick_python; run_audit "$@"; return $? ;;
        -h|--help|help) usage; return 0 ;;
    esac
    while (($#)); do
        case $1 in
            --env-file) ENV_FILE=$2; shift 2 ;;
            --only) only=$2; shift 2 ;;
            --skip) skip=$2; shift 2 ;;
            *) echo "preflight: unknown argument $1 (see --help)" >&2; return 2 ;;
        esac
    done
    for c in ${only//,/ } ${skip//,/ }; do
        [[ " $ALL_CHECKS " == *" $c "* ]] || { echo "preflight: unknown check '$c' (known: $ALL_CHECKS)" >&2; return 2; }
    done
    pick_python
    load_env_file "$ENV_FILE" || { echo "preflight: FAILED ($FAILS problem(s))"; return 1; }
    PROFILE=${PROFILE:-spark-2x}
    IMAGE=${DSPARK_IMAGE:-dspark-vllm:local}
    local role=worker
    [[ ${NODE_RANK:-} == 0 ]] && role="head"
    echo "preflight: $role node (NODE_RANK=${NODE_RANK:-?}), profile $PROFILE, image $IMAGE, env $ENV_FILE"

    want() { [[ ( -z $only || ",$only," == *",$1,"* ) && ",$skip," != *",$1,"* ]]; }
    local needs_profile=0
    for c in env cache ports image selftest; do want "$c" && needs_profile=1; done
    if ((needs_profile)); then load_profile; fi
    want env && check_vars host
    want compose && check_compose
    want gpu && check_gpu
    want image && check_image
    want overlay && check_overlay
    if want selftest; then
        if [[ $PROFILE_STATE == ok ]]; then check_selftest; else warn selftest "skipped: needs the profile"; fi
    fi
    if want cache; then
        if [[ $PROFILE_STATE == ok && -n ${MODEL_CACHE_DIR:-} ]]; then check_cache; else warn cache "skipped: needs the profile and MODEL_CACHE_DIR"; fi
    fi
    want rdma && check_rdma
    want mtu && check_mtu
    if want head; then
        if [[ -n ${MASTER_ADDR:-} ]]; then check_head; else warn head "skipped: MASTER_ADDR is not set"; fi
    fi
    if want ports; then
        if [[ $PROFILE_STATE == ok ]]; then check_ports; else warn ports "skipped: needs the profile"; fi
    fi
    want stale && check_stale
    if ((FAILS)); then
        echo "preflight: FAILED ($FAILS problem(s), $WARNS warning(s)); fix the FAIL lines above and run it again"
        return 1
    fi
    echo "preflight: OK ($WARNS warning(s))"
    return 0
}

main "$@"
