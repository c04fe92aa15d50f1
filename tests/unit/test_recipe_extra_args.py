"""serving.extra_args without vLLM (a bare host): the shape of the list and the flags the recipe
owns are refused by name; accepted words are rendered last. vLLM's own parser is exercised in
tests/integration/test_recipe_extra_args_vllm.py."""

from __future__ import annotations

import pytest
import yaml

from scripts import recipe, recipe_extra_args
from tests.support.paths import REPO


@pytest.fixture(autouse=True)
def no_vllm(monkeypatch):
    """The host path: as if vLLM were not importable."""
    monkeypatch.setattr(recipe_extra_args, "vllm_serve_parser", lambda: None)


def with_extra(name: str, extra) -> dict:
    profile = yaml.safe_load((REPO / f"recipe/profiles/{name}.yaml").read_text())
    profile["serving"]["extra_args"] = extra
    return profile


def problems_of(profile: dict) -> list[str]:
    with pytest.raises(recipe.RecipeError) as exc:
        recipe.validate(profile)
    return exc.value.problems


def test_extra_args_are_optional_and_rendered_last():
    base = recipe.validate(with_extra("spark-2x", []))
    plain = recipe.serve_argv(base, 0, "10.0.0.1")
    extra = ["--seed", "7", "--enable-log-requests"]
    argv = recipe.serve_argv(recipe.validate(with_extra("spark-2x", extra)), 0, "10.0.0.1")
    assert argv == plain + extra
    profile = with_extra("spark-2x", [])
    del profile["serving"]["extra_args"]
    assert recipe.serve_argv(recipe.validate(profile), 0, "10.0.0.1") == plain


@pytest.mark.parametrize(
    "words,named",
    [
        (["--api-key", "k"], "'--api-key' sets api_key"),
        (["--port=9000"], "'--port=9000' sets port"),
        (["-tp", "1"], "'-tp' sets tensor_parallel_size"),
        (["--speculative-config.num_speculative_tokens", "3"], "sets speculative_config"),
        (["--max_num_seqs", "64"], "'--max_num_seqs' sets max_num_seqs"),
        (["--no-enable-prefix-caching"], "sets enable_prefix_caching"),
        (["--headless"], "'--headless' sets headless"),
        (["--config", "x.yaml"], "sets config"),
    ],
)
def test_flags_the_recipe_owns_are_refused_by_name(words, named):
    (problem,) = problems_of(with_extra("spark-2x", ["--enable-log-requests", *words]))
    assert problem.startswith("serving.extra_args: ") and named in problem
    assert "which the recipe owns" in problem


def test_a_flag_and_its_value_in_one_entry_is_refused_with_the_fix():
    (problem,) = problems_of(with_extra("cpu-tiny", ["--seed 7"]))
    assert "'--seed=7' or two entries" in problem


@pytest.mark.parametrize("bad", ["--enable-log-requests", ["--x", 3], {"a": 1}])
def test_extra_args_must_be_a_list_of_strings(bad):
    (problem,) = problems_of(with_extra("cpu-tiny", bad))
    assert problem.startswith("serving.extra_args: expected")


def test_without_vllm_the_check_says_what_it_did_not_do(capsys, monkeypatch):
    monkeypatch.setattr(recipe_extra_args, "_warned_without_vllm", False)
    recipe.validate(with_extra("cpu-tiny", ["--no-such-flag"]))
    assert "checked only for flags the recipe owns" in capsys.readouterr().err
