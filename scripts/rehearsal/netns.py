"""Several "hosts" on one machine: network namespaces joined by the fabric.

Two hosts are joined by one veth pair (the Sparks' direct QSFP link); more are joined by a
bridge in a namespace of its own (the RoCE switch), one veth pair per host. Each host
namespace gets its end with a private address (``10.199.x.1``, ``.2``, ...; MTU 9000 as on
the Sparks' fabric) and its loopback; nothing is routed to or from the machine's own network. Commands run in a namespace through ``ip netns exec`` plus a private
mount namespace with its own tmpfs ``/dev/shm``, so vLLM's shared-memory "same node" probe sees
another node, as it would across two Sparks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

MTU = 9000


class NamespacesUnavailable(RuntimeError):
    """This machine or user cannot create network namespaces (not root, no CAP_NET_ADMIN)."""


@dataclass(frozen=True)
class Host:
    """One end of the fabric link: its namespace, interface and address."""

    netns: str | None  # None: this machine's own network (the loopback fallback)
    ifname: str
    ip: str

    def wrap(self, argv: list[str], shm_size: str = "2g") -> list[str]:
        """``argv`` run inside this host: its network namespace and a private /dev/shm."""
        if self.netns is None:
            return argv
        script = 'mount -t tmpfs -o "size=$0" tmpfs /dev/shm && exec "$@"'
        return ["ip", "netns", "exec", self.netns, "unshare", "--mount", "--propagation",
                "private", "sh", "-c", script, shm_size, *argv]  # fmt: skip


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "not root: creating network namespaces needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN)"
    for tool in ("ip", "unshare", "ss"):
        if shutil.which(tool) is None:
            return f"{tool} not found (apt install iproute2 util-linux)"
    probe = f"dspark-probe-{os.getpid()}"
    proc = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"ip netns add failed: {proc.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


class Fabric:
    """The host namespaces and their fabric; ``close()`` removes them (idempotent).

    ``hosts[0]`` is the head, the others the workers by rank."""

    def __init__(self, tag: str, subnet: int, nodes: int = 2):
        if nodes < 2:
            raise ValueError(f"nodes must be >= 2, got {nodes}")
        self.tag = tag
        self.hosts = [
            Host(f"dspark-{tag}-{'head' if i == 0 else f'worker{i}'}"[:40], f"dsp{tag}h{i}"[:15],
                 f"10.199.{subnet}.{i + 1}")
            for i in range(nodes)
        ]  # fmt: skip
        self.switch = f"dspark-{tag}-switch" if nodes > 2 else None
        self.created: list[str] = []

    @property
    def head(self) -> Host:
        return self.hosts[0]

    def open(self) -> Fabric:
        reason = unavailable_reason()
        if reason:
            raise NamespacesUnavailable(reason)
        try:
            for host in self.hosts:
                _ip("netns", "add", host.netns)
                self.created.append(host.netns)
                _ip("-n", host.netns, "link", "set", "lo", "up")
            if self.switch is None:
                head, worker = self.hosts
                _ip("link", "add", head.ifname, "type", "veth", "peer", "name", worker.ifname)
                for host in self.hosts:
                    _ip("link", "set", host.ifname, "netns", host.netns)
            else:
                self._switched()
            for host in self.hosts:
                _ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", host.ifname)
                _ip("-n", host.netns, "link", "set", host.ifname, "mtu", str(MTU), "up")
        except Exception:
            self.close()
            raise
        return self

    def _switched(self) -> None:
        """A bridge in the switch namespace, one veth pair from each host to one of its ports."""
        _ip("netns", "add", self.switch)
        self.created.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        for i, host in enumerate(self.hosts):
            port = f"dsp{self.tag}p{i}"[:15]
            _ip("link", "add", host.ifname, "type", "veth", "peer", "name", port)
            _ip("link", "set", host.ifname, "netns", host.netns)
            _ip("link", "set", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "mtu", str(MTU), "master", "br0", "up")
        _ip("-n", self.switch, "link", "set", "br0", "mtu", str(MTU), "up")

    def close(self) -> None:
        """Delete the namespaces (the veth pairs and the bridge go with them)."""
        while self.created:
            subprocess.run(["ip", "netns", "delete", self.created.pop()], capture_output=True)

    def __enter__(self) -> Fabric:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


class LoopbackFabric:
    """The fallback where namespaces cannot be made: every node on this machine's loopback
    (127.0.0.1, 127.0.0.2, ... on ``lo``), sharing /dev/shm, so vLLM may take its same-node
    shared-memory path between them. Weaker than the namespaces; the caller says so."""

    def __init__(self, nodes: int = 2):
        self.hosts = [Host(None, "lo", f"127.0.0.{i + 1}") for i in range(nodes)]

    @property
    def head(self) -> Host:
        return self.hosts[0]

    def open(self) -> LoopbackFabric:
        return self

    def close(self) -> None:
        pass
