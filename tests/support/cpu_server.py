"""The real cpu-tiny server for end-to-end tests: `scripts/serve.py` on a free loopback port.

`start_cpu_tiny_server(log)` starts it in its own session, waits (bounded) for /health, yields a
`CpuServer` and always stops the whole process group. `process_tree_rss` reads the memory
of the server and its engine processes from /proc, for tests that report it. The tests
share one server through the session fixture `cpu_tiny_server` (conftest.py).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from scripts.bench.ab import stop_process_group
from tests.support.net import free_port

STARTUP_S = 600
# The shared server requires this key, as a Spark head does (README "Operating", security).
CPU_TINY_API_KEY = "cpu-tiny-test-key-7d1e0b93"
# Prefix caching on, as spark-2x serves, so clients see cache hits in usage (the cpu-tiny
# profile keeps it off for the in-process engines of the end-to-end oracles); prompt logprobs
# over the whole (tiny) vocabulary, for teacher forcing under a grammar.
SERVER_ARGS = ("--enable-prefix-caching", "--max-logprobs", "-1")


@dataclass(frozen=True)
class CpuServer:
    base_url: str
    pid: int  # the API server (serve.py execs it)
    log: Path
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        """What every client request carries."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@contextlib.contextmanager
def start_cpu_tiny_server(
    log: Path, api_key: str | None = CPU_TINY_API_KEY, startup_s: float = STARTUP_S
) -> Iterator[CpuServer]:
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("VLLM_API_KEY", None)
    if api_key:
        env["VLLM_API_KEY"] = api_key
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # serve.py gives the server a fresh one
    cmd = [sys.executable, "-m", "scripts.serve", "--profile", "cpu-tiny"]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*cmd, "--", "--port", str(port), *SERVER_ARGS],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + startup_s
    try:
        while not _healthy(base):
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after {startup_s}s:\n{log.read_text()[-4000:]}")
            time.sleep(2)
        yield CpuServer(base, proc.pid, log, api_key)
    finally:
        stop_process_group(proc, grace_s=30)


def _healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def child_pids(pid: int) -> set[int]:
    """All descendants of pid (the engine core and its workers for a vLLM server)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*/children"):
            kids = {int(k) for k in task.read_text().split()}
            todo.extend(kids - found)
            found |= kids
    return found


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def process_tree_rss(pid: int) -> dict[str, float]:
    """Resident memory (MiB) of the API server and of it plus its descendants."""
    tree = sum(rss_mib(p) for p in child_pids(pid) if Path(f"/proc/{p}").exists())
    api = rss_mib(pid)
    return {"api_server_mib": api, "server_tree_mib": api + tree}
