"""The READMEs are playbooks: every make target, script, module and path they name exists.

A user copies commands from README.md as written, so a renamed script or a dropped make target
must fail here rather than on their machine: make targets and variables, modules, paths, the
profile keys and compose services the commands name. README.md also stays short, with the
two-Spark path near the top, and links only inside the repository or to the official pages of
the model, NVIDIA's DGX Spark and vLLM.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from scripts import recipe

REPO = Path(__file__).resolve().parents[2]
DOCS = [
    d for d in ("README.md", "overlay/README.md", "scripts/bench/README.md") if (REPO / d).is_file()
] + sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))
# The public official pages a document may link to: (host, path prefix).
OFFICIAL = {
    ("huggingface.co", "/deepseek-ai/"),  # the model card
    ("docs.nvidia.com", "/dgx/dgx-spark"),  # NVIDIA's DGX Spark user guide
    ("build.nvidia.com", "/spark/"),  # NVIDIA's DGX Spark playbooks
    ("docs.vllm.ai", "/"),
}
PROFILE_KEY = re.compile(r"(?<![\w./])((?:model|parallel|serving|speculative|demo)\.[a-z_]+)(?![\w.])")
MAKE_VAR = re.compile(r"(?:^|\s)make\s+(?:[a-z][a-z0-9-]*\s+)?((?:[A-Z_]+=\S*(?:[ \t]+|$))+)", re.M)
COMPOSE_SERVICE = re.compile(r"--profile\s+(\w+)\s+(?:up|down)(?:\s+-d)?((?:\s+[a-z]+)*)")
MAX_README_LINES = 300
SPARK_SECTION_WITHIN = 100

FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
MAKE = re.compile(r"(?:^|[\s;&|(])make\s+(?:[A-Z_]+=\S*\s+)*([a-z][a-z0-9-]*)")
MODULE = re.compile(r"python\s+-m\s+(scripts(?:\.\w+)+)")
# A repository path: starts at a top-level folder the product card names; docker/.env is the
# file the user writes, not one the repository ships.
REPO_PATH = re.compile(r"(?<![\w./$-])((?:scripts|overlay|recipe|tests|docker|examples|docs)/[\w.*/-]*)")
USER_FILES = {"docker/.env"}
TEST_FILE = re.compile(r"^test_\w+\.py$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
ISSUE_REF = re.compile(r"\bissues?\s*#?\d+", re.I)


def read(doc: str) -> str:
    return (REPO / doc).read_text()


def code_spans(text: str) -> list[str]:
    """Fenced blocks and inline code: where the commands a user copies are."""
    blocks = FENCED.findall(text)
    rest = FENCED.sub("", text)
    return blocks + INLINE.findall(rest)


def makefile_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([a-z][a-z0-9-]*)\s*:(?!=)", text, re.M))


def module_file_exists(module: str) -> bool:
    """``python -m scripts.a.b`` runs scripts/a/b.py or scripts/a/b/__main__.py."""
    base = REPO.joinpath(*module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()


def path_exists(path: str) -> bool:
    path = path.rstrip(".,:;")
    if "*" in path:
        return any(REPO.glob(path))
    return (REPO / path).exists()


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for heading in re.findall(r"^#+\s+(.+)$", FENCED.sub("", text), re.M):
        slug = re.sub(r"[^\w\s-]", "", heading.strip().lower().replace("`", ""))
        out.add(slug.replace(" ", "-"))
    return out


def test_readme_is_at_most_300_lines():
    n = len(read("README.md").splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES})"


def test_two_spark_section_starts_within_the_first_100_lines():
    lines = read("README.md").splitlines()
    starts = [i + 1 for i, line in enumerate(lines) if re.match(r"^##\s.*\bTwo Sparks\b", line)]
    assert starts, "README.md has no '## ... Two Sparks' section"
    assert starts[0] <= SPARK_SECTION_WITHIN, f"the two-Spark section starts at line {starts[0]}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_make_target_exists(doc):
    targets = makefile_targets()
    named = {t for span in code_spans(read(doc)) for t in MAKE.findall(span)}
    missing = sorted(named - targets)
    assert not missing, f"{doc} names make targets the Makefile lacks: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_python_module_exists(doc):
    modules = set(MODULE.findall(read(doc)))
    missing = sorted(m for m in modules if not module_file_exists(m))
    assert not missing, f"{doc} runs modules that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_repository_path_exists(doc):
    text = read(doc)
    paths = {p.rstrip(".,:;") for p in REPO_PATH.findall(text)} - USER_FILES
    missing = sorted(p for p in paths if not path_exists(p))
    assert not missing, f"{doc} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_test_file_named_exists(doc):
    names = {s for s in code_spans(read(doc)) if TEST_FILE.match(s)}
    present = {p.name for p in (REPO / "tests").rglob("test_*.py")}
    missing = sorted(names - present)
    assert not missing, f"{doc} names test files that do not exist under tests/: {missing}"


def test_overlay_readme_paths_are_overlay_files():
    """overlay/README.md names files by their path inside vLLM's tree (``vllm/...``) and the
    proposer package's modules as ``dspark/<module>.py``."""
    doc = "overlay/README.md"
    if doc not in DOCS:
        pytest.skip("no overlay/README.md")
    package = REPO / "overlay/vllm/v1/spec_decode"
    missing = []
    for span in code_spans(read(doc)):
        if re.fullmatch(r"vllm/[\w./-]+", span) and not (REPO / "overlay" / span).exists():
            missing.append(span)
        if re.fullmatch(r"dspark/\w+\.py", span) and not (package / span).is_file():
            missing.append(span)
    assert not missing, f"{doc} names overlay files that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS)
def test_links_stay_inside_the_repository(doc):
    text = read(doc)
    problems = []
    for target in LINK.findall(text):
        if "://" in target:
            url = urlsplit(target)
            if url.scheme != "https" or not any(
                url.hostname == host and url.path.startswith(prefix) for host, prefix in OFFICIAL
            ):
                problems.append(f"{target}: outside the repository, not an official page")
        elif target.startswith("mailto:"):
            problems.append(f"{target}: outside the repository")
        elif not ((REPO / doc).parent / target.split("#")[0]).resolve().is_relative_to(REPO):
            problems.append(f"{target}: climbs out of the repository")
        elif target.startswith("#"):
            if target[1:] not in anchors(text):
                problems.append(f"{target}: no such heading")
        elif not ((REPO / doc).parent / target.split("#")[0]).exists():
            problems.append(f"{target}: no such file")
        elif "#" in target:
            linked = (REPO / doc).parent / target.split("#")[0]
            if linked.suffix == ".md" and target.split("#")[1] not in anchors(linked.read_text()):
                problems.append(f"{target}: no such heading")
    assert not problems, f"{doc}: " + "; ".join(problems)


@pytest.mark.parametrize("doc", DOCS)
def test_no_reference_to_issues(doc):
    found = ISSUE_REF.findall(read(doc))
    assert not found, f"{doc} refers to issues: {found}"


def _schema_keys(schema: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, spec in schema.items():
        keys.add(prefix + key)
        if isinstance(spec, dict):
            keys |= _schema_keys(spec, f"{prefix}{key}.")
    return keys


@pytest.mark.parametrize("doc", DOCS)
def test_every_profile_key_named_exists(doc):
    """`serving.extra_args`, `model.revision`, ...: keys of the profile schema."""
    named = {k for span in code_spans(read(doc)) for k in PROFILE_KEY.findall(span)}
    missing = sorted(named - _schema_keys(recipe.SCHEMA))
    assert not missing, f"{doc} names profile keys the schema lacks: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_make_variable_named_is_the_makefiles(doc):
    """`make image DOWNLOAD_KERNELS=0`: a variable the Makefile reads, not a silent no-op."""
    text = (REPO / "Makefile").read_text()
    named = {v.split("=")[0] for span in code_spans(read(doc)) for group in MAKE_VAR.findall(span)
             for v in group.split()}
    missing = sorted(v for v in named if f"$({v})" not in text and v not in ("PYTHON",))
    assert not missing, f"{doc} passes make variables the Makefile never reads: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_compose_profile_and_service_named_exists(doc):
    compose = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())["services"]
    texts = code_spans(read(doc)) + [(REPO / "Makefile").read_text()]
    problems = []
    for span in texts:
        for profile, services in COMPOSE_SERVICE.findall(span):
            in_profile = {n for n, svc in compose.items() if profile in svc.get("profiles", [])}
            if not in_profile:
                problems.append(f"--profile {profile}: no service has it")
            problems += [f"{s}: not a service of --profile {profile}" for s in services.split()
                         if s not in in_profile]
    assert not problems, f"{doc}: {problems}"
