# The `head` check of scripts/preflight.sh, sourced by it (it uses its pass/warn/fail and
# MIN_MTU): a worker's link to the head. Every worker of two or four nodes runs it against the
# head only; the head passes it by itself.
# shellcheck shell=bash
check_head() {
    if [[ ${NODE_RANK:-0} == 0 ]]; then
        pass head "this node is the head (NODE_RANK=0)"
        return
    fi
    if ! command -v ping >/dev/null 2>&1; then
        warn head "ping not found: cannot check that the head at $MASTER_ADDR is reachable"
        return
    fi
    # Behind a switch (four nodes) a worker whose fabric address sits in another subnet reaches
    # the head over the LAN: ping answers, but NCCL and gloo would bootstrap over the wrong link.
    local dev="" via=()
    if [[ -n ${NCCL_SOCKET_IFNAME:-} ]]; then
        via=(-I "$NCCL_SOCKET_IFNAME")
        if command -v ip >/dev/null 2>&1; then
            dev=$(ip -o -4 route get "$MASTER_ADDR" 2>/dev/null | sed -n 's/.* dev \([^ ]*\).*/\1/p')
        fi
        if [[ -n $dev && $dev != "$NCCL_SOCKET_IFNAME" ]]; then
            fail head "the route to the head MASTER_ADDR=$MASTER_ADDR leaves through $dev, not the fabric interface NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME" \
                "give every node's fabric interface an address in the head's fabric subnet (netplan; behind a switch one /24 for all nodes)" \
                "MASTER_ADDR must be the head's fabric IP, not its LAN address"
            return
        fi
    fi
    if ! ping "${via[@]}" -c 1 -W 2 "$MASTER_ADDR" >/dev/null 2>&1; then
        fail head "the head at MASTER_ADDR=$MASTER_ADDR does not answer ping from this worker${dev:+ over $dev}" \
            "check the cable (or the switch port) and the netplan addresses of this node and the head; MASTER_ADDR must be the head's fabric IP (same subnet as VLLM_HOST_IP=$VLLM_HOST_IP)"
        return
    fi
    local size=$((MIN_MTU - 28))
    if ! ping "${via[@]}" -M "do" -s "$size" -c 1 -W 2 "$MASTER_ADDR" >/dev/null 2>&1; then
        fail head "the head answers, but a $MIN_MTU-byte unfragmented packet does not get through (path MTU below $MIN_MTU)" \
            "set MTU $MIN_MTU on the fabric interfaces of this node and the head (netplan) and on every switch port in between"
        return
    fi
    pass head "head $MASTER_ADDR reachable with $MIN_MTU-byte frames${dev:+ over $dev}"
}
