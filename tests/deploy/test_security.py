"""The Spark stack closed by default: the API key guards every path but /health, and the
post-start socket audit tells inter-node ports that reach beyond the fabric link.

The ss fixtures (tests/fixtures/ss_*.txt) are `ss -ltnp` output in iproute2's layout for a
head and a worker (no Spark recording exists yet); the last audit test records real `ss -ltnp`
output on this machine around a real torch.distributed store, whose wildcard bind is the one
inter-node leak no setting fixes.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.paths import FIXTURES  # noqa: E402
from tests.support.spark_host import API_KEY, PREFLIGHT, REPO, FakeHost, node_env, write_env

HEAD_PIDS = "40211\n40388\n40512"  # `docker top` of the head container in ss_head_*.txt


def audit(tmp_path: Path, ss_fixture: str, rank: int = 0, pids: str = HEAD_PIDS, **over: str):
    """`scripts/preflight.sh audit` on a fake host whose ss prints the fixture."""
    host = FakeHost(tmp_path / "host")
    env_file = write_env(tmp_path / "node.env", node_env(rank, tmp_path, **over))
    env = host.env(FAKE_SS=str(FIXTURES / ss_fixture), FAKE_DOCKER_PS="c0ffee",
                   FAKE_DOCKER_TOP=pids)
    r = subprocess.run([str(PREFLIGHT), "audit", "--env-file", str(env_file)], env=env,
                       capture_output=True, text=True, timeout=60)
    return r.returncode, r.stdout + r.stderr


def test_audit_passes_a_clean_head_with_the_store_port_firewalled(tmp_path):
    rc, out = audit(tmp_path, "ss_head_clean.txt", FIREWALLED_PORTS="29501")
    assert rc == 0, out
    assert "PASS  audit    API 0.0.0.0:8000 (vllm pid 40211)" in out
    assert "PASS  audit    192.168.100.10:45293 (VLLM::EngineCor pid 40388): fabric only" in out
    assert "PASS  audit    127.0.0.1:40923 (vllm pid 40211): loopback" in out
    assert "WARN  audit    *:29501 (VLLM::Worker_TP pid 40512)" in out
    assert "sshd" not in out  # not a vLLM process: none of the audit's business
    assert out.rstrip().endswith("audit: OK (1 warning(s))")


def test_audit_flags_each_leaky_inter_node_port_and_says_what_to_set(tmp_path):
    rc, out = audit(tmp_path, "ss_head_leaky.txt", FIREWALLED_PORTS="29501")
    assert rc == 1, out
    fails = [ln for ln in out.splitlines() if ln.startswith("FAIL")]
    assert fails == [
        "FAIL  audit    inter-node port 0.0.0.0:45293 (VLLM::EngineCor pid 40388) listens on "
        "every interface: reachable beyond the fabric link (192.168.100.10 on enp1s0f0np0)",
        "FAIL  audit    inter-node port 10.20.0.5:41235 (VLLM::Worker_TP pid 40512) listens on "
        "a non-fabric address: reachable beyond the fabric link (192.168.100.10 on enp1s0f0np0)",
    ]
    assert "fix: set VLLM_HOST_IP=192.168.100.10 (ZeroMQ queues) and GLOO_SOCKET_IFNAME/" \
           "NCCL_SOCKET_IFNAME=enp1s0f0np0" in out
    assert "audit: FAILED (2 problem(s))" in out


def test_audit_flags_the_wildcard_store_port_until_it_is_firewalled(tmp_path):
    rc, out = audit(tmp_path, "ss_head_clean.txt")
    assert rc == 1, out
    assert "FAIL  audit    inter-node port *:29501 (VLLM::Worker_TP pid 40512) listens on " \
           "every interface" in out
    assert "sudo iptables -I INPUT -p tcp --dport 29501 ! -i enp1s0f0np0 -j DROP" in out
    assert "add 29501 to FIREWALLED_PORTS" in out


def test_audit_worker_and_interface_bound_sockets(tmp_path):
    rc, out = audit(tmp_path, "ss_worker_clean.txt", rank=1, pids="7731\n7702")
    assert rc == 0, out
    assert "PASS  audit    0.0.0.0%enp1s0f0np0:43001 (VLLM::Worker_TP pid 7731): fabric only" in out


def test_audit_only_judges_the_container_pids(tmp_path):
    """A pid outside the container is skipped even with a vLLM-like name; with no container
    pids at all, process names decide, and a host with no vLLM socket fails."""
    rc, out = audit(tmp_path, "ss_head_leaky.txt", pids="40211", FIREWALLED_PORTS="29501")
    assert rc == 0 and "40388" not in out and "40512" not in out, out
    rc, out = audit(tmp_path, "ss_head_leaky.txt", pids="", FIREWALLED_PORTS="29501")
    assert rc == 1 and "0.0.0.0:45293" in out and "sshd" not in out, out
    rc, out = audit(tmp_path, "ss_head_clean.txt", pids="999")
    assert rc == 1 and "no listening socket of the vLLM processes" in out, out


def test_audit_against_a_real_torch_distributed_store(tmp_path):
    """torch's TCPStore binds every interface although it is told 127.0.0.1: real `ss -ltnp`
    on this machine, this process's pid, a profile whose master_port is the store's port."""
    if subprocess.run(["sh", "-c", "command -v ss"], capture_output=True).returncode:
        pytest.skip("no ss (iproute2) on this machine")
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True)
    port = store.port
    saved = tmp_path / "ss.txt"
    saved.write_text(subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout)
    del store
    profile = yaml.safe_load((REPO / "recipe" / "profiles" / "spark-2x.yaml").read_text())
    profile["parallel"]["master_port"] = port
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(profile))
    env = dict(os.environ, VLLM_HOST_IP="192.168.100.10", NCCL_SOCKET_IFNAME="enp1s0f0np0",
               NODE_RANK="0", FIREWALLED_PORTS="")
    r = subprocess.run([sys.executable, "-m", "scripts.recipe", "audit",
                        str(tmp_path / "p.yaml"), "--ss", str(saved), "--pids", str(os.getpid())],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f":{port} " in r.stdout and "listens on every interface" in r.stdout
    assert "torch.distributed's store" in r.stdout


def test_render_api_host_overrides_the_profile_bind_address():
    def render(*extra):
        return subprocess.run([sys.executable, "-m", "scripts.recipe", "render",
                               "spark-2x", "--as", "argv", *extra],
                              cwd=REPO, capture_output=True, text=True, timeout=60)

    argv = render().stdout.splitlines()
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    argv = render("--api-host", "127.0.0.1").stdout.splitlines()
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    bad = render("--api-host", "spark.lan")
    assert bad.returncode == 2 and "--api-host: 'spark.lan' is not an IPv4 address" in bad.stderr


def guarded_status(path: str, authorization: str | None) -> int:
    """Status vLLM's (overlay-patched) API key middleware gives one GET request."""
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    headers = [(b"authorization", authorization.encode())] if authorization else []
    scope = {"type": "http", "method": "GET", "path": path, "root_path": "", "headers": headers}
    asyncio.run(AuthenticationMiddleware(app, tokens=[API_KEY])(scope, receive, send))
    return sent[0]["status"]


@pytest.mark.parametrize("path", ["/v1/models", "/invocations", "/metrics", "/tokenize", "/ping",
                                  "/version", "/v1/chat/completions"])
def test_api_key_guards_every_path_but_health(path):
    """Upstream guards only /v1, /v2, /inference and /cohere; /invocations runs the same
    inference. Oracle: the rule itself (only /health is open), per path."""
    assert guarded_status(path, None) == 401
    assert guarded_status(path, "Bearer wrong-key-000000000") == 401
    assert guarded_status(path, f"Bearer {API_KEY}") == 200
    assert guarded_status("/health", None) == 200
