"""`serving.extra_args`: vLLM serve arguments the profile schema has no key for.

The profile renders every flag it owns (model, ports, parallelism, the speculative config,
the multi-node launch); `extra_args` adds the rest (`--chat-template`, `--max-num-partial-
prefills`, request logging, ...), rendered last. Because argparse lets the last value win, an
extra argument that sets a flag the recipe owns would silently override the profile, so those
are refused, as are flags vLLM does not know. Where vLLM is importable (the dev venv, the
image build, every container start) each argument goes through vLLM's own `vllm serve`
parser, aliases and `--flag.key value` forms included; on a bare host only the spelling of
the owned flags can be checked.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

# Destinations (argparse `dest`) the recipe renders or the launch owns, whatever the profile:
# the API key reaches vLLM only through the environment; --config would replace the profile.
ALWAYS_OWNED = frozenset({
    "model", "model_tag", "served_model_name", "host", "port", "api_key", "config",
    "tensor_parallel_size", "speculative_config", "distributed_executor_backend",
    "nnodes", "node_rank", "master_addr", "master_port", "headless",
})
# Short spellings vLLM 0.32.0 registers for owned flags, for the check without vLLM.
OWNED_ALIASES = {"-tp": "tensor_parallel_size", "-sc": "speculative_config"}


class ExtraArgsError(ValueError):
    """vLLM's parser refused the extra arguments (its own message)."""


_UNSET = object()


def vllm_serve_parser() -> argparse.ArgumentParser | None:
    """A fresh `vllm serve` parser whose every default is a sentinel; None without vLLM."""
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        return None
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    parser.set_defaults(**{a.dest: _UNSET for a in parser._actions if a.dest != "help"})

    def refuse(message: str) -> None:
        raise ExtraArgsError(message)

    parser.error = refuse  # type: ignore[method-assign]
    return parser


def dests_set_by(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The destinations `argv` sets, as vLLM's parser reads it (raises ExtraArgsError)."""
    try:
        namespace = parser.parse_args(list(argv))
    except SystemExit as exc:  # argparse's own exits (a bad --help, a type error)
        raise ExtraArgsError(f"vLLM's parser exited ({exc.code})") from None
    except (ValueError, TypeError) as exc:
        raise ExtraArgsError(str(exc)) from None
    return {dest for dest, value in vars(namespace).items() if value is not _UNSET}


def _flag_dest(word: str) -> str | None:
    """`--max_num-seqs=4` / `--speculative-config.method` -> its destination name."""
    if word in OWNED_ALIASES:
        return OWNED_ALIASES[word]
    if not word.startswith("--"):
        return None
    name = word[2:].split("=", 1)[0].split(".", 1)[0].replace("-", "_")
    return name[3:] if name.startswith("no_") else name


def check(
    extra_args: Any,
    rendered: list[list[str]],
    problems: list[str],
    parser_factory: Callable[[], argparse.ArgumentParser | None] | None = None,
) -> bool:
    """Append one problem per bad entry; return whether vLLM's parser did the checking.

    `rendered` holds the argvs the profile itself renders (head, worker): every destination
    they set is owned.
    """
    key = "serving.extra_args"
    if not isinstance(extra_args, list) or not all(isinstance(a, str) for a in extra_args):
        problems.append(f"{key}: expected a list of strings (one argv word each), got {extra_args!r}")
        return False
    for word in extra_args:
        if word.startswith("-") and " " in word.split("=", 1)[0]:
            flag, _, value = word.partition(" ")
            problems.append(
                f"{key}: {word!r} holds a flag and its value in one entry; write "
                f"'{flag}={value.strip()}' or two entries"
            )
    if problems or not extra_args:
        return False
    parser = (parser_factory or vllm_serve_parser)()
    if parser is None:
        owned = ALWAYS_OWNED | {d for argv in rendered for w in argv if (d := _flag_dest(w))}
        for word in extra_args:
            if (dest := _flag_dest(word)) in owned:
                problems.append(f"{key}: {word!r} sets {dest}, which the recipe owns; "
                                "change the profile key (or .env) instead")
        return False
    try:
        owned = ALWAYS_OWNED.union(*(dests_set_by(parser, argv) for argv in rendered))
    except ExtraArgsError as exc:  # the recipe's own argv: a recipe bug, say so
        problems.append(f"{key}: vLLM refuses the profile's own arguments: {exc}")
        return True
    try:
        taken = dests_set_by(parser, extra_args)
    except ExtraArgsError as exc:
        problems.append(f"{key}: vLLM's serve parser refuses {extra_args!r}: {exc}")
        return True
    for dest in sorted(taken & owned):
        words = [w for w in extra_args if _flag_dest(w) == dest] or [
            w for w in extra_args if not w.startswith("-")] or extra_args
        problems.append(f"{key}: {', '.join(map(repr, words))} sets {dest}, which the recipe "
                        "owns; change the profile key (or .env) instead")
    return True


_warned_without_vllm = False


def check_profile(profile: dict, problems: list[str], serve_argv: Callable[..., list[str]]) -> None:
    """Check `serving.extra_args` of a profile whose other keys are valid."""
    global _warned_without_vllm
    extra = profile["serving"].get("extra_args", [])
    own = {**profile, "serving": {**profile["serving"], "extra_args": []}}
    rendered = [serve_argv(own, 0, "127.0.0.1"), serve_argv(own, 1, "127.0.0.1")]
    checked_by_vllm = check(extra, rendered, problems)
    if extra and not checked_by_vllm and not problems and not _warned_without_vllm:
        _warned_without_vllm = True
        print("recipe note: vLLM is not importable here, so serving.extra_args was checked only "
              "for flags the recipe owns; the image build and the container start check the "
              "rest with vLLM's parser", file=sys.stderr)
