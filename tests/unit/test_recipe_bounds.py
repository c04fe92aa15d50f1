"""scripts/recipe.py boundaries and device-specific flags, found by mutation testing.

The ranges below are the contract written out (packed prefill caps a chunk at 8192
tokens; ports are TCP ports, the rendezvous port unprivileged; a DSpark block is at most 16),
not read from the schema: each bound is accepted exactly at its edge and refused one step past.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from scripts import recipe
from tests.support.paths import REPO

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
    ("demo.max_num_batched_tokens", 1, 0, 8192, 8193),
]


def profile(name: str) -> dict:
    return yaml.safe_load((REPO / "recipe/profiles" / f"{name}.yaml").read_text())


def problems_with(key: str, value, adaptive="auto") -> str:
    """Every problem validate() reports for spark-2x with ``key`` set to ``value``."""
    p = profile("spark-2x")
    p["speculative"]["adaptive"] = adaptive
    section, leaf = key.split(".")
    p.setdefault(section, {})[leaf] = value  # spark-2x has no demo section
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
    max_num_seqs verify rows of k + 1 tokens up to the row budget, and enforce_eager turns it
    off."""
    spark = profile("spark-2x")
    argv, pairs = argv_pairs(spark)
    srv, k = spark["serving"], spark["speculative"]["num_speculative_tokens"]
    assert pairs["--gpu-memory-utilization"] == str(srv["gpu_memory_utilization"])
    assert pairs["--max-cudagraph-capture-size"] == str(min(srv["max_num_seqs"] * (k + 1), 64))
    fixed = copy.deepcopy(spark)
    fixed["serving"]["max_num_seqs"], fixed["speculative"]["adaptive"] = 10, False
    assert argv_pairs(fixed)[1]["--max-cudagraph-capture-size"] == str(10 * (k + 1))
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
        [sys.executable, "-m", "scripts.recipe", "check-cache", "spark-2x"],
        cwd=REPO,
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
    message = problems_with("serving.max_num_seqs", 12, adaptive=False)
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
        [sys.executable, "-m", "scripts.recipe"], cwd=REPO, capture_output=True, text=True
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


def test_engine_args_pass_a_hub_revision_and_no_revision_for_a_local_checkpoint():
    assert recipe.engine_args(profile("spark-2x"))["revision"] == "main"
    assert "revision" not in recipe.engine_args(profile("cpu-tiny"))  # revision: local


def test_missing_section_and_missing_leaf_say_what_was_expected():
    p = profile("spark-2x")
    del p["serving"]["port"]
    del p["parallel"]
    with pytest.raises(recipe.RecipeError) as err:
        recipe.validate(p)
    assert "serving.port: missing; expected int in [1, 65535]" in err.value.problems
    assert "parallel: missing; expected a mapping" in err.value.problems


@pytest.mark.parametrize("k, max_num_seqs, allowed", [(3, 16, True), (4, 13, False), (2, 21, True)])
def test_flashinfer_decode_row_limit_is_exactly_64(k, max_num_seqs, allowed):
    """FlashInfer's sparse-MLA decode takes at most 64 rows per call: 16 x 4 = 64 and
    21 x 3 = 63 pass, 13 x 5 = 65 does not."""
    p = profile("spark-2x")
    p["speculative"]["num_speculative_tokens"] = k
    p["serving"]["max_num_seqs"] = max_num_seqs
    p["speculative"]["adaptive"] = False  # fixed k: every request verifies k drafts
    problems = []
    try:
        recipe.validate(p)
    except recipe.RecipeError as err:
        problems = err.problems
    refused = any("decode-row limit of 64" in line for line in problems)
    assert refused is not allowed, problems


def pins() -> dict:
    return yaml.safe_load((REPO / "recipe/pins.yaml").read_text())


@pytest.mark.parametrize(
    "lo, hi, allowed",
    [("3.11", "3.14", True), ("3.12", "3.12", True), ("3.12", "3.11", False), ("3.14", "3.9", False)],
)
def test_python_range_min_above_max_is_refused(lo, hi, allowed):
    bad = pins()
    bad["python"].update(min=lo, max=hi)
    if allowed:
        assert recipe.validate_pins(bad) is bad
        return
    with pytest.raises(recipe.RecipeError) as err:
        recipe.validate_pins(bad)
    assert err.value.problems == ["python.min: must not be above python.max"]


@pytest.mark.parametrize("key", ["min", "max"])
def test_python_versions_must_be_3_dot_minor(key):
    bad = pins()
    bad["python"][key] = "3"
    with pytest.raises(recipe.RecipeError) as err:
        recipe.validate_pins(bad)
    assert err.value.problems == [f"python.{key}: expected a '3.N' version, got '3'"]


def test_setup_pins_are_checked_section_by_section():
    bad = pins()
    del bad["cpu"]["torch"]
    bad["python"]["tested"] = "3.11"
    with pytest.raises(recipe.RecipeError) as err:
        recipe.validate_pins(bad)
    assert err.value.problems == [
        "cpu.torch: missing; expected str",
        "python.tested: expected list, got str '3.11'",
    ]
    del bad["python"]
    with pytest.raises(recipe.RecipeError) as err:
        recipe.validate_pins(bad)
    assert "python: missing; expected a mapping" in err.value.problems


def test_help_starts_with_what_the_tool_does(capsys):
    with pytest.raises(SystemExit) as done:
        recipe.main(["--help"])
    assert done.value.code == 0
    assert "The recipe tool: validate a serving profile and render it" in capsys.readouterr().out


# The node subcommands (scripts/node/) as the recipe CLI dispatches them.


@pytest.fixture
def report_to_stdout(monkeypatch):
    """Report's default stream is the sys.stdout of its import; print to the captured one."""
    from scripts.node import report

    real = report.Report
    monkeypatch.setattr(report, "Report", lambda: real(sys.stdout))


@pytest.mark.parametrize(
    "flags, node_rank, mode, shown",
    [
        (["--nnodes", "3"], "0", "host", "head"),
        (["--nnodes", "3"], "1", "host", "worker"),
        (["--nnodes", "3", "--container"], "1", "container", "container"),
    ],
)
def test_check_env_checks_the_mode_asked_for_and_names_the_role(
    monkeypatch, capsys, report_to_stdout, flags, node_rank, mode, shown
):
    from scripts.node import env as node_env

    seen = []
    monkeypatch.setattr(node_env, "check", lambda env, m, n, report: seen.append((m, n)) or True)
    monkeypatch.setenv("NODE_RANK", node_rank)
    assert recipe.main(["check-env", *flags]) == 0
    assert seen == [(mode, 3)]
    assert f"variables are well-formed ({shown})" in capsys.readouterr().out


def test_check_env_defaults_to_the_two_spark_profile(monkeypatch, report_to_stdout):
    from scripts.node import env as node_env

    seen = []
    monkeypatch.setattr(node_env, "check", lambda env, m, n, report: seen.append(n) or True)
    assert recipe.main(["check-env"]) == 0
    assert seen == [profile("spark-2x")["parallel"]["nnodes"]]


def test_env_file_prints_exports_for_unset_keys_and_nothing_for_a_missing_file(
    monkeypatch, capsys, report_to_stdout, tmp_path
):
    env_file = tmp_path / "node.env"
    env_file.write_text("NODE_RANK=1\nMASTER_ADDR='10.0.0.1'\n")
    monkeypatch.delenv("NODE_RANK", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "10.9.9.9")  # set here: the file does not override it
    assert recipe.main(["env-file", str(env_file)]) == 0
    assert capsys.readouterr().out == "export NODE_RANK=1\n"
    assert recipe.main(["env-file", str(tmp_path / "nope.env")]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL") and "nope.env not found" in out
    assert not any(line.startswith("export ") for line in out.splitlines())


def test_check_cache_defaults_to_the_image_user(monkeypatch, tmp_path):
    """The default container uid is the one the Spark image runs as (docker/Dockerfile)."""
    from scripts.node import cache as node_cache

    user = next(line for line in (REPO / "docker/Dockerfile").read_text().splitlines()
                if line.startswith("USER "))
    seen = []
    monkeypatch.setattr(node_cache, "check", lambda *a: seen.append(a))
    assert recipe.main(["check-cache", "cpu-tiny", "--cache-dir", str(tmp_path)]) == 0
    assert seen[0][4] == int(user.split()[1].split(":")[0])


def test_audit_requires_the_saved_socket_list(capsys):
    with pytest.raises(SystemExit) as done:
        recipe.main(["audit", "spark-2x"])
    assert done.value.code == 2 and "required: --ss" in capsys.readouterr().err


@pytest.mark.parametrize("trusted", [True, False])
def test_trust_remote_code_flag_follows_the_profile(trusted):
    p = profile("spark-2x")
    p["model"]["trust_remote_code"] = trusted
    assert ("--trust-remote-code" in recipe.serve_argv(p)) is trusted


def test_a_yaml_name_is_a_path_even_before_it_exists(tmp_path):
    """`validate elsewhere/x.yaml` must report that file missing, not look for a profile
    named 'elsewhere/x.yaml.yaml'; a file that exists is a path whatever its suffix."""
    assert recipe.profile_path("elsewhere/x.yaml") == Path("elsewhere/x.yaml")
    other = tmp_path / "profile.txt"
    other.write_text("{}")
    assert recipe.profile_path(str(other)) == other
    assert recipe.profile_path("spark-2x") == REPO / "recipe/profiles/spark-2x.yaml"


def test_a_profile_that_is_not_a_mapping_is_named_profile():
    with pytest.raises(recipe.RecipeError) as err:
        recipe.validate(["model", "serving"])
    assert err.value.problems == ["profile: expected a mapping, got list"]


@pytest.mark.parametrize("style, line", [("env", "GREETING='hello world'"), ("compose-env", "GREETING=hello world")])
def test_env_render_quotes_for_shells_and_not_for_compose(tmp_path, capsys, style, line):
    """A shell reads `KEY='a b'` as one word; compose's .env takes the rest of the line as is."""
    p = profile("cpu-tiny")
    p["env"] = {"GREETING": "hello world"}
    path = tmp_path / "greeting.yaml"
    path.write_text(yaml.safe_dump(p))
    assert recipe.main(["render", str(path), "--as", style]) == 0
    assert line in capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("cached", [True, False])
def test_prefix_caching_flag_follows_the_profile(cached):
    p = profile("spark-2x")
    p["serving"]["enable_prefix_caching"] = cached
    argv = recipe.serve_argv(p)
    assert ("--enable-prefix-caching" in argv, "--no-enable-prefix-caching" in argv) == (cached, not cached)


@pytest.mark.parametrize("rank, allowed", [(-1, False), (0, True), (1, True), (2, False)])
def test_node_rank_must_be_a_node_of_the_profile(rank, allowed):
    p = profile("spark-2x")  # nnodes: 2
    if allowed:
        argv = recipe.serve_argv(p, node_rank=rank)
        assert argv[argv.index("--node-rank") + 1] == str(rank)
        assert ("--headless" in argv) is (rank > 0)  # only the head serves the API
        return
    with pytest.raises(recipe.RecipeError, match=rf"--node-rank: {rank} not in \[0, 1\]"):
        recipe.serve_argv(p, node_rank=rank)


def test_render_requires_a_launcher_style(capsys):
    with pytest.raises(SystemExit) as done:
        recipe.main(["render", "spark-2x"])
    assert done.value.code == 2 and "required: --as" in capsys.readouterr().err


@pytest.mark.parametrize("runner,adaptive,max_num_seqs,allowed", [
    ("overlay", "auto", 64, True), ("overlay", "auto", 65, False), ("overlay", True, 16, True),
    ("overlay", False, 16, False), ("upstream", "auto", 16, False), ("upstream", "auto", 10, True),
])
def test_row_budget_lets_the_overlay_serve_more_requests(runner, adaptive, max_num_seqs, allowed):
    """With adaptive verification the overlay's cut holds every step (sync and async) to the
    64-row limit, so only the requests must fit; without it, or on V2, max_num_seqs x (k+1)."""
    p = profile("spark-2x")
    p["speculative"]["runner"], p["speculative"]["adaptive"] = runner, adaptive
    p["serving"]["max_num_seqs"] = max_num_seqs
    problems = []
    try:
        recipe.validate(p)
    except recipe.RecipeError as err:
        problems = err.problems
    assert (not any("decode-row limit" in line for line in problems)) is allowed, problems
    if allowed and runner == "overlay":
        assert recipe.vllm_env(p)["DSPARK_VERIFY_ROW_BUDGET"] == "64"


def test_spark_profiles_serve_sixteen_requests():
    for name in ("spark-2x", "spark-4x"):
        p = recipe.validate(profile(name))
        assert p["serving"]["max_num_seqs"] >= 16 and p["serving"]["async_scheduling"] is True
        assert recipe.vllm_env(p)["DSPARK_VERIFY_ROW_BUDGET"] == "64"
