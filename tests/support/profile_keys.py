"""Recipe profiles read as raw YAML and flattened to dotted keys, for tests that compare two
profiles key by key."""

from __future__ import annotations

import yaml

from tests.support.paths import REPO


def raw_profile(name: str) -> dict:
    """recipe/profiles/<name>.yaml as written (no defaults, no validation)."""
    return yaml.safe_load((REPO / "recipe" / "profiles" / f"{name}.yaml").read_text())


def flat_keys(tree: dict, prefix: str = "") -> dict:
    """{"a.b.c": leaf} for every leaf of a nested mapping."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
