"""scripts/recipe.py against vLLM 0.32.0 itself: the backend names it renders exist, and every
rendered `vllm serve` flag is one vLLM's own parser takes and validates (vLLM imported, no engine)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from scripts import recipe
from tests.support.paths import REPO


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scripts.recipe", *args], cwd=REPO,
                          capture_output=True, text=True)


def test_attention_backend_names_exist_in_vllm():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    for name in filter(None, recipe.VLLM_ATTENTION_BACKENDS.values()):
        assert AttentionBackendEnum[name].name == name


@pytest.fixture(scope="module")
def vllm_serve():
    """vLLM 0.32.0's own `vllm serve` parser and validator, built as its CLI builds them."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    top = FlexibleArgumentParser()
    command = ServeSubcommand()
    serve = command.subparser_init(top.add_subparsers(dest="subparser"))

    def parse(argv: list[str]):
        args = top.parse_args(["serve", *argv])
        command.validate(args)
        return args

    return serve, parse


RENDERINGS = [
    ("spark-2x", ["--node-rank", "0", "--master-addr", "10.0.0.1"]),
    ("spark-2x", ["--node-rank", "1", "--master-addr", "10.0.0.1"]),
    ("spark-4x", ["--node-rank", "3", "--master-addr", "10.0.0.1"]),
    ("cpu-4x", ["--node-rank", "0", "--master-addr", "10.0.0.1"]),
    ("cpu-tiny", []),
]


@pytest.mark.parametrize("name,node", RENDERINGS,
                         ids=["spark-head", "spark-worker", "spark4-rank3", "cpu4-head", "cpu-tiny"])
def test_every_rendered_flag_is_one_vllm_serve_takes(name, node, vllm_serve):
    """Oracle: vLLM's real parser. Each flag must be one of its exact option strings (argparse
    would also accept an abbreviation), and the whole argv must parse and validate."""
    serve, parse = vllm_serve
    argv = cli("render", name, "--as", "argv", *node).stdout.splitlines()
    flags = [a for a in argv if a.startswith("--")]
    assert flags and not [f for f in flags if f not in serve._option_string_actions]
    args = parse(argv)
    assert args.max_num_seqs == recipe.load_profile(name)["serving"]["max_num_seqs"]
    if node:  # vLLM reads the node's place in the engine as rendered
        profile = recipe.load_profile(name)
        assert (args.nnodes, args.node_rank) == (profile["parallel"]["nnodes"], int(node[1]))
        assert args.tensor_parallel_size == profile["parallel"]["tensor_parallel_size"]
        assert args.headless == (int(node[1]) > 0)


def test_spark_argv_serves_deepseek_v4_chat_features(vllm_serve):
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    args = vllm_serve[1](cli("render", "spark-2x", "--as", "argv").stdout.splitlines())
    assert args.tool_call_parser == "deepseek_v4" and args.enable_auto_tool_choice
    assert args.reasoning_parser == "deepseek_v4"
    assert args.default_chat_template_kwargs == {"thinking": True}
    assert args.enable_prompt_tokens_details
    assert args.tool_call_parser in ToolParserManager.list_registered()
    assert args.reasoning_parser in ReasoningParserManager.list_registered()
