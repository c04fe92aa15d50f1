"""scripts/recipe.py boundaries and device-specific flags, found by mutation testing.

The ranges below are the contract written out (DESIGN section 6 caps a packed chunk at 8192
tokens; ports are TCP ports, the rendezvous port unprivileged; a DSpark block is at most 16),
not read from the schema: each bound is accepted exactly at its edge and refused one step past.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import yaml
from conftest import REPO

import recipe

BOUNDS = [  # (key, lowest allowed, below it, highest allowed, above it)
    ("parallel.nnodes", 1, 0, 8, 9),
    ("parallel.master_port", 1024, 1023, 65535, 65536),
    ("serving.port", 1, 0, 65535, 65536),
    ("serving.max_model_len", 16, 15, 1048576, 1048577),
    ("serving.max_num_seqs", 1, 0, 1024, 1025),
    ("serving.max_num_batched_tokens", 1, 0, 8192, 8193),
    ("serving.gpu_memory_utilization", 0.05, 0.04, 1.0, 1.01),
    ("speculative.num_speculative_tokens", 1, 0, 16, 17),
    ("speculative.checkpoint_block_size", 1, 0, 16, 17),
]


def profile(name: str) -> dict:
    return yaml.safe_load((REPO / "recipe/profiles" / f"{name}.yaml").read_text())


def problems_with(key: str, value) -> str:
    """Every problem validate() reports for spark-2x with ``key`` set to ``value``."""
    p = profile("spark-2x")
    section, leaf = key.split(".")
    p[section][leaf] = value
    try:
        recipe.validate(p)
    except recipe.RecipeError as err:
        return str(err)
    return ""


@pytest.mark.parametrize("key, lo, below, hi, above", BOUNDS, ids=[b[0] for b in BOUNDS])
def test_each_numeric_bound_is_inclusive_and_exact(key, lo, below, hi, above):
    for value in (lo, hi):  # other checks (k == block, decode rows) may still complain
        assert f"{key}: {value!r} is out of range" not in problems_with(key, value)
    for value in (below, above):
        assert f"{key}: {value!r} is out of range" in problems_with(key, value)


def argv_pairs(p: dict) -> tuple[list[str], dict[str, str]]:
    argv = recipe.serve_argv(p)
    return argv, dict(zip(argv, argv[1:], strict=False))


def test_cuda_flags_follow_the_profile_and_stay_off_cpu():
    """GPU memory share and CUDA-graph capture size are CUDA flags; the capture size covers
    max_num_seqs verify rows of k + 1 tokens, and enforce_eager turns it off."""
    spark = profile("spark-2x")
    argv, pairs = argv_pairs(spark)
    srv, k = spark["serving"], spark["speculative"]["num_speculative_tokens"]
    assert pairs["--gpu-memory-utilization"] == str(srv["gpu_memory_utilization"])
    assert pairs["--max-cudagraph-capture-size"] == str(srv["max_num_seqs"] * (k + 1))
    eager = copy.deepcopy(spark)
    eager["serving"]["enforce_eager"] = True
    argv, _ = argv_pairs(eager)
    assert "--max-cudagraph-capture-size" not in argv and "--enforce-eager" in argv
    argv, _ = argv_pairs(profile("cpu-tiny"))
    assert "--gpu-memory-utilization" not in argv
    assert "--max-cudagraph-capture-size" not in argv
    assert json.loads(dict(zip(argv, argv[1:], strict=False))["--speculative-config"])


def test_check_cache_requires_a_cache_dir():
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts/recipe.py"), "check-cache", "spark-2x"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "the following arguments are required: --cache-dir" in result.stderr


@pytest.mark.parametrize("tp, allowed", [(1, True), (2, True), (4, True), (8, True), (3, False)])
def test_tensor_parallel_sizes_are_powers_of_two_up_to_eight(tp, allowed):
    refused = f"parallel.tensor_parallel_size: {tp!r} is not allowed" in problems_with(
        "parallel.tensor_parallel_size", tp
    )
    assert refused is not allowed


def test_decode_row_error_gives_the_largest_allowed_max_num_seqs():
    """FlashInfer's sparse MLA decodes at most 64 rows; k=5 verifies 6 rows per request."""
    message = problems_with("serving.max_num_seqs", 12)
    assert "serving.max_num_seqs: 12 x (k+1=6) = 72 verify rows" in message
    assert message.endswith("use max_num_seqs <= 10")  # 10 x 6 = 60 <= 64 < 11 x 6


def test_single_node_argv_has_no_multinode_flags_and_ranks_are_checked():
    argv = recipe.serve_argv(profile("cpu-tiny"))
    for flag in ("--nnodes", "--distributed-executor-backend", "--master-port", "--headless"):
        assert flag not in argv
    with pytest.raises(recipe.RecipeError, match=r"--node-rank: 2 not in \[0, 1\]"):
        recipe.serve_argv(profile("spark-2x"), node_rank=2)


def test_missing_top_level_key_is_reported_and_env_section_is_optional():
    p = profile("spark-2x")
    del p["device"]
    p.pop("env", None)
    with pytest.raises(recipe.RecipeError) as err:
        recipe.validate(p)
    assert "device: missing" in str(err.value)
    assert "env" not in str(err.value)


def test_recipe_without_a_subcommand_is_a_usage_error():
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts/recipe.py")], capture_output=True, text=True
    )
    assert result.returncode == 2 and "required: cmd" in result.stderr


def test_wrong_type_for_an_unbounded_field_names_only_the_type():
    p = profile("spark-2x")
    p["model"]["id"] = 5
    with pytest.raises(recipe.RecipeError) as err:
        recipe.validate(p)
    assert "model.id: expected str, got int 5" in str(err.value)


@pytest.mark.parametrize(
    "env, message",
    [
        ({"lower": "x"}, "env.lower: variable names must match"),
        ({"OK_NAME": True}, "env.OK_NAME: expected a string or number, got True"),
        ({"OK_NAME": [1]}, "env.OK_NAME: expected a string or number, got [1]"),
        (["A=1"], "env: expected a mapping of NAME: value"),
    ],
)
def test_env_section_is_checked(env, message):
    p = profile("spark-2x")
    p["env"] = env
    with pytest.raises(recipe.RecipeError) as err:
        recipe.validate(p)
    assert message in str(err.value)
    p["env"] = {"NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": 4, "RATIO": 0.5}
    recipe.validate(p)
