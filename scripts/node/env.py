"""The node `.env` file (docker/.env): how it is read and what each variable may hold.

Read like docker compose reads it, never sourced: `KEY=value` lines, optional `export `,
quotes and trailing ` # comments` stripped; a variable already set in the environment wins.
`check` validates the merged variables for the host (everything compose passes) or for the
container (what the entrypoint sees); every problem names the variable and how to fix it.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from . import api
from .report import Report

_LINE = re.compile(r"^\s*(export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_QUOTED = re.compile(r"""^(?:"(.*)"|'(.*)')\s*(#.*)?$""")
_TRAILING_COMMENT = re.compile(r"^(.*\S)?\s+#.*$")
_IPV4 = re.compile(r"^([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})$")
_HCA_ITEM = r"[A-Za-z0-9_.-]+(:[0-9]+)?"
_DURATION = r"([0-9]+(\.[0-9]+)?(us|ms|s|m|h))+"


def parse_env_file(path: Path, report: Report) -> dict[str, str] | None:
    """KEY -> value of the file, or None (with FAIL lines) when it cannot be used."""
    if not path.is_file():
        report.fail("env", f"{path} not found",
                    "cp docker/.env.example docker/.env on each node and fill it in "
                    "(NODE_RANK=0 on the head, 1..N-1 on the workers)")
        return None
    raw = path.read_bytes()
    if b"\r" in raw:
        report.fail("env", f"{path} has Windows (CRLF) line endings; values would end in a "
                    "carriage return", f"sed -i 's/\\r$//' {path}")
        return None
    values: dict[str, str] = {}
    ok = True
    for n, line in enumerate(raw.decode("utf-8", "surrogateescape").split("\n"), start=1):
        line = line.removeprefix("\ufeff")
        if re.fullmatch(r"\s*(#.*)?", line):
            continue
        m = _LINE.match(line)
        if not m:
            report.fail("env", f"{path} line {n} is not KEY=value: {line}", "fix or remove that line")
            ok = False
            continue
        value = m.group(3)
        quoted = _QUOTED.match(value)
        if quoted:
            value = quoted.group(1) if quoted.group(1) is not None else quoted.group(2)
        else:
            trailing = _TRAILING_COMMENT.match(value)
            value = (trailing.group(1) or "") if trailing else value
            value = value.rstrip()
        values[m.group(2)] = value
    return values if ok else None


def exports(values: Mapping[str, str], environ: Mapping[str, str]) -> str:
    """`export KEY=value` lines (shell-quoted) for the keys the environment does not set."""
    return "".join(
        f"export {k}={shlex.quote(v)}\n" for k, v in values.items() if k not in environ
    )


# Set by `make rehearse --loopback` only (compose never passes it): both "nodes" on one
# machine's loopback, where network namespaces cannot be made.
LOOPBACK_BYPASS = "DSPARK_LOOPBACK_REHEARSAL"
_LOOPBACK = "is a loopback/unspecified address"


def _ipv4(name: str, what: str) -> Callable[[str], tuple[str, str] | None]:
    def problem(value: str) -> tuple[str, str] | None:
        m = _IPV4.match(value)
        if not m or any(int(o) > 255 for o in m.groups()):
            return "is not an IPv4 address", (
                f"set {name} to {what} (dotted IPv4, e.g. 192.168.100.10; no hostnames, no IPv6)"
            )
        if value.startswith("127.") or value == "0.0.0.0":
            return _LOOPBACK, (
                f"set {name} to {what}; the other node must be able to reach it"
            )
        return None

    return problem


def _gid_index(value: str) -> tuple[str, str] | None:
    if value in ("auto", "nccl") or (re.fullmatch(r"[0-9]{1,3}", value) and int(value) <= 255):
        return None
    return "is not auto, nccl or an index 0-255", (
        "set NCCL_IB_GID_INDEX=auto (resolved from sysfs at every start; the index moves "
        "across reboots)"
    )


def _pattern(regex: str, problem: str, fix: str) -> Callable[[str], tuple[str, str] | None]:
    return lambda value: None if re.fullmatch(regex, value) else (problem, fix)


@dataclass(frozen=True)
class Var:
    """One variable: where it must be set (and what to do if not), where its format is checked."""

    name: str
    required_in: tuple[str, ...]
    when_missing: str
    check: Callable[[str], tuple[str, str] | None] | None = None
    checked_in: tuple[str, ...] = ("host", "container")


_FABRIC_HEAD = "the head node's fabric (RoCE) IPv4 address"
_FABRIC_SELF = "this node's fabric (RoCE) IPv4 address"
_IFNAME = _pattern(r"[A-Za-z0-9_.-]{1,15}", "is not one interface name",
                   "set it to a single interface name such as enp1s0f0np0 (no lists, no ^/= prefixes)")
_BOTH, _HOST = ("host", "container"), ("host",)

# NODE_RANK is checked against the profile's number of nodes in `check`.
VARIABLES = (
    Var("NODE_RANK", _BOTH, "set NODE_RANK=0 on the head node and 1..N-1 on the N-1 workers "
        "(one rank per node)"),
    Var("MASTER_ADDR", _BOTH, f"set MASTER_ADDR to {_FABRIC_HEAD}, the same on both nodes",
        _ipv4("MASTER_ADDR", _FABRIC_HEAD)),
    Var("VLLM_HOST_IP", _BOTH, f"set VLLM_HOST_IP to {_FABRIC_SELF}",
        _ipv4("VLLM_HOST_IP", _FABRIC_SELF)),
    Var("NCCL_SOCKET_IFNAME", _BOTH, "set NCCL_SOCKET_IFNAME to this node's fabric interface "
        "(ibdev2netdev lists them, e.g. enp1s0f0np0)", _IFNAME),
    Var("NCCL_IB_HCA", _BOTH, "set NCCL_IB_HCA to this node's RoCE HCAs, e.g. "
        "=rocep1s0f0,roceP2p1s0f0 (ibdev2netdev)",
        _pattern(rf"\^?=?{_HCA_ITEM}(,{_HCA_ITEM})*", "is not an NCCL HCA list",
                 "use NCCL's form: [^][=]name[:port][,name[:port]...], e.g. =rocep1s0f0,roceP2p1s0f0")),
    Var("MODEL_CACHE_DIR", _HOST, "set MODEL_CACHE_DIR to the host directory used as HF_HOME "
        "(it contains hub/), e.g. /home/you/.cache/huggingface",
        _pattern(r"/.*", "is not an absolute path",
                 "use an absolute host path, e.g. /home/you/.cache/huggingface"), _HOST),
    Var("GLOO_SOCKET_IFNAME", (), "", _IFNAME),
    Var("TP_SOCKET_IFNAME", (), "", _IFNAME),
    Var("NCCL_IB_GID_INDEX", (), "", _gid_index),
    Var("HEAD_WAIT_TIMEOUT_S", (), "", _pattern(r"[0-9]+", "is not a number of seconds",
                                                "e.g. HEAD_WAIT_TIMEOUT_S=900")),
    Var("HEAD_WATCH_INTERVAL_S", (), "", _pattern(r"[1-9][0-9]*", "is not a whole number of "
        "seconds above 0", "e.g. HEAD_WATCH_INTERVAL_S=3")),
    Var("HEAD_WATCH_MISSES", (), "", _pattern(r"[1-9][0-9]*", "is not a count above 0",
                                              "e.g. HEAD_WATCH_MISSES=2")),
    Var("SHM_SIZE", (), "", lambda v: _pattern(r"[0-9]+(b|k|m|g|kb|mb|gb)?", "is not a size",
                                               "e.g. SHM_SIZE=64gb")(v.lower()), _HOST),
    Var("RESTART_POLICY", (), "", _pattern(
        r"no|always|unless-stopped|on-failure(:[0-9]+)?", "is not a Docker restart policy",
        "use unless-stopped (default), on-failure, always or no"), _HOST),
    Var("STOP_GRACE_PERIOD", (), "", _pattern(_DURATION, "is not a duration",
                                              "e.g. STOP_GRACE_PERIOD=30s"), _HOST),
    Var("HEALTH_START_PERIOD", (), "", _pattern(_DURATION, "is not a duration",
                                                "e.g. HEALTH_START_PERIOD=45m"), _HOST),
    Var("CONTAINER_UID", (), "", _pattern(r"[0-9]+", "is not a numeric id",
        "use the numeric id that owns MODEL_CACHE_DIR (id -u / id -g)"), _HOST),
    Var("CONTAINER_GID", (), "", _pattern(r"[0-9]+", "is not a numeric id",
        "use the numeric id that owns MODEL_CACHE_DIR (id -u / id -g)"), _HOST),
    Var("DSPARK_IMAGE", (), "", lambda v: None if "@" not in v and not re.search(r"\s", v) else (
        "must be a plain name:tag (make image tags it; a digest cannot be a build tag)",
        "e.g. DSPARK_IMAGE=dspark-vllm:local"), _HOST),
)  # fmt: skip


def _roles(env: Mapping[str, str], report: Report) -> None:
    """MASTER_ADDR is the head's own address on the head and never the worker's own."""
    rank, master, me = env.get("NODE_RANK", ""), env.get("MASTER_ADDR", ""), env.get("VLLM_HOST_IP", "")
    if rank == "0" and master and me and master != me:
        report.fail("env", f"on the head (NODE_RANK=0) MASTER_ADDR={master} must be this node's "
                    f"own address, but VLLM_HOST_IP={me}",
                    "use the head's fabric IP for both MASTER_ADDR and VLLM_HOST_IP here")
    if re.fullmatch(r"[1-9][0-9]*", rank) and master and master == me:
        report.fail("env", f"on a worker MASTER_ADDR ({master}) must be the head's address, not "
                    "this node's (VLLM_HOST_IP)",
                    "set MASTER_ADDR to the head's fabric IP and VLLM_HOST_IP to this node's")


def _rank_fix(nnodes: int) -> str:
    if nnodes == 1:
        return "set NODE_RANK=0: this profile runs on one node"
    workers = "NODE_RANK=1 on the worker" if nnodes == 2 else \
        f"NODE_RANK=1..{nnodes - 1} on the workers, a different one on each"
    return f"set NODE_RANK=0 on the head and {workers}"


def check(env: Mapping[str, str], mode: str, nnodes: int, report: Report) -> bool:
    """Validate the variables for `mode` (host or container); True when all are usable."""
    before = report.fails
    for var in VARIABLES:
        if mode in var.required_in and not env.get(var.name):
            report.fail("env", f"{var.name} is not set", var.when_missing)
    rank = env.get("NODE_RANK", "")
    if rank and not (rank.isascii() and rank.isdigit() and int(rank) < nnodes):
        report.fail("env", f"NODE_RANK='{rank}' is not a node rank of this {nnodes}-node profile",
                    _rank_fix(nnodes))
    bypass = env.get(LOOPBACK_BYPASS) == "1"
    if bypass:
        report.warn("env", f"{LOOPBACK_BYPASS}=1: loopback addresses accepted for MASTER_ADDR and "
                    "VLLM_HOST_IP (a one-machine rehearsal without network namespaces only)")
    for var in VARIABLES:
        value = env.get(var.name, "")
        problem = var.check(value) if value and var.check and mode in var.checked_in else None
        if problem and bypass and problem[0] == _LOOPBACK and value.startswith("127."):
            problem = None
        if problem:
            report.fail("env", f"{var.name}='{value}' {problem[0]}", problem[1])
    _roles(env, report)
    api.check(env, report)
    return report.fails == before
