"""The mutation worker's machinery (scripts/dev/mutation_worker.py, scripts/dev/mutation_hook.py).

A mutant that does not reach the code under test would survive for the wrong reason, and a
child that outlives its timeout would stall the run: both are checked here on a throwaway
module, without running a mutation session.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import time

import pytest

from scripts.dev import mutation, mutation_hook, mutation_worker


@pytest.fixture
def tiny_module(tmp_path, monkeypatch):
    """pkg/mod.py (VALUE = 1), importable as `pkg.mod` and as `mod`."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    source = tmp_path / "pkg" / "mod.py"
    source.write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    yield source
    for name in ("pkg", "pkg.mod", "mod"):
        sys.modules.pop(name, None)


def test_mutant_replaces_the_file_under_every_import_name(tiny_module):
    mutation_hook.install_mutant(mutation_hook.spellings([str(tiny_module)]), "VALUE = 2\n")
    importlib.invalidate_caches()
    assert importlib.import_module("pkg.mod").VALUE == 2
    assert importlib.import_module("mod").VALUE == 2
    assert importlib.import_module("mod").__file__ == str(tiny_module)
    assert tiny_module.read_text() == "VALUE = 1\n"  # the file itself is never written


def test_python_subprocesses_import_the_mutant_and_report_their_lines(tiny_module, tmp_path):
    work = tmp_path / "work"
    env = mutation_worker.child_environment(work, [str(tiny_module)])
    mutant = tmp_path / "mutant.py"
    mutant.write_text("VALUE = 2\nOTHER = VALUE + 1\n")
    lines = tmp_path / "lines"
    lines.mkdir()
    env |= {mutation_hook.ENV_MUTANT: str(mutant), mutation_hook.ENV_LINES: str(lines)}
    env["PYTHONPATH"] += f":{tiny_module.parent}"
    out = subprocess.run([sys.executable, "-c", "import mod; print(mod.OTHER)"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout == "3\n"
    (report,) = lines.glob("*.json")
    assert json.loads(report.read_text()) == [1, 2]


def write_test(tmp_path, body: str):
    test = tmp_path / "test_child.py"
    test.write_text(f"def test_it():\n    {body}\n")
    return [str(test), "-q", "-p", "no:cacheprovider"]


@pytest.mark.parametrize("body, code", [("assert True", 0), ("assert False", 1)])
def test_child_returns_pytest_exit_code(tmp_path, body, code):
    args = write_test(tmp_path, body)
    assert mutation_worker.run_in_child(args, [], tmp_path / "log", 60, {}, None, []) == code


def test_child_past_its_timeout_is_killed_with_its_subprocesses(tmp_path):
    marker = tmp_path / "still-running"
    grandchild = f"import time, pathlib; time.sleep(3); pathlib.Path({str(marker)!r}).touch()"
    body = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {grandchild!r}]); "
            "time.sleep(60)")
    started = time.monotonic()
    code = mutation_worker.run_in_child(write_test(tmp_path, body), [], tmp_path / "log", 2, {},
                                        None, [])
    assert code is None and time.monotonic() - started < 30
    time.sleep(4)
    assert not marker.exists()  # the grandchild died with the child's process group


def test_warm_imports_never_name_the_module_or_local_files():
    config = mutation.load_config()
    step = mutation_worker.warm_names(config.modules["step_plan"])
    assert "vllm.v1.spec_decode.dspark" in step and "torch" in step
    assert "vllm.v1.spec_decode.dspark.step_plan" not in step
    ragged = mutation_worker.warm_names(config.modules["context_store"])
    assert "hypothesis" in ragged and not any(n.startswith("support") for n in ragged)
    recipe = mutation_worker.warm_names(config.modules["recipe"])
    assert "yaml" in recipe and "recipe" not in recipe and "conftest" not in recipe


@pytest.mark.parametrize("edited_since", [False, True])
def test_a_mutant_left_on_disk_by_a_killed_worker_is_put_back(tmp_path, edited_since):
    source = tmp_path / "tool.py"
    module = mutation.Module("tool", str(source), [])
    original, live = mutation_worker.journal(tmp_path)
    original.write_text("LIMIT = 64\n")
    live.write_text("LIMIT = 65\n")
    source.write_text("LIMIT = 66  # edited by hand\n" if edited_since else "LIMIT = 65\n")
    mutation_worker.recover_interrupted(module, tmp_path)
    assert source.read_text() == ("LIMIT = 66  # edited by hand\n" if edited_since else "LIMIT = 64\n")
    assert not live.exists()
