"""The rehearsal's node plumbing (scripts/rehearsal/node.py), without engines or root.

A node's `.env` is docker/.env.example with its values filled in, read back by the same
parser compose-facing tools use; its container environment is compose.yaml's `environment:`
interpolated the way compose does it; teardown finds a node's whole process tree.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from scripts.rehearsal.node import (
    Node,
    compose_environment,
    cpu_seconds,
    process_tree,
    read_env_file,
    write_env_file,
)
from tests.support.paths import REPO

VALUES = {
    "NODE_RANK": "1",
    "MASTER_ADDR": "10.199.7.1",
    "VLLM_HOST_IP": "10.199.7.2",
    "NCCL_SOCKET_IFNAME": "dsp7w",
    "NCCL_IB_HCA": "=rehearsal0",
    "MODEL_CACHE_DIR": "/tmp/hf",
    "VLLM_CPU_OMP_THREADS_BIND": "1",
}


def test_env_file_is_the_example_filled_in_and_reads_back(tmp_path):
    path = tmp_path / "worker.env"
    write_env_file(path, VALUES)
    text = path.read_text()
    example = (REPO / "docker" / ".env.example").read_text()
    assert text.splitlines()[0] == example.splitlines()[0]  # the example's comments stay
    assert path.stat().st_mode & 0o777 == 0o600
    values = read_env_file(path)
    assert {k: values[k] for k in VALUES} == VALUES
    assert values["NCCL_DEBUG"] == "WARN"  # untouched example defaults stay
    assert text.count("NODE_RANK=") == 1
    # a key the example lacks is appended under its own heading
    assert text.index("VLLM_CPU_OMP_THREADS_BIND=1") > text.index("CPU rehearsal only")


def test_compose_environment_interpolates_defaults_and_required(tmp_path):
    env = compose_environment(VALUES)
    assert env["NODE_RANK"] == "1" and env["MASTER_ADDR"] == "10.199.7.1"
    assert env["GLOO_SOCKET_IFNAME"] == "dsp7w"  # ${GLOO_SOCKET_IFNAME:-${NCCL_SOCKET_IFNAME}}
    assert env["NCCL_NET"] == "IB" and env["HEAD_WAIT_TIMEOUT_S"] == "900"  # :- defaults
    assert env["VLLM_NO_USAGE_STATS"] == "1"  # constants pass as they are
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env  # compose passes only what it lists
    missing = dict(VALUES)
    del missing["MASTER_ADDR"]
    with pytest.raises(ValueError, match="MASTER_ADDR: MASTER_ADDR is required"):
        compose_environment(missing)


def test_node_environment_carries_the_machines_kernel_choice(tmp_path, monkeypatch):
    # The scorer runs in the rehearsal's own environment; under an ISA cap or forced torch
    # kernels the nodes must compute the same way, or a lossless run scores as lossy.
    write_env_file(tmp_path / "worker.env", VALUES)
    node = Node(role="worker", host=None, env_values=VALUES, rundir=tmp_path)
    monkeypatch.delenv("DSPARK_CPU_KERNELS", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "SSE41")
    env = node.environment()
    assert env["ONEDNN_MAX_CPU_ISA"] == "SSE41" and "DSPARK_CPU_KERNELS" not in env
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["NODE_RANK"] == "1"
    monkeypatch.setenv("DSPARK_CPU_KERNELS", "torch")
    assert node.environment()["DSPARK_CPU_KERNELS"] == "torch"


def test_process_tree_finds_children_and_grandchildren():
    proc = subprocess.Popen(["sh", "-c", "sh -c 'sleep 30; true' & sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(tree := process_tree(proc.pid)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tree[0] == proc.pid and len(tree) == 4, tree
        assert cpu_seconds(tree) >= 0.0
    finally:
        for pid in reversed(process_tree(proc.pid)):
            subprocess.run(["kill", "-9", str(pid)])
        proc.wait()


@pytest.mark.parametrize("nodes", [2, 4])
def test_fabric_joins_every_host_and_leaves_nothing(nodes):
    """The rehearsal's fabric (root only): every worker and the head reach each other at MTU
    9000 over the link (2) or the bridge (4); closing it deletes every namespace it made."""
    import os
    import sys

    from scripts.rehearsal.netns import Fabric, unavailable_reason

    if (reason := unavailable_reason()) is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    fabric = Fabric(f"t{os.getpid() % 10000}", subnet=250, nodes=nodes).open()
    made = list(fabric.created)
    try:
        assert len(made) == nodes + (nodes > 2)
        listen = ("import socket, sys; s = socket.socket(); "
                  "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 5555)); "
                  "s.listen(); print('ready', flush=True); c, _ = s.accept(); c.sendall(b'ok')")
        ask = ("import socket, sys; c = socket.create_connection((sys.argv[1], 5555), timeout=5); "
               "print(c.recv(2).decode())")
        for server, client in [(fabric.head, w) for w in fabric.hosts[1:]] + \
                              [(w, fabric.head) for w in fabric.hosts[1:]]:
            srv = subprocess.Popen(server.wrap([sys.executable, "-c", listen, server.ip]),
                                   stdout=subprocess.PIPE, text=True)
            assert srv.stdout.readline().strip() == "ready"
            r = subprocess.run(client.wrap([sys.executable, "-c", ask, server.ip]),
                               capture_output=True, text=True, timeout=20)
            srv.wait(10)
            assert r.stdout.strip() == "ok", (server.ip, client.ip, r.stderr)
        last = fabric.hosts[-1]
        mtu = subprocess.run(last.wrap(["cat", f"/sys/class/net/{last.ifname}/mtu"]),
                             capture_output=True, text=True).stdout.strip()
        assert mtu == "9000"
    finally:
        fabric.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in made)
