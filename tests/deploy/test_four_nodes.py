"""Four Sparks behind a switch (spark-4x): every worker rank, on fake hosts.

Each node checks its own HCAs, GID and MTU and its link to the head; a worker's route to the
head must leave through the fabric interface (behind a switch a wrong subnet reaches the head
over the LAN, where ping answers and NCCL would bootstrap over the wrong link). The entrypoint
renders a headless command for every rank 1..3 and refuses rank 4.
"""

from __future__ import annotations

import json
import shlex
import subprocess

import pytest

from scripts.node.content_hash import content_hash
from tests.support.paths import REPO
from tests.support.spark_host import (
    ENTRYPOINT,
    PREFLIGHT,
    FakeHost,
    node_env,
    selftest_record,
    spark_pair_port,
    write_env,
)

pytestmark = pytest.mark.timeout(60)

MODEL = "deepseek-ai/DeepSeek-V4-Flash-DSpark"  # recipe/profiles/spark-4x.yaml
GOOD_IMAGE = f"sha256:0123456789abcdef0123456789|0.32.0|5df63a720|0.1.0|{content_hash()}"


def node(tmp_path, rank: int) -> tuple[FakeHost, dict]:
    """Rank `rank` of four: its port carries its own address 192.168.100.(10 + rank)."""
    host = FakeHost(tmp_path / f"node{rank}")
    spark_pair_port(host, f"192.168.100.{10 + rank}", twin_ip=f"192.168.101.{10 + rank}")
    return host, node_env(rank, host.model_cache(MODEL), PROFILE="spark-4x")


def preflight(host: FakeHost, values: dict, *args: str, **fake: str):
    env_file = write_env(host.root / "node.env", values)
    r = subprocess.run([str(PREFLIGHT), "--env-file", str(env_file), *args],
                       env=host.env(**fake), capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_every_rank_of_four_passes_preflight(tmp_path, rank):
    host, values = node(tmp_path, rank)
    log = host.root / "ping.log"
    records = selftest_record(host.root / "selftest", GOOD_IMAGE.split("|")[0])  # a passed one
    rc, out = preflight(host, values, FAKE_IMAGE=GOOD_IMAGE, FAKE_PING_LOG=str(log),
                        SELFTEST_DIR=str(records))
    assert rc == 0, out
    assert "FAIL" not in out
    # the GID of this node's own address (index 3 of standard_gids), on both port twins
    assert "NCCL_IB_GID_INDEX=auto resolves to 3" in out
    if rank == 0:
        assert "PASS  head     this node is the head (NODE_RANK=0)" in out
        assert not log.exists()  # the head pings nobody
        return
    assert ("PASS  head     head 192.168.100.10 reachable with 9000-byte frames over enp1s0f0np0"
            in out)
    pings = log.read_text().splitlines()
    # both probes go out through the fabric interface; the second one is a full unfragmented frame
    assert pings == ["-I enp1s0f0np0 -c 1 -W 2 192.168.100.10",
                     "-I enp1s0f0np0 -M do -s 8972 -c 1 -W 2 192.168.100.10"]


def test_a_worker_routed_to_the_head_over_the_lan_fails_with_a_fix(tmp_path):
    host, values = node(tmp_path, 2)
    log = host.root / "ping.log"
    rc, out = preflight(host, values, "--only", "head", FAKE_ROUTE_DEV="eno1",
                        FAKE_PING_LOG=str(log))
    assert rc == 1, out
    assert ("FAIL  head     the route to the head MASTER_ADDR=192.168.100.10 leaves through eno1, "
            "not the fabric interface NCCL_SOCKET_IFNAME=enp1s0f0np0") in out
    assert "fix: give every node's fabric interface an address in the head's fabric subnet" in out
    assert "fix: MASTER_ADDR must be the head's fabric IP, not its LAN address" in out
    assert not log.exists()  # no ping over the wrong link passes it


@pytest.mark.parametrize(("fake", "message"), [
    ({"FAKE_PING": "down"},
     "FAIL  head     the head at MASTER_ADDR=192.168.100.10 does not answer ping from this worker "
     "over enp1s0f0np0"),
    ({"FAKE_PING": "nojumbo"},
     "FAIL  head     the head answers, but a 9000-byte unfragmented packet does not get through"),
])
def test_rank_three_reports_a_bad_link_to_the_head(tmp_path, fake, message):
    host, values = node(tmp_path, 3)
    rc, out = preflight(host, values, "--only", "head", **fake)
    assert rc == 1 and message in out, out
    assert "fix:" in out.split(message, 1)[1].splitlines()[1]


def test_rank_two_with_its_twin_port_down_fails_rdma(tmp_path):
    host, values = node(tmp_path, 2)
    host.add_port("roceP2p1s0f0", "enP2p1s0f0np0", "0002:01:00.0", [],
                  state="1: DOWN", phys_state="3: Disabled")
    host.set_mtu("enp1s0f0np0", 1500)
    rc, out = preflight(host, values, "--only", "rdma,mtu")
    assert rc == 1
    assert "FAIL  rdma     HCA roceP2p1s0f0 port 1 (enP2p1s0f0np0) is not up" in out
    assert "FAIL  mtu      enp1s0f0np0 has MTU 1500; the Spark-to-Spark RoCE link needs 9000" in out


@pytest.mark.parametrize("how", ["preflight", "check-env"])
def test_node_rank_four_is_refused_by_the_four_node_profile(tmp_path, how):
    host, values = node(tmp_path, 3)
    values["NODE_RANK"] = "4"
    env_file = write_env(host.root / "node.env", values)
    args = ["check-env", "--env-file", str(env_file)] if how == "check-env" else \
        ["--env-file", str(env_file), "--only", "env"]
    r = subprocess.run([str(PREFLIGHT), *args], env=host.env(), capture_output=True, text=True)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "FAIL  env      NODE_RANK='4' is not a node rank of this 4-node profile" in out
    assert "fix: set NODE_RANK=0 on the head and NODE_RANK=1..3 on the workers" in out


def test_check_env_takes_rank_three_of_four(tmp_path):
    """Without the profile's node count check-env would bound NODE_RANK by two nodes."""
    host, values = node(tmp_path, 3)
    env_file = write_env(host.root / "node.env", values)
    r = subprocess.run([str(PREFLIGHT), "check-env", "--env-file", str(env_file)],
                       env=host.env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS  env      variables are well-formed (worker)" in r.stdout


def entrypoint_command(tmp_path, rank: int) -> subprocess.CompletedProcess:
    """docker/entrypoint.sh print-command on rank `rank` of spark-4x (a marked fake vllm)."""
    host, values = node(tmp_path, rank)
    site = tmp_path / "site" / "vllm"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    (site / ".dspark_overlay.json").write_text(json.dumps(
        {"overlay_version": "0.1.0", "vllm_version": "0.32.0", "mode": "copy", "files": []}))
    env = host.env(PYTHONPATH=str(site.parent), DSPARK_HOME=str(REPO), **{
        k: v for k, v in values.items() if k not in ("MODEL_CACHE_DIR", "DSPARK_IMAGE")})
    return subprocess.run([str(ENTRYPOINT), "print-command"], env=env, capture_output=True,
                          text=True, timeout=40)


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_entrypoint_renders_a_headless_command_for_every_worker_rank(tmp_path, rank):
    r = entrypoint_command(tmp_path, rank)
    assert r.returncode == 0, r.stdout + r.stderr
    argv = shlex.split(r.stdout.splitlines()[-1])
    pairs = dict(zip(argv, argv[1:], strict=False))
    assert argv[:2] == ["vllm", "serve"] and "--headless" in argv
    assert (pairs["--node-rank"], pairs["--nnodes"], pairs["--tensor-parallel-size"]) == \
        (str(rank), "4", "4")
    assert pairs["--master-addr"] == "192.168.100.10"
    assert f"worker (node rank {rank} of 4, headless)" in r.stdout
    assert "NCCL_IB_GID_INDEX=3" in r.stdout


def test_entrypoint_head_of_four_serves_the_api(tmp_path):
    r = entrypoint_command(tmp_path, 0)
    assert r.returncode == 0, r.stdout + r.stderr
    argv = shlex.split(r.stdout.splitlines()[-1])
    assert "--headless" not in argv and argv[argv.index("--node-rank") + 1] == "0"
    assert "head (node rank 0 of 4)" in r.stdout
