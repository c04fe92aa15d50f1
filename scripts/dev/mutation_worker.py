"""One module's mutants in one warm process: the heavy imports once, then a forked child per
mutant that runs the module's tests with the mutant in place, the tests that run its line first.

Starting `python -m pytest` per mutant spent most of each run importing torch, numpy, vLLM and
hypothesis. Here the worker imports what the tests and the module import from outside this
checkout (never the module itself, checked), records once which tests run which lines of the
module (in-process and in Python subprocesses, `mutation_hook.py`), then forks a child per
mutant: `pytest.main` with `-x`, covering tests first, so a killed mutant costs its first
failing test. The child is killed (with its process group) past the module's timeout.

Overlay modules are only ever imported, so their mutants live in memory (an import hook in the
child and its Python subprocesses) and the file on disk never changes: any number of workers
can run at once. Scripts also run as programs, which read the file itself, so their mutants
are written to disk (and put back whatever happens): one such module at a time.

    python -m scripts.dev.mutation_worker --module NAME [--limit N]
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import select
import signal
import sys
import sysconfig
import time
import traceback
from contextlib import suppress
from pathlib import Path

import pytest
from cosmic_ray.mutating import mutate_code
from cosmic_ray.plugins import get_operator
from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

from scripts.dev import mutation, mutation_hook

ROOT = mutation.ROOT
LOCAL_PACKAGES = {"scripts", "tests"}  # what the tests import from this checkout
KILLED_CODES = {1, 2, 3}  # tests failed; collection failed (no import); pytest crashed on it
OUTPUT_TAIL = 4000


def in_memory(module: mutation.Module) -> bool:
    return module.path.startswith("overlay/")


def installed_name(module: mutation.Module) -> str | None:
    """The overlay module's name in the installed vLLM (tests may import it by that name)."""
    if not in_memory(module):
        return None
    return module.path.removeprefix("overlay/").removesuffix(".py").replace("/", ".")


def target_paths(module: mutation.Module) -> list[str]:
    """Every file the mutated module is imported from: its source and, for overlay modules,
    the installed vLLM's copy, which must be the same bytes (else the tests test another file)."""
    source = ROOT / module.path
    paths = [str(source)]
    name = installed_name(module)
    if name:
        installed = Path(sysconfig.get_paths()["purelib"], *name.split(".")).with_suffix(".py")
        if installed.exists():
            if installed.read_bytes() != source.read_bytes():
                sys.exit(f"{installed} differs from {module.path}: apply the overlay first (make setup)")
            paths.append(str(installed))
    return paths


def module_imports(path: Path, package: str | None = None) -> set[str]:
    """Module names imported at the top of a file (relative ones resolved against ``package``)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            if node.level == 0:
                names.add(node.module)
            elif package:
                names.add(importlib.util.resolve_name("." * node.level + (node.module or ""), package))
    return names


def warm_names(module: mutation.Module) -> list[str]:
    """What the tests import from outside this checkout; for a test importing the module
    through vLLM, the module's package and imports instead of the module."""
    own_name = installed_name(module)
    names = {n for n in module_imports(ROOT / module.path) if n.split(".")[0] not in LOCAL_PACKAGES}
    for test in [*module.tests, "tests/conftest.py"]:
        for name in module_imports(ROOT / test):
            if name.split(".")[0] in LOCAL_PACKAGES:
                continue
            if name == own_name:
                package = name.rpartition(".")[0]
                names |= {package} | module_imports(ROOT / module.path, package)
            else:
                names.add(name)
    return sorted(names)


def warm_up(module: mutation.Module, targets: list[str]) -> None:
    """The warm imports, and pytest's plugins (anyio's alone takes ~1 s to import)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    plugins = [ep.module for ep in importlib.metadata.entry_points(group="pytest11")]
    for name in warm_names(module) + plugins:
        importlib.import_module(name)
    resolved = {os.path.realpath(p) for p in targets}
    for loaded in list(sys.modules.values()):
        origin = getattr(loaded, "__file__", None)
        if origin and os.path.realpath(origin) in resolved:
            sys.exit(f"{module.name}: warming up imported {module.path} as {loaded.__name__};"
                     " a child could not load its mutant")


def child_environment(work: Path, targets: list[str]) -> dict[str, str]:
    """PYTHONPATH with the hook's sitecustomize first; no bytecode written (a mutant's .pyc
    must never outlive it: .pyc files are checked by size and mtime in whole seconds)."""
    site = work / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(mutation_hook.SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "PYTHONDONTWRITEBYTECODE": "1",
            mutation_hook.ENV_TARGETS: json.dumps(targets)}


def run_in_child(pytest_args: list[str], plugins: list, log: Path, timeout: float,
                 env: dict[str, str], mutant: str | None, targets: list[str]) -> int | None:
    """pytest in a forked child (own process group, output to ``log``); its exit code, or
    None when it ran past ``timeout`` and was killed. Bytecode is written only when ``env``
    allows it (the run on the unchanged module: it leaves pytest's rewritten test modules
    cached, which the mutant runs then read instead of rewriting them each time)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.setpgid(0, 0)
            out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.environ.update(env)
            sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
            if mutant is not None:
                mutation_hook.install_mutant(mutation_hook.spellings(targets), mutant)
            if "torch" in sys.modules:
                sys.modules["torch"].set_num_threads(1)
            code = int(pytest.main(pytest_args, plugins=plugins))
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    with suppress(ProcessLookupError):
        os.setpgid(pid, pid)  # also from here, so that killpg below cannot miss
    done = os.pidfd_open(pid)
    try:
        finished = select.select([done], [], [], timeout)[0]
    finally:
        os.close(done)
        with suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # past the timeout, interrupted, or leftovers of the tests
    status = os.waitpid(pid, 0)[1]
    return os.waitstatus_to_exitcode(status) if finished else None


class RecordLines:
    """pytest plugin: per test, the target lines it ran (here and in subprocesses), and its time."""

    def __init__(self, targets: list[str], lines_dir: Path, out: Path):
        self.recorder = mutation_hook.LineRecorder(mutation_hook.spellings(targets))
        self.lines_dir, self.out = lines_dir, out
        self.tests: dict[str, dict] = {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item):
        self.recorder.lines = set()
        self.recorder.start()
        try:
            yield
        finally:
            self.recorder.stop()
        lines = self.recorder.lines
        for report in self.lines_dir.glob("*.json"):
            lines |= set(json.loads(report.read_text()))
            report.unlink()
        self.tests.setdefault(item.nodeid, {"seconds": 0.0})["lines"] = sorted(lines)

    def pytest_runtest_logreport(self, report):
        self.tests.setdefault(report.nodeid, {"seconds": 0.0})["seconds"] += report.duration

    def pytest_sessionfinish(self):
        self.out.write_text(json.dumps(self.tests))


class CoveringFirst:
    """pytest plugin: the tests that run the mutated line first, each group fastest first."""

    def __init__(self, covering: set[str], seconds: dict[str, float]):
        self.covering, self.seconds = covering, seconds

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        items.sort(key=lambda it: (it.nodeid not in self.covering, self.seconds.get(it.nodeid, 0.0)))


def record_tests(module: mutation.Module, config: mutation.Config, work: Path,
                 env: dict[str, str], targets: list[str]) -> tuple[dict, float]:
    """Run the tests once on the unchanged module: the lines and seconds of each test, and the
    wall time. Reused while the module, its tests and the configuration are unchanged."""
    cache = work / "tests.json"
    key = mutation.tests_digest(module) + mutation.session_files(module, config)[2]
    if cache.exists() and (saved := json.loads(cache.read_text()))["key"] == key:
        return saved["tests"], saved["wall"]
    lines_dir = work / "lines"
    lines_dir.mkdir(parents=True, exist_ok=True)
    out = work / "record.json"
    out.unlink(missing_ok=True)
    started = time.monotonic()
    args = [a for a in config.pytest_args if a != "-x"] + module.tests
    record_env = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}
    code = run_in_child(args, [RecordLines(targets, lines_dir, out)], work / "record.log",
                        config.max_timeout, record_env | {mutation_hook.ENV_LINES: str(lines_dir)},
                        None, targets)
    wall = time.monotonic() - started
    if code != 0 or not out.exists():
        sys.exit(f"{module.name}: the tests fail on the unchanged module (exit {code});"
                 f" see {work / 'record.log'}")
    tests = json.loads(out.read_text())
    cache.write_text(json.dumps({"key": key, "tests": tests, "wall": wall}))
    return tests, wall


def journal(work: Path) -> tuple[Path, Path]:
    """(the original source, the mutant on disk) while a disk mutant is live."""
    return work / "original.txt", work / "live-mutant.txt"


def recover_interrupted(module: mutation.Module, work: Path) -> None:
    """A worker killed outright (SIGKILL, power loss) leaves its mutant on disk: put the
    original back, unless the file was edited since (then it is no longer the mutant)."""
    original_copy, live = journal(work)
    source = ROOT / module.path
    if live.exists() and source.read_text() == live.read_text():
        source.write_text(original_copy.read_text())
        print(f"{module.name}: put {module.path} back after an interrupted run", flush=True)
    live.unlink(missing_ok=True)


def diff_of(module: mutation.Module, original: str, mutated: str) -> str:
    return "".join(difflib.unified_diff(original.splitlines(True), mutated.splitlines(True),
                                        module.path, module.path))


def test_mutant(item, module: mutation.Module, config: mutation.Config, work: Path,
                env: dict[str, str], targets: list[str], tests: dict, timeout: float) -> WorkResult:
    (m,) = item.mutations
    source_path = ROOT / module.path
    original = source_path.read_text()
    mutated = mutate_code(original, get_operator(m.operator_name)(), m.occurrence)
    if mutated is None:
        return WorkResult(worker_outcome=WorkerOutcome.NO_TEST, output="no mutation at this occurrence")
    covering = {t for t, rec in tests.items() if m.start_pos[0] in rec["lines"]}
    plugin = CoveringFirst(covering, {t: rec["seconds"] for t, rec in tests.items()})
    log = work / "mutant.log"
    if in_memory(module):
        mutant_file = work / "mutant.py"
        mutant_file.write_text(mutated)
        code = run_in_child(config.pytest_args + module.tests, [plugin], log, timeout,
                            env | {mutation_hook.ENV_MUTANT: str(mutant_file)}, mutated, targets)
    else:
        original_copy, live = journal(work)
        original_copy.write_text(original)
        live.write_text(mutated)
        try:
            source_path.write_text(mutated)
            code = run_in_child(config.pytest_args + module.tests, [plugin], log, timeout, env,
                                None, targets)
        finally:
            source_path.write_text(original)
            live.unlink()
    output = log.read_text(errors="replace")[-OUTPUT_TAIL:]
    diff = diff_of(module, original, mutated)
    if code is None:
        return WorkResult(worker_outcome=WorkerOutcome.NORMAL, test_outcome=TestOutcome.KILLED,
                          output=f"{mutation.TIMED_OUT} {timeout:.0f} s\n{output}", diff=diff)
    if code == 0:
        return WorkResult(worker_outcome=WorkerOutcome.NORMAL, test_outcome=TestOutcome.SURVIVED,
                          output=output, diff=diff)
    if code in KILLED_CODES or code < 0:  # a failure, or the tests crashed on a signal
        return WorkResult(worker_outcome=WorkerOutcome.NORMAL, test_outcome=TestOutcome.KILLED,
                          output=output, diff=diff)
    return WorkResult(worker_outcome=WorkerOutcome.ABNORMAL, output=f"pytest exit {code}\n{output}",
                      diff=diff)


def run_module(module: mutation.Module, config: mutation.Config, limit: int | None) -> None:
    started = time.monotonic()
    mutation.hold_lock(module)
    work = mutation.session_files(module, config)[1].parent / "work"
    work.mkdir(parents=True, exist_ok=True)
    recover_interrupted(module, work)
    session = mutation.prepare(module, config)
    with use_db(str(session), WorkDB.Mode.open) as db:
        first = mutation.run_order(session)
        pending = sorted(db.pending_work_items,
                         key=lambda item: (first.get(item.job_id, 1), item.job_id))[:limit]
    if not pending:
        print(f"{module.name}: nothing to run", flush=True)
        return
    targets = target_paths(module)
    os.chdir(ROOT)
    env = child_environment(work, targets)
    warm_up(module, targets)
    tests, wall = record_tests(module, config, work, env, targets)
    timeout = min(config.max_timeout, max(config.min_timeout, config.timeout_factor * wall))
    print(f"{module.name}: warm after {time.monotonic() - started:.0f} s; tests take {wall:.0f} s"
          f" unchanged; timeout per mutant {timeout:.0f} s", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` puts the file back
    done = 0
    with use_db(str(session), WorkDB.Mode.open) as db:
        mutants_started = time.monotonic()
        for number, item in enumerate(pending, 1):
            began = time.monotonic()
            result = test_mutant(item, module, config, work, env, targets, tests, timeout)
            db.set_result(item.job_id, result)
            done += 1
            (m,) = item.mutations
            print(f"{module.name} {number}/{len(pending)} line {m.start_pos[0]}"
                  f" {m.operator_name.removeprefix('core/')}:"
                  f" {(result.test_outcome or result.worker_outcome).value} ({time.monotonic() - began:.1f} s)",
                  flush=True)
    spent = time.monotonic() - mutants_started if done else 0.0
    per = f", {spent / done:.1f} s per mutant" if done else ""
    print(f"{module.name}: {done} mutants in {spent:.0f} s{per}; {time.monotonic() - started:.0f} s"
          " in all", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--module", required=True, help="a module name from [tool.mutation.modules]")
    parser.add_argument("--limit", type=int, help="run at most this many pending mutants")
    args = parser.parse_args(argv)
    config = mutation.load_config()
    if args.module not in config.modules:
        parser.error(f"--module: unknown {args.module!r}; expected one of {sorted(config.modules)}")
    run_module(config.modules[args.module], config, args.limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
