"""serving.extra_args through vLLM 0.32.0's own `vllm serve` parser (vLLM imported, no engine):
unknown flags, bad values and every spelling of an owned flag are refused at `validate`, naming
them; accepted arguments land last in the rendered argv, and vLLM's CLI reads them there."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from scripts import recipe
from tests.support.paths import REPO


def with_extra(extra: list[str]) -> dict:
    profile = yaml.safe_load((REPO / "recipe/profiles/spark-2x.yaml").read_text())
    profile["serving"]["extra_args"] = extra
    return profile


@pytest.mark.parametrize(
    "extra,named",
    [
        (["--seed", "two"], "argument --seed: invalid"),
        (["--api-key", "k"], "'--api-key' sets api_key, which the recipe owns"),
        (["-tp", "1"], "'-tp' sets tensor_parallel_size, which the recipe owns"),
        (["--speculative_config.num_speculative_tokens=3"], "sets speculative_config, which"),
        (["--tensor-parallel", "1"], "sets tensor_parallel_size, which the recipe owns"),
        (["--port", "9000"], "'--port' sets port, which the recipe owns"),
        (["--no-async-scheduling"], "'--no-async-scheduling' sets async_scheduling, which"),
        (["my/other-model"], "'my/other-model' sets model_tag, which the recipe owns"),
    ],
    ids=["bad-value", "api-key", "alias", "dotted-json", "abbreviation", "port", "negated",
         "positional"],
)
def test_validate_refuses_and_names_it(extra, named):
    with pytest.raises(recipe.RecipeError) as exc:
        recipe.validate(with_extra(["--enable-log-requests", *extra]))
    (problem,) = exc.value.problems
    assert problem.startswith("serving.extra_args: ") and named in problem, problem


def test_the_cli_refuses_an_unknown_flag_naming_it(tmp_path):
    path = tmp_path / "with-extra.yaml"
    path.write_text(yaml.safe_dump(with_extra(["--enable-log-requests", "--no-such-flag"])))
    done = subprocess.run([sys.executable, "-m", "scripts.recipe", "validate", str(path)],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2
    assert ("recipe error: serving.extra_args: vLLM's serve parser refuses "
            "['--enable-log-requests', '--no-such-flag']: unrecognized arguments: --no-such-flag"
            ) in done.stderr.splitlines()


def test_accepted_arguments_are_rendered_last_and_read_by_vllm():
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    extra = ["--seed", "7", "--enable-log-requests", "--kv-cache-memory-bytes=3000000000",
             "--chat-template-content-format", "openai"]
    argv = recipe.serve_argv(recipe.validate(with_extra(extra)), 0, "10.0.0.1")
    assert argv[-len(extra):] == extra
    top = FlexibleArgumentParser()
    command = ServeSubcommand()
    command.subparser_init(top.add_subparsers(dest="subparser"))
    args = top.parse_args(["serve", *argv])
    command.validate(args)
    assert (args.seed, args.enable_log_requests, args.kv_cache_memory_bytes) == (7, True, 3 * 10**9)
    assert args.chat_template_content_format == "openai"
    assert args.tensor_parallel_size == 2 and args.port == 8000 and args.node_rank == 0
