"""spark-4x and cpu-4x: the two-node profiles with only the parallel section changed, and the
launch they render for each of the four node ranks."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from scripts import recipe
from tests.support.paths import REPO
from tests.support.profile_keys import flat_keys, raw_profile

# What four nodes change against two, and nothing else.
FOUR_NODE_KEYS = {"name", "description", "parallel.tensor_parallel_size", "parallel.nnodes"}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scripts.recipe", *args], cwd=REPO,
                          capture_output=True, text=True)


# The CPU twin also serves the tiny checkpoint built with four attention output groups
# (`make model-tp4`), the one the TP=4 end-to-end test runs.
CPU_TP4_MODEL = "./models/tiny-dsv4-dspark-tp4"


@pytest.mark.parametrize(("two", "four"), [("spark-2x", "spark-4x"), ("cpu-2x", "cpu-4x")])
def test_four_node_profile_is_the_two_node_one_with_tp4(two, four):
    a, b = flat_keys(raw_profile(two)), flat_keys(raw_profile(four))
    assert a.keys() == b.keys()
    model = {"model.id"} if four == "cpu-4x" else set()
    assert {k for k in a if a[k] != b[k]} == FOUR_NODE_KEYS | model
    if model:
        assert b["model.id"] == CPU_TP4_MODEL


def test_validate_takes_several_profiles():
    r = cli("validate", "spark-4x", "cpu-4x")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["ok: spark-4x", "ok: cpu-4x"]


def test_validate_of_several_stops_with_status_2_on_a_bad_one(tmp_path):
    bad = raw_profile("cpu-4x")
    bad["parallel"]["nnodes"] = 3  # TP=4 does not split over 3 nodes
    path = tmp_path / "cpu-3.yaml"
    path.write_text(yaml.safe_dump(bad))
    r = cli("validate", "spark-4x", str(path))
    assert r.returncode == 2
    assert r.stdout.splitlines() == ["ok: spark-4x"]
    assert "parallel.tensor_parallel_size: 4 is not a multiple of parallel.nnodes=3" in r.stderr


def _argv(rank: int) -> list[str]:
    r = cli("render", "spark-4x", "--as", "argv", "--node-rank", str(rank),
            "--master-addr", "10.0.0.1")
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_render_each_of_four_ranks(rank):
    argv = _argv(rank)
    pairs = dict(zip(argv, argv[1:], strict=False))
    assert pairs["--tensor-parallel-size"] == "4" and pairs["--nnodes"] == "4"
    assert pairs["--node-rank"] == str(rank) and pairs["--master-addr"] == "10.0.0.1"
    assert pairs["--distributed-executor-backend"] == "mp" and pairs["--master-port"] == "29501"
    assert ("--headless" in argv) == (rank > 0)
    # the head's argv and a worker's differ only in the rank and the headless flag
    head = _argv(0)
    rest = [a for a in argv if a not in ("--headless", str(rank))]
    assert rest == [a for a in head if a != "0"]


def test_render_refuses_rank_four():
    r = cli("render", "spark-4x", "--as", "argv", "--node-rank", "4", "--master-addr", "10.0.0.1")
    assert r.returncode == 2 and r.stdout == ""
    assert "recipe error: --node-rank: 4 not in [0, 3]" in r.stderr


def test_env_rendering_carries_four_nodes():
    env = recipe.profile_env(recipe.load_profile("cpu-4x"))
    assert (env["TP_SIZE"], env["NNODES"], env["RECIPE_PROFILE"]) == ("4", "4", "cpu-4x")
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
