"""One rehearsal node: its `.env`, the environment its container would see, its process tree.

The `.env` is written from ``docker/.env.example`` with this node's values filled in (the
comments stay), read back the way compose reads it (``scripts/node/env.py``), and turned into
the container environment by interpolating ``docker/compose.yaml``'s ``environment:`` section,
so the real ``docker/entrypoint.sh`` sees what it would see on a Spark. The few variables the
CPU twin needs beyond that (thread binding, a private TMPDIR, where the venv is) are the
image's and the host's part, listed in ``CPU_NODE_VARS``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from scripts.node.env import LOOPBACK_BYPASS, parse_env_file
from scripts.node.report import Report

from .netns import Host

REPO = Path(__file__).resolve().parents[2]
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
ENV_EXAMPLE = REPO / "docker" / ".env.example"
COMPOSE = REPO / "docker" / "compose.yaml"
# Beyond what compose passes: the CPU build's thread binding (one core set per node) and the
# image's fixed environment (Dockerfile ENV), pointed at this checkout's venv.
CPU_NODE_VARS = ("VLLM_CPU_OMP_THREADS_BIND", LOOPBACK_BYPASS)
# The kernel choice of the machine the rehearsal runs on (an ISA cap, forced torch kernels):
# the nodes must compute as the scorer, which runs in the rehearsal's own environment, does.
HOST_KERNEL_VARS = ("ONEDNN_MAX_CPU_ISA", "DSPARK_CPU_KERNELS")
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:-|:\?)([^${}]*))?\}")


def compose_environment(values: dict[str, str]) -> dict[str, str]:
    """compose.yaml's `environment:` for this .env, interpolated as compose does
    (``${X}``, ``${X:-default}``, ``${X:?message}``, nested defaults)."""
    service = yaml.safe_load(COMPOSE.read_text())["services"]["vllm"]
    out = {}
    for name, raw in service["environment"].items():
        text = str(raw)
        while (m := _VAR.search(text)) is not None:
            var, op, arg = m.groups()
            value = values.get(var, "")
            if op == ":?" and not value:
                raise ValueError(f"{var}: {arg}")
            if op == ":-" and not value:
                value = arg or ""
            text = text[: m.start()] + value + text[m.end() :]
        out[name] = text
    return out


def write_env_file(path: Path, values: dict[str, str]) -> None:
    """docker/.env.example with ``values`` filled in; keys the example lacks go at the end."""
    lines, seen = [], set()
    for line in ENV_EXAMPLE.read_text().splitlines():
        key = line.split("=", 1)[0]
        if "=" in line and not line.startswith("#") and key in values:
            line = f"{key}={values[key]}"
            seen.add(key)
        lines.append(line)
    extra = [k for k in values if k not in seen]
    if extra:
        lines += ["", "# ---- CPU rehearsal only (the Spark image and host provide these) ----"]
        lines += [f"{k}={values[k]}" for k in extra]
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o600)


def read_env_file(path: Path) -> dict[str, str]:
    report = Report()
    values = parse_env_file(path, report)
    if values is None:
        raise ValueError(f"{path}: not a usable .env file")
    return values


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant, from /proc (parents before children)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if Path(f"/proc/{pid}").exists():
            out.append(pid)
            todo.extend(children.get(pid, []))
    return out


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks (tells a reused pid from the one we saw)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes (the ones still alive)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / tick


@dataclass
class Node:
    """A node's role, host and files; ``start()`` runs ``entrypoint.sh serve`` in its host."""

    role: str  # head | worker
    host: Host
    env_values: dict[str, str]
    rundir: Path
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    starts: int = 0
    known_pids: dict[int, int | None] = field(default_factory=dict)  # pid -> start

    @property
    def env_file(self) -> Path:
        return self.rundir / f"{self.role}.env"

    @property
    def log(self) -> Path:
        return self.rundir / f"{self.role}.log"

    def environment(self) -> dict[str, str]:
        """What the container would see: compose's environment for this .env, the image's
        (PATH finds this checkout's venv first, as the image's finds /opt/venv)."""
        values = read_env_file(self.env_file)
        env = compose_environment(values)
        env.update({k: values[k] for k in CPU_NODE_VARS if k in values})
        env.update({k: os.environ[k] for k in HOST_KERNEL_VARS if k in os.environ})
        tmp = self.rundir / f"{self.role}-tmp"
        tmp.mkdir(exist_ok=True)
        venv = REPO / ".venv" / "bin"
        env.update(
            PATH=f"{venv}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            HOME=str(tmp),
            TMPDIR=str(tmp),
            PYTHONUNBUFFERED="1",
            DSPARK_HOME=str(REPO),
            HF_HOME=str(tmp / "hf"),
        )
        return env

    def run(self, argv: list[str], timeout: float, extra: dict | None = None):
        """A one-off command inside this node's host with its container environment."""
        env = {**self.environment(), **(extra or {})}
        return subprocess.run(self.host.wrap(argv), env=env, capture_output=True, text=True,
                              timeout=timeout, cwd=REPO)  # fmt: skip

    def start(self, extra: dict | None = None) -> None:
        write_env_file(self.env_file, {**self.env_values, **(extra or {})})
        env = self.environment()
        self.starts += 1
        with self.log.open("a") as log:
            log.write(f"\n===== start {self.starts} of the {self.role} =====\n")
            log.flush()
            self.proc = subprocess.Popen(self.host.wrap([str(ENTRYPOINT), "serve"]), env=env,
                                         stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                         start_new_session=True)  # fmt: skip
        self.started_at = time.monotonic()

    def pids(self) -> list[int]:
        if self.proc is None:
            return []
        tree = process_tree(self.proc.pid)
        for pid in tree:
            self.known_pids.setdefault(pid, start_time(pid))
        return tree

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole tree (the node dying); vLLM's own process groups included."""
        for pid in self.pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, grace: float = 20.0) -> int | None:
        """SIGTERM the node as `docker stop` would, SIGKILL its tree after ``grace``."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.pids()
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        self.reap()
        return self.proc.returncode

    def reap(self) -> None:
        """SIGKILL every process this node ever had that still lives (orphans included)."""
        self.pids()
        for pid, started in self.known_pids.items():
            if started is not None and start_time(pid) == started:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.proc is not None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.known_pids.clear()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""
