"""The mutation-testing configuration ([tool.mutation] in pyproject.toml, scripts/dev/mutation.py).

The run itself is slow (`make mutation`); this checks what it would run on: every core module
of the issue is listed with tests that exist, and a bad entry is refused by name.
"""

from __future__ import annotations

import pytest

from scripts.dev import mutation

CORE_MODULES = {
    "context_store": "overlay/vllm/v1/spec_decode/dspark/context_store.py",
    "rings": "overlay/vllm/v1/spec_decode/dspark/rings.py",
    "step_plan": "overlay/vllm/v1/spec_decode/dspark/step_plan.py",
    "packed_prefill": "overlay/vllm/v1/spec_decode/dspark/packed_prefill.py",
    "adaptive": "overlay/vllm/v1/spec_decode/dspark/adaptive.py",
    "calibration": "overlay/vllm/v1/spec_decode/dspark/calibration.py",
    "rule_rest": "overlay/vllm/v1/spec_decode/dspark/rule_rest.py",
    "markov": "overlay/vllm/models/deepseek_v4/common/dspark/markov.py",
    "apply_overlay": "scripts/apply_overlay.py",
    "recipe": "scripts/recipe.py",
}


def test_every_core_module_is_mutated_against_existing_tests():
    config = mutation.load_config()
    assert {name: m.path for name, m in config.modules.items()} == CORE_MODULES
    for module in config.modules.values():
        assert module.tests and all((mutation.ROOT / t).is_file() for t in module.tests)
    # The example survivor: a loosened bound is among the selected operators.
    assert config.operators.fullmatch("core/ReplaceComparisonOperator_Gt_GtE")
    assert not config.operators.fullmatch("core/ReplaceBinaryOperator_Add_Pow")


@pytest.mark.parametrize(
    "entry, match",
    [
        ('module = "nope"\nmutant = "y"\nline = "x"\nreason = "r"', ".module: 'nope' is not one of"),
        ('module = "recipe"\nmutant = "y"\nline = "x"\nreason = " "', ".reason: say why"),
        ('module = "recipe"\nline = "x"\nreason = "r"', ": missing mutant"),
    ],
)
def test_equivalent_entry_without_module_or_reason_is_refused(tmp_path, entry, match):
    text = (mutation.ROOT / "pyproject.toml").read_text()
    bad = tmp_path / "pyproject.toml"
    bad.write_text(text + "\n[[tool.mutation.equivalent]]\n" + entry + "\n")
    index = len(mutation.load_config().equivalent)  # the appended entry comes last
    with pytest.raises(ValueError) as err:
        mutation.load_config(bad)
    assert str(err.value).startswith(f"[[tool.mutation.equivalent]] #{index}{match}")


def test_every_equivalent_entry_names_a_line_of_its_module():
    """An entry whose line was edited away would silently stop excluding anything."""
    config = mutation.load_config()
    for eq in config.equivalent:
        source = (mutation.ROOT / config.modules[eq["module"]].path).read_text()
        assert eq["line"] in {line.strip() for line in source.splitlines()}, eq
        assert eq["mutant"] != eq["line"], eq


@pytest.mark.parametrize("key", ["timeout_factor", "min_timeout", "max_timeout"])
@pytest.mark.parametrize("value", ["0", "-1", '"5"', "true"])
def test_timeouts_must_be_positive_numbers(tmp_path, key, value):
    text = (mutation.ROOT / "pyproject.toml").read_text()
    bad = tmp_path / "pyproject.toml"
    line = next(line for line in text.splitlines() if line.startswith(f"{key} = "))
    bad.write_text(text.replace(line, f"{key} = {value}", 1))
    with pytest.raises(ValueError, match=rf"^\[tool\.mutation\]\.{key}: expected a number > 0, got "):
        mutation.load_config(bad)
