"""scripts/preflight.sh against fake hosts: sysfs GID tables, /proc ports, fake nvidia-smi/docker/ping.

The GID resolver is what the container runs at every start (docker/entrypoint.sh calls
`preflight.sh resolve-gid`), so its cases are the RoCE situations users of the public
recipes hit: several GIDs per port, IPv4 vs IPv6, RoCE v1 vs v2, a port that is down, an
index that moved after a reboot, and the GB10 port "twins".
"""

from __future__ import annotations

import subprocess

import pytest

from scripts.node.content_hash import content_hash
from tests.support.spark_host import (
    PREFLIGHT,
    V1,
    V2,
    FakeHost,
    global_v6_gid,
    ipv4_gid,
    link_local_gid,
    node_env,
    selftest_record,
    spark_pair_port,
    standard_gids,
    write_env,
)

pytestmark = pytest.mark.timeout(60)

HEAD_IP, WORKER_IP = "192.168.100.10", "192.168.100.11"
MODEL = "deepseek-ai/DeepSeek-V4-Flash-DSpark"  # recipe/profiles/spark-2x.yaml
IMAGE_ID = "sha256:0123456789abcdef0123456789"
GOOD_IMAGE = f"{IMAGE_ID}|0.32.0|5df63a720|0.1.0|{content_hash()}"


@pytest.fixture
def host(tmp_path):
    return FakeHost(tmp_path)


def resolve(host: FakeHost, hca="=rocep1s0f0", ifname="enp1s0f0np0", ip=HEAD_IP, gid="auto"):
    env = host.env(NCCL_IB_HCA=hca, NCCL_SOCKET_IFNAME=ifname, NCCL_IB_GID_INDEX=gid)
    if ip is not None:
        env["VLLM_HOST_IP"] = ip
    r = subprocess.run([str(PREFLIGHT), "resolve-gid"], env=env, capture_output=True, text=True)
    return r.returncode, r.stdout.strip(), r.stderr


def run_preflight(host: FakeHost, env_values: dict, *args: str, **fake: str):
    env_file = write_env(host.root / "node.env", env_values)
    if "SELFTEST_DIR" not in fake:  # a passing self-test of GOOD_IMAGE on the fake GB10
        fake["SELFTEST_DIR"] = str(selftest_record(host.root / "selftest", IMAGE_ID))
    r = subprocess.run([str(PREFLIGHT), "--env-file", str(env_file), *args],
                       env=host.env(**fake), capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def lines(out: str, verdict: str, check: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith(verdict) and ln.split()[1] == check]


# ---------------------------------------------------------------------------------------
# GID resolution
# ---------------------------------------------------------------------------------------
def test_one_interface_resolves_the_roce_v2_ipv4_entry(host):
    spark_pair_port(host, HEAD_IP)
    assert resolve(host) == (0, "3", "")


def test_multiple_ipv4_gids_pick_the_one_of_vllm_host_ip(host):
    nd = "enp1s0f0np0"
    host.add_port("rocep1s0f0", nd, "0000:01:00.0", standard_gids(HEAD_IP, nd) + [
        (4, ipv4_gid("10.9.0.5"), V1, nd),
        (5, ipv4_gid("10.9.0.5"), V2, nd),
    ])
    assert resolve(host, ip=HEAD_IP)[:2] == (0, "3")
    assert resolve(host, ip="10.9.0.5")[:2] == (0, "5")
    assert resolve(host, ip=None)[:2] == (0, "3")  # no preference: the lowest valid index


def test_ipv6_only_port_is_refused_with_a_fix(host):
    nd = "enp1s0f0np0"
    host.add_port("rocep1s0f0", nd, "0000:01:00.0", [
        (0, link_local_gid(), V1, nd), (1, link_local_gid(), V2, nd),
        (2, global_v6_gid(), V1, nd), (3, global_v6_gid(), V2, nd),
    ])
    rc, out, err = resolve(host, ip=None)
    assert rc == 1 and out == ""
    assert "no RoCE v2 GID with an IPv4 address" in err
    assert "RoCE v2 IPv6: 2" in err  # link-local + global
    assert "static IPv4 address" in err and "netplan" in err


def test_roce_v1_ipv4_alone_is_not_enough(host):
    nd = "enp1s0f0np0"
    host.add_port("rocep1s0f0", nd, "0000:01:00.0", [
        (0, link_local_gid(), V1, nd), (1, ipv4_gid(HEAD_IP), V1, nd),
    ])
    rc, _, err = resolve(host, ip=None)
    assert rc == 1
    assert "no RoCE v2 GID with an IPv4 address (RoCE v1: 2" in err


def test_port_down_is_refused(host):
    nd = "enp1s0f0np0"
    host.add_port("rocep1s0f0", nd, "0000:01:00.0", standard_gids(HEAD_IP, nd),
                  state="1: DOWN", phys_state="3: Disabled")
    rc, _, err = resolve(host)
    assert rc == 1
    assert "rocep1s0f0 port 1 (enp1s0f0np0) is not up (state '1: DOWN', phys_state '3: Disabled')" in err
    assert "QSFP cable" in err


def test_drifted_pinned_index_is_refused_and_auto_follows_it(host):
    # After a reboot the IPv6 entries came up first: the RoCE v2 IPv4 GID is now index 5.
    nd = "enp1s0f0np0"
    host.add_port("rocep1s0f0", nd, "0000:01:00.0", [
        (0, link_local_gid(), V1, nd), (1, link_local_gid(), V2, nd),
        (2, global_v6_gid(), V1, nd), (3, global_v6_gid(), V2, nd),
        (4, ipv4_gid(HEAD_IP), V1, nd), (5, ipv4_gid(HEAD_IP), V2, nd),
    ])
    rc, out, err = resolve(host, gid="3")
    assert rc == 1 and out == ""
    assert "NCCL_IB_GID_INDEX=3 is not a RoCE v2 IPv4 GID on every HCA any more" in err
    assert "set NCCL_IB_GID_INDEX=auto" in err and "today it is 5" in err
    assert resolve(host, gid="auto")[:2] == (0, "5")
    assert resolve(host, gid="5")[:2] == (0, "5")  # a pin that is still right passes


def test_dual_port_twins_share_the_index(host):
    spark_pair_port(host, HEAD_IP, twin_ip="192.168.101.10")
    assert resolve(host, hca="=rocep1s0f0,roceP2p1s0f0")[:2] == (0, "3")


def test_twins_without_a_common_index_are_refused(host):
    host.add_port("rocep1s0f0", "enp1s0f0np0", "0000:01:00.0",
                  standard_gids(HEAD_IP, "enp1s0f0np0"))
    twin = "enP2p1s0f0np0"
    host.add_port("roceP2p1s0f0", twin, "0002:01:00.0", [
        (0, link_local_gid(2), V1, twin), (1, link_local_gid(2), V2, twin),
        (2, global_v6_gid(2), V1, twin), (3, global_v6_gid(2), V2, twin),
        (4, ipv4_gid("192.168.101.10"), V1, twin), (5, ipv4_gid("192.168.101.10"), V2, twin),
    ])
    rc, _, err = resolve(host, hca="=rocep1s0f0,roceP2p1s0f0")
    assert rc == 1
    assert "no GID index is a RoCE v2 IPv4 entry on every HCA" in err
    assert "rocep1s0f0:1 -> 3; roceP2p1s0f0:1 -> 5" in err


def test_twins_use_the_index_they_have_in_common(host):
    nd, twin = "enp1s0f0np0", "enP2p1s0f0np0"
    host.add_port("rocep1s0f0", nd, "0000:01:00.0", standard_gids(HEAD_IP, nd) + [
        (5, ipv4_gid("10.9.0.5"), V2, nd)])
    host.add_port("roceP2p1s0f0", twin, "0002:01:00.0", [
        (0, link_local_gid(2), V1, twin), (5, ipv4_gid("192.168.101.10"), V2, twin)])
    assert resolve(host, hca="=rocep1s0f0,roceP2p1s0f0", ip=None)[:2] == (0, "5")


def test_gids_of_other_interfaces_on_the_port_do_not_count(host):
    # A VLAN/macvlan on top of the port gets its own GID entries with its own ndev.
    nd = "enp1s0f0np0"
    host.add_port("rocep1s0f0", nd, "0000:01:00.0", [
        (0, link_local_gid(), V1, nd), (1, link_local_gid(), V2, nd),
        (2, ipv4_gid("10.50.0.1"), V1, "enp1s0f0np0.50"), (3, ipv4_gid("10.50.0.1"), V2, "enp1s0f0np0.50"),
        (4, ipv4_gid(HEAD_IP), V1, nd), (5, ipv4_gid(HEAD_IP), V2, nd),
    ])
    assert resolve(host)[:2] == (0, "5")


def test_hca_selector_grammar(host):
    spark_pair_port(host, HEAD_IP, twin_ip="192.168.101.10")
    assert resolve(host, hca="rocep1")[:2] == (0, "3")          # prefix match, like NCCL
    assert resolve(host, hca="^roceP2")[:2] == (0, "3")         # exclusion
    assert resolve(host, hca="=rocep1s0f0:1")[:2] == (0, "3")   # explicit port
    rc, _, err = resolve(host, hca="=mlx5_0")
    assert rc == 1
    assert "NCCL_IB_HCA names 'mlx5_0' but there is no such RDMA device (present: roceP2p1s0f0 rocep1s0f0)" in err
    rc, _, err = resolve(host, hca="=rocep1s0f0:2")
    assert rc == 1 and "rocep1s0f0 port 2, which does not exist" in err


def test_vllm_host_ip_must_be_on_the_interface(host):
    spark_pair_port(host, HEAD_IP)
    rc, _, err = resolve(host, ip="192.168.100.99")
    assert rc == 1
    assert "VLLM_HOST_IP=192.168.100.99 is not an address of enp1s0f0np0" in err


def test_no_rdma_devices(host):
    rc, _, err = resolve(host)
    assert rc == 1 and "no RDMA devices under" in err


def test_nccl_mode_leaves_the_choice_to_nccl(host):
    assert resolve(host, gid="nccl") == (0, "", "")


# ---------------------------------------------------------------------------------------
# Whole preflight, per node role
# ---------------------------------------------------------------------------------------
@pytest.fixture
def pair(host):
    """A healthy node: twins up with MTU 9000, complete model cache, image built."""
    spark_pair_port(host, HEAD_IP, twin_ip="192.168.101.10")
    cache = host.model_cache(MODEL)
    return host, cache


def test_head_passes_everything(pair):
    host, cache = pair
    rc, out = run_preflight(host, node_env(0, cache), FAKE_IMAGE=GOOD_IMAGE)
    assert rc == 0, out
    assert "FAIL" not in out
    for check in ("env", "compose", "gpu", "image", "overlay", "selftest", "cache", "rdma",
                  "gid", "mtu", "head", "ports", "stale"):
        assert lines(out, "PASS", check), f"no PASS for {check}:\n{out}"
    assert "NCCL_IB_GID_INDEX=auto resolves to 3" in out
    assert "dspark-vllm:local sha256:0123456789a" in out
    assert out.rstrip().endswith("preflight: OK (1 warning(s))")  # revision 'main' is unpinned


def test_worker_passes_and_checks_the_head_with_jumbo_frames(host):
    spark_pair_port(host, WORKER_IP, twin_ip="192.168.101.11")
    cache = host.model_cache(MODEL)
    rc, out = run_preflight(host, node_env(1, cache), FAKE_IMAGE=GOOD_IMAGE)
    assert rc == 0, out
    assert "PASS  head     head 192.168.100.10 reachable with 9000-byte frames" in out
    assert "PASS  ports    worker: it listens on no fixed port" in out

    for ping, messages in (
        ("nojumbo", ["a 9000-byte unfragmented packet does not get through",
                     "MTU 9000 on the fabric interfaces of this node and the head"]),
        ("down", ["the head at MASTER_ADDR=192.168.100.10 does not answer ping from this worker"]),
    ):
        rc, out = run_preflight(host, node_env(1, cache), "--only", "head", FAKE_PING=ping)
        assert rc == 1 and all(m in out for m in messages), out


def test_mtu_1500(pair):
    host, cache = pair
    host.set_mtu("enP2p1s0f0np0", 1500)
    rc, out = run_preflight(host, node_env(0, cache), "--only", "mtu")
    assert rc == 1
    assert "PASS  mtu      enp1s0f0np0 MTU 9000" in out
    assert "FAIL  mtu      enP2p1s0f0np0 has MTU 1500; the Spark-to-Spark RoCE link needs 9000" in out
    assert "'mtu: 9000' for enP2p1s0f0np0 in /etc/netplan/*.yaml" in out


def run_only(pair, check: str, **env: str) -> tuple[int, str]:
    """One preflight check on the head of a healthy pair, with ``env`` over its .env."""
    host, cache = pair
    return run_preflight(host, node_env(0, cache, **env), "--only", check)


def test_missing_interface(pair):
    rc, out = run_only(pair, "mtu", NCCL_SOCKET_IFNAME="enp9s0")
    assert rc == 1
    assert "interface enp9s0 does not exist (present: " in out


def test_hca_down_fails_the_rdma_check(host):
    host.add_port("rocep1s0f0", "enp1s0f0np0", "0000:01:00.0",
                  standard_gids(HEAD_IP, "enp1s0f0np0"), state="1: DOWN", phys_state="3: Disabled")
    host.add_port("roceP2p1s0f0", "enP2p1s0f0np0", "0002:01:00.0",
                  standard_gids("192.168.101.10", "enP2p1s0f0np0"))
    rc, out = run_preflight(host, node_env(0, host.root), "--only", "rdma")
    assert rc == 1
    assert "FAIL  rdma     HCA rocep1s0f0 port 1 (enp1s0f0np0) is not up" in out
    assert "or drop rocep1s0f0 from NCCL_IB_HCA" in out


def test_pinned_gid_index_that_moved(pair):
    rc, out = run_only(pair, "rdma", NCCL_IB_GID_INDEX="1")
    assert rc == 1
    assert "NCCL_IB_GID_INDEX=1 is not a RoCE v2 IPv4 GID on every HCA any more" in out
    rc, out = run_only(pair, "rdma", NCCL_IB_GID_INDEX="3")
    assert rc == 0
    assert "WARN  gid      NCCL_IB_GID_INDEX=3 is valid today" in out


@pytest.mark.parametrize("case", ["no-model", "missing-shard", "partial-download", "no-revision"])
def test_incomplete_model_cache(host, case):
    if case == "no-model":
        cache = host.root / "empty-hf"
        (cache / "hub").mkdir(parents=True)
        expect = f"{MODEL} is not in the model cache"
    elif case == "missing-shard":
        cache = host.model_cache(MODEL, shards=3, missing=1)
        expect = "1 of 3 weight shards missing or dangling (first: model-00003-of-00003.safetensors)"
    elif case == "partial-download":
        cache = host.model_cache(MODEL, incomplete=True)
        expect = "1 unfinished downloads (*.incomplete)"
    else:
        cache = host.model_cache(MODEL, revision="v2-branch")
        expect = f"{MODEL} has no revision 'main' in the cache"
    rc, out = run_preflight(host, node_env(0, cache), "--only", "cache")
    assert rc == 1, out
    assert expect in out, out
    assert "--entrypoint hf dspark-vllm:local download deepseek-ai/DeepSeek-V4-Flash-DSpark --revision main" in out


def test_head_ports_in_use(pair):
    host, cache = pair
    host.listen(8000)
    rc, out = run_preflight(host, node_env(0, cache), "--only", "ports")
    assert rc == 1
    assert "FAIL  ports    API port 8000 is already in use on this node" in out
    assert "PASS  ports    torch.distributed master port 29501 is free" in out


@pytest.mark.parametrize("image, expect", [
    ("", "image dspark-vllm:local is not on this node"),
    ("sha256:0123|0.32.0|deadbeef1|0.1.0", "vLLM commit deadbeef1, recipe/pins.yaml pins 5df63a720"),
    ("sha256:0123|0.32.0|5df63a720|0.0.9", "overlay 0.0.9, this checkout is overlay 0.1.0"),
    ("sha256:0123|||", "no dspark.vllm.commit / dspark.overlay.version labels"),
    ("sha256:0123|0.32.0|5df63a720|0.1.0|", "no dspark.content.sha256 label"),
    (f"sha256:0123|0.32.0|5df63a720|0.1.0|{'0' * 64}",
     "built from other overlay/, recipe/ or docker/ files"),
])
def test_image_must_match_the_checkout(pair, image, expect):
    host, cache = pair
    rc, out = run_preflight(host, node_env(0, cache), "--only", "image", FAKE_IMAGE=image)
    assert rc == 1
    assert expect in out
    assert "make image" in out


def test_image_without_overlay_marker(pair):
    host, cache = pair
    rc, out = run_preflight(host, node_env(0, cache), "--only", "image,overlay",
                            FAKE_IMAGE=GOOD_IMAGE, FAKE_RUN_FAIL="no marker at /x/vllm/.dspark_overlay.json")
    assert rc == 1
    assert "FAIL  overlay  the overlay marker is missing in dspark-vllm:local" in out


def test_no_gpu(pair):
    host, cache = pair
    for gpu, code, message in (
        ("", 1, "nvidia-smi sees no GPU"),
        ("NVIDIA H100, 9.0", 0, "WARN  gpu      GPU 'NVIDIA H100' has compute capability 9.0"),
    ):
        rc, out = run_preflight(host, node_env(0, cache), "--only", "gpu", FAKE_GPU=gpu)
        assert rc == code and message in out, out


def test_already_running(pair):
    host, cache = pair
    rc, out = run_preflight(host, node_env(0, cache), "--only", "stale",
                            FAKE_DOCKER_PS="dspark-vllm-1 (Up 2 hours (healthy))\n")
    assert rc == 1
    assert "this node already runs the recipe: dspark-vllm-1 (Up 2 hours (healthy))" in out
    assert "make down first" in out


def test_missing_env_file_and_crlf(host):
    r = subprocess.run([str(PREFLIGHT), "--env-file", str(host.root / "nope.env")],
                       env=host.env(), capture_output=True, text=True)
    assert r.returncode == 1
    assert "cp docker/.env.example docker/.env" in r.stdout
    crlf = host.root / "crlf.env"
    crlf.write_bytes(b"NODE_RANK=0\r\nMASTER_ADDR=192.168.100.10\r\n")
    r = subprocess.run([str(PREFLIGHT), "--env-file", str(crlf)], env=host.env(),
                       capture_output=True, text=True)
    assert r.returncode == 1
    assert "Windows (CRLF) line endings" in r.stdout


def test_unknown_check_is_a_usage_error(host):
    r = subprocess.run([str(PREFLIGHT), "--only", "gpus"], env=host.env(),
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "unknown check 'gpus'" in r.stderr
