"""The mutation-testing configuration ([tool.mutation] in pyproject.toml, scripts/mutation.py).

The run itself is slow (`make mutation`); this checks what it would run on: every core module
of the issue is listed with tests that exist, and a bad entry is refused by name.
"""

from __future__ import annotations

import re

import mutation
import pytest

CORE_MODULES = {
    "dspark_ragged": "overlay/vllm/v1/spec_decode/dspark_ragged.py",
    "dspark_step": "overlay/vllm/v1/spec_decode/dspark_step.py",
    "packed_prefill": "overlay/vllm/models/deepseek_v4/common/packed_prefill.py",
    "dspark_markov": "overlay/vllm/models/deepseek_v4/common/dspark_markov.py",
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
        ('module = "nope"\nmutant = "y"\nline = "x"\nreason = "r"', "#0.module: 'nope' is not one of"),
        ('module = "recipe"\nmutant = "y"\nline = "x"\nreason = " "', "#0.reason: say why"),
        ('module = "recipe"\nline = "x"\nreason = "r"', "#0: missing mutant"),
    ],
)
def test_equivalent_entry_without_module_or_reason_is_refused(tmp_path, entry, match):
    text = (mutation.ROOT / "pyproject.toml").read_text()
    bad = tmp_path / "pyproject.toml"
    bad.write_text(text + "\n[[tool.mutation.equivalent]]\n" + entry + "\n")
    with pytest.raises(ValueError, match=re.escape("[[tool.mutation.equivalent]]")) as err:
        mutation.load_config(bad)
    assert match in str(err.value)
