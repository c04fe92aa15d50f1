"""Post-start socket audit: may the LAN reach anything of vLLM's but the API?

Reads `ss -ltnp` output and judges the listening TCP sockets of the vLLM processes (the pids
of this node's container, or, without pids, processes named like vLLM or Python). The API
port may listen on every interface (the API key guards it). Every other port is inter-node
(torch.distributed store, ZeroMQ queues, Gloo/NCCL bootstrap), unauthenticated and
deserialized, so it must listen on the fabric address (VLLM_HOST_IP), on the fabric
interface, or on loopback; a wildcard or other address fails, unless the node lists the port
in FIREWALLED_PORTS (closed on every other interface by the host firewall).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .report import Report

_PROCESS = re.compile(r'\("([^"]*)",pid=([0-9]+)')
VLLM_NAMES = re.compile(r"vllm|python|pt_main_thread", re.IGNORECASE)
WILDCARDS = ("*", "0.0.0.0", "::")


@dataclass(frozen=True)
class Listener:
    """One listening socket: its address (brackets, %interface and ::ffff: removed)."""

    address: str
    interface: str
    port: int
    processes: tuple[tuple[str, int], ...]

    @property
    def where(self) -> str:
        at = f"{self.address}%{self.interface}" if self.interface else self.address
        names = ", ".join(f"{name} pid {pid}" for name, pid in self.processes) or "process unknown"
        return f"{at}:{self.port} ({names})"


def parse_ss(text: str) -> list[Listener]:
    """The LISTEN rows of `ss -ltnp` output (header and other rows skipped)."""
    rows = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 5 or fields[0] != "LISTEN":
            continue
        host, _, port = fields[3].rpartition(":")
        host, _, interface = host.strip("[]").partition("%")
        host = host.strip("[]").removeprefix("::ffff:")
        procs = tuple((n, int(p)) for n, p in _PROCESS.findall(" ".join(fields[5:])))
        rows.append(Listener(host, interface, int(port), procs))
    return rows


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _is_vllm(row: Listener, pids: set[int] | None) -> bool:
    if pids is not None:
        return any(pid in pids for _, pid in row.processes)
    return any(VLLM_NAMES.search(name) for name, _ in row.processes)


def _fixes(row: Listener, master_port: int, ifname: str, fabric_ip: str) -> list[str]:
    if row.port == master_port:
        return [f"port {row.port} is torch.distributed's store (the profile's master_port): it "
                "binds every interface whatever MASTER_ADDR says, so close it on the others: "
                f"sudo iptables -I INPUT -p tcp --dport {row.port} ! -i {ifname} -j DROP (and "
                f"the same with ip6tables), then add {row.port} to FIREWALLED_PORTS in docker/.env"]
    return [f"set VLLM_HOST_IP={fabric_ip} (ZeroMQ queues) and GLOO_SOCKET_IFNAME/"
            f"NCCL_SOCKET_IFNAME={ifname} (Gloo/NCCL bootstrap) in docker/.env, then make down "
            "and make up",
            "if it still listens there, that component ignores the settings: let the host "
            "firewall accept only the API port (and ssh) on the LAN interfaces"]


def check(
    rows: Iterable[Listener],
    env: Mapping[str, str],
    api_port: int,
    master_port: int,
    pids: set[int] | None,
    report: Report,
) -> None:
    """PASS/WARN/FAIL per listening vLLM socket, judged against this node's fabric settings."""
    fabric_ip, ifname = env.get("VLLM_HOST_IP", ""), env.get("NCCL_SOCKET_IFNAME", "")
    firewalled = {int(p) for p in env.get("FIREWALLED_PORTS", "").split(",") if p.strip()}
    api_host = env.get("API_HOST", "")
    ours = [row for row in rows if _is_vllm(row, pids)]
    if not ours:
        report.fail("audit", "no listening socket of the vLLM processes in the ss output",
                    "start this node first (make up) and run the audit once the head is healthy",
                    "run it as the user the container runs as, or with sudo (ss -p shows only "
                    "processes you may inspect)")
        return
    for row in ours:
        wildcard = row.address in WILDCARDS and not row.interface
        if row.port == api_port and env.get("NODE_RANK", "0") == "0":
            if api_host and row.address != api_host:
                report.fail("audit", f"the API listens on {row.where}, but API_HOST={api_host}",
                            "recreate the container so it picks up docker/.env: make down, make up")
            else:
                report.passed("audit", f"API {row.where}: reachable as configured, key required "
                              "unless ALLOW_UNAUTHENTICATED_API=1")
        elif _is_loopback(row.address):
            report.passed("audit", f"{row.where}: loopback, this node only")
        elif row.address == fabric_ip or (row.interface and row.interface == ifname):
            report.passed("audit", f"{row.where}: fabric only")
        elif row.port in firewalled:
            report.warn("audit", f"{row.where} is inter-node and listens beyond the fabric; "
                        "accepted because FIREWALLED_PORTS lists it (the host firewall must "
                        f"drop it on every interface but {ifname})")
        else:
            what = "every interface" if wildcard else "a non-fabric address"
            report.fail("audit", f"inter-node port {row.where} listens on {what}: reachable "
                        f"beyond the fabric link ({fabric_ip} on {ifname})",
                        *_fixes(row, master_port, ifname, fabric_ip))
