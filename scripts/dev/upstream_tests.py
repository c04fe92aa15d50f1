"""vLLM's own tests of the files the overlay patches, run with and without the overlay.

Where the overlay does not mean to change upstream behaviour, upstream's tests must keep
passing: a test that passes on pristine vLLM and fails with the overlay applied is a
regression the overlay introduced. The tests come from the pinned release's sdist (the file
the suite already caches in .cache/sdist); "without" runs them against a copy of the venv's
vLLM with the overlay reverted (``apply_overlay --target COPY --revert``), "with" against
the venv itself. Many upstream tests need a GPU or a hub and fail either way: only the
difference counts.

A test the overlay fails on purpose (it changes that behaviour, e.g. the API key guarding every
path) is listed in ``INTENDED_CHANGES`` with the reason and does not count as a regression.

Usage: python -m scripts.dev.upstream_tests [--keep]
Ends with ``upstream-tests: N tests; P pass with the overlay, Q without; F fail only with
the overlay (I more by an intended change)`` and exits 1 when F > 0.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache"
PINS = yaml.safe_load((REPO / "recipe" / "pins.yaml").read_text())
VERSION = PINS["vllm"]["version"]
SDIST = CACHE / "sdist" / f"vllm-{VERSION}.tar.gz"
TEST_DEPS = CACHE / "upstream-test-deps"  # upstream's conftest imports tblib; kept out of .venv

# Upstream test files per overlay entry that changes an upstream file (None: upstream has no
# test of it that runs on CPU). A new patch must be listed here, so its tests are named.
UPSTREAM_TESTS: dict[str, list[str] | None] = {
    "vllm/config/vllm.py": ["tests/test_config.py"],
    "vllm/platforms/cpu.py": ["tests/platforms/test_cpu.py"],
    "vllm/v1/sample/ops/topk_topp_sampler.py": ["tests/v1/sample/test_topk_topp_sampler.py"],
    "vllm/triton_utils/dispatcher.py": ["tests/model_executor/test_triton_dispatcher.py"],
    "vllm/v1/worker/gpu_model_runner.py": ["tests/v1/worker/test_gpu_model_runner.py"],
    "vllm/v1/worker/cpu_model_runner.py": None,
    "vllm/v1/outputs.py": ["tests/v1/test_outputs.py"],
    "vllm/v1/core/sched/async_scheduler.py": ["tests/v1/core/test_async_scheduler.py"],
    "vllm/v1/core/sched/scheduler.py": ["tests/v1/core/test_scheduler.py"],
    "vllm/entrypoints/cli/main.py": ["tests/entrypoints/launchers/test_cli_args.py"],
    "vllm/entrypoints/serve/middleware/authenticate.py": [
        "tests/entrypoints/serve/middleware/test_authentication_middleware.py"
    ],
    "vllm/models/deepseek_v4/cpu/cpu_mla.py": None,
    "vllm/models/deepseek_v4/cpu/dspark.py": None,
    "vllm/models/deepseek_v4/cpu/__init__.py": None,
    "vllm/model_executor/kernels/linear/__init__.py": None,
    "vllm/model_executor/layers/fused_moe/oracle/mxfp4.py": None,
}


# Upstream tests the overlay fails on purpose: a test id prefix and the behaviour it changes.
INTENDED_CHANGES = {
    "entrypoints.serve.middleware.test_authentication_middleware::"
    "test_auto_discovered_unprotected_routes_no_auth": "with an API key set, the overlay guards "
    "every path but /health (api-key-guards-every-path.patch); upstream leaves these open",
}


def changed_upstream_files() -> list[str]:
    manifest = yaml.safe_load((REPO / "overlay" / "manifest.yaml").read_text())
    return [e["path"] for e in manifest["entries"] if e["kind"] != "new"]


def test_files() -> list[str]:
    missing = [p for p in changed_upstream_files() if p not in UPSTREAM_TESTS]
    if missing:
        sys.exit(f"UPSTREAM_TESTS: name the upstream tests of {', '.join(missing)} (or None)")
    return sorted({t for tests in UPSTREAM_TESTS.values() for t in tests or ()})


def extract_tests(dest: Path) -> Path:
    """The sdist's tests/ tree under ``dest`` (the sdist must be cached: `make test` does)."""
    if not SDIST.is_file():
        sys.exit(f"{SDIST} is missing: run `make test` once (it downloads the release sdist)")
    root = dest / f"vllm-{VERSION}"
    if not (root / "tests").is_dir():
        with tarfile.open(SDIST) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(f"{root.name}/tests/")]
            tar.extractall(dest, members=members, filter="data")
    return root


def pristine_copy(dest: Path) -> Path:
    """A copy of the venv's vllm package with the overlay reverted (the venv is not touched)."""
    import vllm

    installed = Path(vllm.__file__).parent
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    shutil.copytree(installed, dest / "vllm", symlinks=True)
    tool = REPO / "scripts" / "apply_overlay.sh"
    subprocess.run([str(tool), "--target", str(dest), "--revert"], check=True,
                   stdout=subprocess.DEVNULL, env={**os.environ, "OVERLAY_PYTHON": sys.executable})
    return dest


def run_pytest(root: Path, files: list[str], xml: Path, extra_path: Path | None) -> dict:
    """Outcome per test id ("passed", "failed", "skipped") of one pytest run."""
    path = [str(TEST_DEPS)] + ([str(extra_path)] if extra_path else [])
    env = {**os.environ, "PYTHONPATH": ":".join(path)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
           "--timeout=600", "--continue-on-collection-errors", *files]
    subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    outcomes = {}
    for case in ET.parse(xml).iter("testcase"):
        kind = {child.tag for child in case} & {"failure", "error", "skipped"}
        module = case.get("classname", "").split(".tests.", 1)[-1]  # under the sdist's tests/
        name = f"{module}::{case.get('name')}"
        outcomes[name] = "failed" if kind & {"failure", "error"} else "skipped" if kind else "passed"
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the pristine vLLM copy")
    args = parser.parse_args(argv)
    work = CACHE / "upstream-tests"
    files = test_files()
    if not (TEST_DEPS / "tblib").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(TEST_DEPS),
                        "tblib"], check=True)
    root = extract_tests(work)
    print(f">> {len(files)} upstream test files of vLLM {VERSION}: {' '.join(files)}")
    print(">> with the overlay (this venv)")
    with_overlay = run_pytest(root, files, work / "with.xml", None)
    print(">> without it (a reverted copy of this venv's vLLM)")
    pristine = pristine_copy(work / "pristine")
    try:
        without = run_pytest(root, files, work / "without.xml", pristine)
    finally:
        if not args.keep:
            shutil.rmtree(pristine, ignore_errors=True)
    only_with = sorted(
        t for t, o in with_overlay.items() if o == "failed" and without.get(t) == "passed"
    )
    regressions = []
    for test in only_with:
        why = next((w for prefix, w in INTENDED_CHANGES.items() if test.startswith(prefix)), None)
        print(f"  {'intended' if why else 'FAILS ONLY WITH THE OVERLAY'}: {test}"
              + (f" ({why})" if why else ""))
        if why is None:
            regressions.append(test)
    def passed(outcomes: dict) -> int:
        return sum(o == "passed" for o in outcomes.values())
    print(
        f"upstream-tests: {len(with_overlay)} tests; {passed(with_overlay)} pass with the "
        f"overlay, {passed(without)} without; {len(regressions)} fail only with the overlay "
        f"({len(only_with) - len(regressions)} more by an intended change)"
    )
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
