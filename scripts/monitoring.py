"""The monitoring images of recipe/pins.yaml as compose variables (`make monitoring`).

    python -m scripts.monitoring images     PROMETHEUS_IMAGE=... and GRAFANA_IMAGE=... lines

An image is `name:tag@digest` when the pin records a digest, else `name:tag`, and then a note
on stderr says so: a tag can be moved by its publisher, a digest cannot. A malformed pin exits 2
naming the key.
"""

from __future__ import annotations

import re
import sys

import yaml

from scripts.recipe import PINS_FILE

IMAGES = {"prometheus": "PROMETHEUS_IMAGE", "grafana": "GRAFANA_IMAGE"}
TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
NAME = re.compile(r"^[a-z0-9]+([._/-][a-z0-9]+)*$")


def image_refs(pins: dict) -> tuple[dict[str, str], list[str], list[str]]:
    """(variable -> image reference, problems, tag-only notes) of pins["monitoring"]."""
    refs, problems, notes = {}, [], []
    section = pins.get("monitoring")
    if not isinstance(section, dict):
        return refs, ["monitoring: missing; expected prometheus and grafana image pins"], notes
    for key, var in IMAGES.items():
        pin = section.get(key)
        if not isinstance(pin, dict):
            problems.append(f"monitoring.{key}: missing; expected {{image, tag, digest}}")
            continue
        name, tag, digest = (str(pin.get(k) or "") for k in ("image", "tag", "digest"))
        if not NAME.match(name):
            problems.append(f"monitoring.{key}.image: expected a repository name, got {name!r}")
        if not TAG.match(tag) or tag == "latest":
            problems.append(f"monitoring.{key}.tag: expected a fixed tag (not latest), got {tag!r}")
        if digest and not DIGEST.match(digest):
            problems.append(f"monitoring.{key}.digest: expected '' or sha256:<64 hex>, got {digest!r}")
        refs[var] = f"{name}:{tag}" + (f"@{digest}" if digest else "")
        if not digest:
            notes.append(f"monitoring.{key}: {name}:{tag} is pinned by tag only (no digest recorded)")
    return refs, problems, notes


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["images"]:
        print("usage: python -m scripts.monitoring images", file=sys.stderr)
        return 2
    refs, problems, notes = image_refs(yaml.safe_load(PINS_FILE.read_text()))
    for line in problems:
        print(f"recipe error: {line}", file=sys.stderr)
    if problems:
        return 2
    for line in notes:
        print(f"note: {line}", file=sys.stderr)
    for var, ref in refs.items():
        print(f"{var}={ref}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
