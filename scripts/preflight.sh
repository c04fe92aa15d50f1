#!/usr/bin/env bash
# Preflight for one DGX Spark node, run before `make up` (make up runs it for you).
#
#   scripts/preflight.sh [--env-file docker/.env] [--only CHECKS] [--skip CHECKS]
#       Every check for this node's role (NODE_RANK in the env file: 0 head, 1 worker).
#       CHECKS is a comma list of: env compose gpu image overlay cache rdma mtu head ports stale
#       Prints PASS/WARN/FAIL per check; every FAIL says what to fix. Exit 1 on any FAIL.
#   scripts/preflight.sh check-env [--env-file FILE] [--container]
#       Only the format of the variables (--container: the ones the container sees, read
#       from the environment; used by docker/entrypoint.sh).
#   scripts/preflight.sh resolve-gid
#       Print the RoCE v2 IPv4 GID index NCCL should use for NCCL_IB_HCA on
#       NCCL_SOCKET_IFNAME (read from the environment). With NCCL_IB_GID_INDEX=auto it is
#       resolved from sysfs, a number is verified, `nccl` prints nothing (NCCL picks).
#       Used by docker/entrypoint.sh at every start: the index moves across reboots.
#
# Testing hooks: SYSFS_ROOT (default /sys) and PROC_ROOT (default /proc) point at fake trees;
# nvidia-smi, docker and ping are looked up on PATH; PYTHON picks the interpreter used for the
# recipe tool (default: the repo's .venv, else python3).
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
SYSFS_ROOT="${SYSFS_ROOT:-/sys}"
PROC_ROOT="${PROC_ROOT:-/proc}"
MIN_MTU="${MIN_MTU:-9000}"
IB_DIR="$SYSFS_ROOT/class/infiniband"
NET_DIR="$SYSFS_ROOT/class/net"
ALL_CHECKS="env compose gpu image overlay cache rdma mtu head ports stale"
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
usage() { sed -n '2,22p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

# sread VAR FILE: first line of a (sysfs) file into VAR; fails quietly (no fork, so it is
# cheap enough for GID tables with hundreds of entries).
sread() {
    local -n _sread_out=$1
    _sread_out=""
    { IFS= read -r _sread_out || [[ -n $_sread_out ]]; } 2>/dev/null <"$2"
}

# ---------------------------------------------------------------------------------------
# .env loading (parsed, never sourced; the shell environment wins, as in docker compose)
# ---------------------------------------------------------------------------------------
load_env_file() {
    local file=$1 line key val n=0 bad=0
    if [[ ! -f $file ]]; then
        fail env "$file not found" \
            "cp docker/.env.example docker/.env on each node and fill it in (NODE_RANK=0 on the head, 1 on the worker)"
        return 1
    fi
    if grep -q $'\r' "$file"; then
        fail env "$file has Windows (CRLF) line endings; values would end in a carriage return" \
            "sed -i 's/\\r\$//' $file"
        return 1
    fi
    while IFS= read -r line || [[ -n $line ]]; do
        n=$((n + 1))
        line=${line#$'\xef\xbb\xbf'}
        [[ $line =~ ^[[:space:]]*(#.*)?$ ]] && continue
        if [[ $line =~ ^[[:space:]]*(export[[:space:]]+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$ ]]; then
            key=${BASH_REMATCH[2]}
            val=${BASH_REMATCH[3]}
            if [[ $val =~ ^\"(.*)\"[[:space:]]*(#.*)?$ ]] || [[ $val =~ ^\'(.*)\'[[:space:]]*(#.*)?$ ]]; then
                val=${BASH_REMATCH[1]}
            else
                [[ $val =~ ^(.*[^[:space:]])?[[:space:]]+#.*$ ]] && val=${BASH_REMATCH[1]}
                val=${val%"${val##*[![:space:]]}"}
            fi
            [[ -n ${!key+x} ]] || export "$key=$val"
        else
            fail env "$file line $n is not KEY=value: $line" "fix or remove that line"
            bad=1
        fi
    done <"$file"
    return "$bad"
}

# ---------------------------------------------------------------------------------------
# Variable formats (shared with the container entrypoint through `check-env --container`)
# ---------------------------------------------------------------------------------------
is_ipv4() {
    local ip=$1 o
    [[ $ip =~ ^([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})$ ]] || return 1
    for o in "${BASH_REMATCH[@]:1}"; do ((10#$o <= 255)) || return 1; done
}
IFNAME_RE='^[A-Za-z0-9_.-]{1,15}$'
HCA_ITEM_RE='[A-Za-z0-9_.-]+(:[0-9]+)?'
HCA_RE="^\\^?=?${HCA_ITEM_RE}(,${HCA_ITEM_RE})*\$"

# need VAR FIX: fail when VAR is unset or empty (the same sentence compose prints).
need() {
    local name=$1 fix=$2
    if [[ -z ${!name:-} ]]; then
        fail env "$name is not set" "$fix"
        return 1
    fi
}

check_ipv4_var() {
    local name=$1 what=$2 val=${!1:-}
    [[ -z $val ]] && return 1
    if ! is_ipv4 "$val"; then
        fail env "$name='$val' is not an IPv4 address" "set $name to $what (dotted IPv4, e.g. 192.168.100.10; no hostnames, no IPv6)"
        return 1
    fi
    if [[ $val == 127.* || $val == 0.0.0.0 ]]; then
        fail env "$name='$val' is a loopback/unspecified address" "set $name to $what; the other node must be able to reach it"
        return 1
    fi
}

# check_vars MODE: MODE=host (the .env on the host) or container (what compose passes in).
check_vars() {
    local mode=$1 ok=1 nnodes=${NNODES_HINT:-2}
    need NODE_RANK "set NODE_RANK=0 on the head node and NODE_RANK=1 on the worker" || ok=0
    need MASTER_ADDR "set MASTER_ADDR to the head node's fabric (RoCE) IPv4 address, the same on both nodes" || ok=0
    need VLLM_HOST_IP "set VLLM_HOST_IP to this node's fabric (RoCE) IPv4 address" || ok=0
    need NCCL_SOCKET_IFNAME "set NCCL_SOCKET_IFNAME to this node's fabric interface (ibdev2netdev lists them, e.g. enp1s0f0np0)" || ok=0
    need NCCL_IB_HCA "set NCCL_IB_HCA to this node's RoCE HCAs, e.g. =rocep1s0f0,roceP2p1s0f0 (ibdev2netdev)" || ok=0
    if [[ $mode == host ]]; then
        need MODEL_CACHE_DIR "set MODEL_CACHE_DIR to the host directory used as HF_HOME (it contains hub/), e.g. /home/you/.cache/huggingface" || ok=0
    fi

    if [[ -n ${NODE_RANK:-} ]] && ! { [[ $NODE_RANK =~ ^[0-9]+$ ]] && ((10#$NODE_RANK < nnodes)); }; then
        fail env "NODE_RANK='$NODE_RANK' is not a node rank of this $nnodes-node profile" \
            "set NODE_RANK=0 on the head and NODE_RANK=1 on the worker"
        ok=0
    fi
    check_ipv4_var MASTER_ADDR "the head node's fabric (RoCE) IPv4 address" || { [[ -n ${MASTER_ADDR:-} ]] && ok=0; }
    check_ipv4_var VLLM_HOST_IP "this node's fabric (RoCE) IPv4 address" || { [[ -n ${VLLM_HOST_IP:-} ]] && ok=0; }
    if [[ ${NODE_RANK:-} == 0 && -n ${MASTER_ADDR:-} && -n ${VLLM_HOST_IP:-} && $MASTER_ADDR != "$VLLM_HOST_IP" ]]; then
        fail env "on the head (NODE_RANK=0) MASTER_ADDR=$MASTER_ADDR must be this node's own address, but VLLM_HOST_IP=$VLLM_HOST_IP" \
            "use the head's fabric IP for both MASTER_ADDR and VLLM_HOST_IP here"
        ok=0
    fi
    if [[ ${NODE_RANK:-} =~ ^[1-9][0-9]*$ && -n ${MASTER_ADDR:-} && $MASTER_ADDR == "${VLLM_HOST_IP:-}" ]]; then
        fail env "on a worker MASTER_ADDR ($MASTER_ADDR) must be the head's address, not this node's (VLLM_HOST_IP)" \
            "set MASTER_ADDR to the head's fabric IP and VLLM_HOST_IP to this node's"
        ok=0
    fi
    local name
    for name in NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME TP_SOCKET_IFNAME; do
        if [[ -n ${!name:-} && ! ${!name} =~ $IFNAME_RE ]]; then
            fail env "$name='${!name}' is not one interface name" \
                "set $name to a single interface name such as enp1s0f0np0 (no lists, no ^/= prefixes)"
            ok=0
        fi
    done
    if [[ -n ${NCCL_IB_HCA:-} && ! $NCCL_IB_HCA =~ $HCA_RE ]]; then
        fail env "NCCL_IB_HCA='$NCCL_IB_HCA' is not an NCCL HCA list" \
            "use NCCL's form: [^][=]name[:port][,name[:port]...], e.g. =rocep1s0f0,roceP2p1s0f0"
        ok=0
    fi
    local gid=${NCCL_IB_GID_INDEX:-auto}
    if ! [[ $gid == auto || $gid == nccl ]] && ! { [[ $gid =~ ^[0-9]{1,3}$ ]] && ((10#$gid <= 255)); }; then
        fail env "NCCL_IB_GID_INDEX='$gid' is not auto, nccl or an index 0-255" \
            "set NCCL_IB_GID_INDEX=auto (resolved from sysfs at every start; the index moves across reboots)"
        ok=0
    fi
    if [[ -n ${HEAD_WAIT_TIMEOUT_S:-} && ! $HEAD_WAIT_TIMEOUT_S =~ ^[0-9]+$ ]]; then
        fail env "HEAD_WAIT_TIMEOUT_S='$HEAD_WAIT_TIMEOUT_S' is not a number of seconds" "e.g. HEAD_WAIT_TIMEOUT_S=900"
        ok=0
    fi
    if [[ $mode == host ]]; then
        if [[ -n ${MODEL_CACHE_DIR:-} && $MODEL_CACHE_DIR != /* ]]; then
            fail env "MODEL_CACHE_DIR='$MODEL_CACHE_DIR' is not an absolute path" "use an absolute host path, e.g. /home/you/.cache/huggingface"
            ok=0
        fi
        if [[ -n ${SHM_SIZE:-} && ! ${SHM_SIZE,,} =~ ^[0-9]+(b|k|m|g|kb|mb|gb)?$ ]]; then
            fail env "SHM_SIZE='$SHM_SIZE' is not a size" "e.g. SHM_SIZE=64gb"
            ok=0
        fi
        if [[ -n ${RESTART_POLICY:-} && ! $RESTART_POLICY =~ ^(no|always|unless-stopped|on-failure(:[0-9]+)?)$ ]]; then
            fail env "RESTART_POLICY='$RESTART_POLICY' is not a Docker restart policy" "use unless-stopped (default), on-failure, always or no"
            ok=0
        fi
        if [[ -n ${STOP_GRACE_PERIOD:-} && ! $STOP_GRACE_PERIOD =~ ^([0-9]+(\.[0-9]+)?(us|ms|s|m|h))+$ ]]; then
            fail env "STOP_GRACE_PERIOD='$STOP_GRACE_PERIOD' is not a duration" "e.g. STOP_GRACE_PERIOD=30s"
            ok=0
        fi
        if [[ -n ${HEALTH_START_PERIOD:-} && ! $HEALTH_START_PERIOD =~ ^([0-9]+(\.[0-9]+)?(us|ms|s|m|h))+$ ]]; then
            fail env "HEALTH_START_PERIOD='$HEALTH_START_PERIOD' is not a duration" "e.g. HEALTH_START_PERIOD=45m"
            ok=0
        fi
        for name in CONTAINER_UID CONTAINER_GID; do
            if [[ -n ${!name:-} && ! ${!name} =~ ^[0-9]+$ ]]; then
                fail env "$name='${!name}' is not a numeric id" "use the numeric id that owns MODEL_CACHE_DIR (id -u / id -g)"
                ok=0
            fi
        done
        if [[ -n ${DSPARK_IMAGE:-} && ($DSPARK_IMAGE == *@* || $DSPARK_IMAGE =~ [[:space:]]) ]]; then
            fail env "DSPARK_IMAGE='$DSPARK_IMAGE' must be a plain name:tag (make image tags it; a digest cannot be a build tag)" \
                "e.g. DSPARK_IMAGE=dspark-vllm:local"
            ok=0
        fi
    fi
    ((ok))
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

# recipe ARGS...: scripts/recipe.py on the host (needs PyYAML), else the copy in the image.
recipe() {
    if "$PY" -c 'import yaml' 2>/dev/null; then
        "$PY" "$REPO/scripts/recipe.py" "$@"
    elif command -v docker >/dev/null 2>&1 && docker image inspect "$IMAGE" >/dev/null 2>&1; then
        docker run --rm --network none --entrypoint python3 "$IMAGE" /opt/dspark/scripts/recipe.py "$@"
    else
        echo "neither '$PY' with PyYAML (sudo apt install python3-yaml) nor the image $IMAGE is available to read the recipe" >&2
        return 2
    fi
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
check_image() {
    local out id vver vcommit over want_commit want_version want_overlay
    if ! command -v docker >/dev/null 2>&1; then
        fail image "docker not found" "install Docker Engine (DGX OS ships it)"
        return
    fi
    if ! out=$(docker image inspect --format '{{.Id}}|{{index .Config.Labels "dspark.vllm.version"}}|{{index .Config.Labels "dspark.vllm.commit"}}|{{index .Config.Labels "dspark.overlay.version"}}' "$IMAGE" 2>&1); then
        fail image "image $IMAGE is not on this node (docker: $(oneline "$out"))" \
            "build it on this node: make image (both nodes need the same image)" \
            "if docker cannot reach its daemon: sudo systemctl start docker; sudo usermod -aG docker \$USER (then log in again)"
        return
    fi
    IFS='|' read -r id vver vcommit over <<<"$out"
    local pins
    pins=$(recipe pins --as make 2>/dev/null)
    want_commit=$(sed -n 's/^VLLM_GIT_COMMIT := //p' <<<"$pins")
    want_version=$(sed -n 's/^VLLM_VERSION := //p' <<<"$pins")
    want_overlay=$("$PY" -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["overlay_version"])' "$REPO/overlay/manifest.yaml" 2>/dev/null)
    local problems=()
    [[ $vver == "<no value>" ]] && vver=""
    [[ $vcommit == "<no value>" ]] && vcommit=""
    [[ $over == "<no value>" ]] && over=""
    [[ -z $vcommit || -z $over ]] && problems+=("it has no dspark.vllm.commit / dspark.overlay.version labels (not built by make image)")
    [[ -n $want_commit && -n $vcommit && $vcommit != "$want_commit" ]] && problems+=("vLLM commit $vcommit, recipe/pins.yaml pins $want_commit")
    [[ -n $want_version && -n $vver && $vver != "$want_version" ]] && problems+=("vLLM $vver, recipe pins $want_version")
    [[ -n $want_overlay && -n $over && $over != "$want_overlay" ]] && problems+=("overlay $over, this checkout is overlay $want_overlay")
    if ((${#problems[@]})); then
        local joined
        printf -v joined '%s; ' "${problems[@]}"
        fail image "image $IMAGE does not match this checkout: ${joined%; }" "rebuild it: make image (on both nodes)"
        return
    fi
    IMAGE_OK=1
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

check_cache() {
    local id=${P_MODEL_ID:-} rev=${P_MODEL_REVISION:-} repo snap hash out
    [[ -d $MODEL_CACHE_DIR ]] || {
        fail cache "MODEL_CACHE_DIR=$MODEL_CACHE_DIR does not exist" "create it and download the model into it (see README: Running on two Sparks)"
        return
    }
    if [[ $id == /* ]]; then
        snap=$id
    else
        repo="$MODEL_CACHE_DIR/hub/models--${id//\//--}"
        if [[ ! -d $repo ]]; then
            fail cache "$id is not in the model cache ($repo missing)" \
                "download it on this node: docker run --rm -u \$(id -u):\$(id -g) -e HF_HOME=/cache -v $MODEL_CACHE_DIR:/cache --entrypoint hf $IMAGE download $id --revision $rev" \
                "or copy $repo from the other node (rsync -a over the fabric link)"
            return
        fi
        if [[ $rev =~ ^[0-9a-f]{40}$ ]]; then
            hash=$rev
        elif ! sread hash "$repo/refs/$rev" || [[ -z $hash ]]; then
            fail cache "$id has no revision '$rev' in the cache ($repo/refs/$rev missing)" \
                "download that revision: docker run --rm -u \$(id -u):\$(id -g) -e HF_HOME=/cache -v $MODEL_CACHE_DIR:/cache --entrypoint hf $IMAGE download $id --revision $rev"
            return
        fi
        snap="$repo/snapshots/$hash"
    fi
    if ! out=$("$PY" - "$snap" "$MODEL_CACHE_DIR/hub/models--${id//\//--}/blobs" <<'PY' 2>&1
import json, os, sys
snap, blobs = sys.argv[1], sys.argv[2]
problems = []
if not os.path.isdir(snap):
    print(f"snapshot {snap} is missing"); sys.exit(1)
if not os.path.isfile(os.path.join(snap, "config.json")):
    problems.append("config.json is missing")
index = os.path.join(snap, "model.safetensors.index.json")
if os.path.isfile(index):
    try:
        shards = sorted(set(json.load(open(index))["weight_map"].values()))
    except (ValueError, KeyError) as exc:
        print(f"model.safetensors.index.json is unreadable ({exc})"); sys.exit(1)
else:
    shards = sorted(f for f in os.listdir(snap) if f.endswith(".safetensors"))
    if not shards:
        problems.append("no *.safetensors weights")
missing = [s for s in shards if not os.path.isfile(os.path.join(snap, s))]
if missing:
    problems.append(f"{len(missing)} of {len(shards)} weight shards missing or dangling (first: {missing[0]})")
if os.path.isdir(blobs):
    partial = [f for f in os.listdir(blobs) if f.endswith(".incomplete")]
    if partial:
        problems.append(f"{len(partial)} unfinished downloads (*.incomplete) in {blobs}")
if problems:
    print("; ".join(problems)); sys.exit(1)
print(f"{len(shards)} weight shards present")
PY
    ); then
        fail cache "model cache for $id@$rev is incomplete: $out" \
            "finish the download on this node: docker run --rm -u \$(id -u):\$(id -g) -e HF_HOME=/cache -v $MODEL_CACHE_DIR:/cache --entrypoint hf $IMAGE download $id --revision $rev"
        return
    fi
    pass cache "$id@$rev in $MODEL_CACHE_DIR: $out"
    if [[ $rev == main ]]; then
        warn cache "the profile serves revision 'main' of $id: pin a commit hash in the profile's model.revision so both nodes and every restart load the same weights"
    fi
    local owner
    owner=$(stat -c %u "$MODEL_CACHE_DIR" 2>/dev/null)
    if [[ -n $owner && $owner != "${CONTAINER_UID:-1000}" && ! -w $MODEL_CACHE_DIR ]]; then
        warn cache "$MODEL_CACHE_DIR is owned by uid $owner but the container runs as ${CONTAINER_UID:-1000}: set CONTAINER_UID/CONTAINER_GID in docker/.env"
    fi
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

check_head() {
    if [[ ${NODE_RANK:-0} == 0 ]]; then
        pass head "this node is the head (NODE_RANK=0)"
        return
    fi
    if ! command -v ping >/dev/null 2>&1; then
        warn head "ping not found: cannot check that the head at $MASTER_ADDR is reachable"
        return
    fi
    if ! ping -c 1 -W 2 "$MASTER_ADDR" >/dev/null 2>&1; then
        fail head "the head at MASTER_ADDR=$MASTER_ADDR does not answer ping from this worker" \
            "check the cable and both nodes' netplan addresses; MASTER_ADDR must be the head's fabric IP (same subnet as VLLM_HOST_IP=$VLLM_HOST_IP)"
        return
    fi
    local size=$((MIN_MTU - 28))
    if ! ping -M "do" -s "$size" -c 1 -W 2 "$MASTER_ADDR" >/dev/null 2>&1; then
        fail head "the head answers, but a $MIN_MTU-byte unfragmented packet does not get through (path MTU below $MIN_MTU)" \
            "set MTU $MIN_MTU on the fabric interfaces of BOTH nodes (netplan) and on any switch in between"
        return
    fi
    pass head "head $MASTER_ADDR reachable with $MIN_MTU-byte frames"
}

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
run_check_env() {
    local mode=host env_file="$REPO/docker/.env" from_env=0
    while (($#)); do
        case $1 in
            --env-file) env_file=$2; shift 2 ;;
            --container) mode=container; from_env=1; shift ;;
            --environment) from_env=1; shift ;;
            *) echo "check-env: unknown argument $1" >&2; return 2 ;;
        esac
    done
    if ((!from_env)); then load_env_file "$env_file" || return 1; fi
    if check_vars "$mode"; then
        pass env "variables are well-formed (${mode})"
        return 0
    fi
    return 1
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

main() {
    local only="" skip="" c
    ENV_FILE="$REPO/docker/.env"
    case ${1:-} in
        check-env) shift; pick_python; run_check_env "$@"; return $? ;;
        resolve-gid) shift; run_resolve_gid; return $? ;;
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
    for c in env cache ports image; do want "$c" && needs_profile=1; done
    if ((needs_profile)); then load_profile; fi
    if want env; then check_vars host && pass env "variables are well-formed ($role)"; fi
    want compose && check_compose
    want gpu && check_gpu
    want image && check_image
    want overlay && check_overlay
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
