"""Mutation testing of the core modules with cosmic-ray: the score per module and the survivors.

A mutant is a small realistic bug (a loosened bound, a negated check, an off-by-one) written
into one module by cosmic-ray; the module's fast unit tests run against it and should fail. The
modules, their tests, the operators used and the equivalent mutants (each with its reason) are
in pyproject.toml under [tool.mutation]. An equivalent mutant is named by its line and the line
as mutated (`--report-only` prints both). Each module keeps its own cosmic-ray session under
.cache/mutation/<module>/, resumed when interrupted and rebuilt when the module's source, the
operators or the equivalent list change; when only its tests change, the survivors run again
(killed mutants stay killed). The mutants run in `mutation_worker.py` processes, `--jobs` at a
time (one module each).

    .venv/bin/python -m scripts.dev.mutation [--module NAME ...] [--limit N] [--jobs J] [--report-only]
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import re
import shlex
import sqlite3
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import toml
from cosmic_ray.mutating import mutate_code
from cosmic_ray.plugins import get_operator
from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

ROOT = Path(__file__).resolve().parents[2]
WORKDIR = ROOT / ".cache" / "mutation"
BIN = Path(sys.executable).parent
HELD_LOCKS: list = []
NOT_SELECTED = "operator not selected in [tool.mutation].operators"
TIMED_OUT = "timed out after"  # how a worker's output starts when it killed the tests


@dataclass(frozen=True)
class Module:
    name: str
    path: str
    tests: list[str]


@dataclass(frozen=True)
class Config:
    modules: dict[str, Module]
    operators: re.Pattern
    pytest_args: list[str]
    timeout_factor: float
    min_timeout: float
    max_timeout: float
    equivalent: list[dict]

    def disk_mutants(self, name: str) -> bool:
        """Scripts also run as programs, so their mutants are written to disk (mutation_worker)."""
        return not self.modules[name].path.startswith("overlay/")


def load_config(pyproject: Path = ROOT / "pyproject.toml") -> Config:
    """[tool.mutation] from pyproject.toml, every field checked."""
    section = tomllib.loads(pyproject.read_text())["tool"]["mutation"]
    for key in ("timeout_factor", "min_timeout", "max_timeout"):
        value = section.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"[tool.mutation].{key}: expected a number > 0, got {value!r}")
    modules = {}
    for name, spec in section["modules"].items():
        if not (ROOT / spec["path"]).is_file():
            raise ValueError(f"[tool.mutation.modules.{name}].path: no file {spec['path']}")
        modules[name] = Module(name, spec["path"], list(spec["tests"]))
    for i, eq in enumerate(section.get("equivalent", [])):
        where = f"[[tool.mutation.equivalent]] #{i}"
        missing = sorted({"module", "line", "mutant", "reason"} - eq.keys())
        if missing:
            raise ValueError(f"{where}: missing {', '.join(missing)}")
        if eq["module"] not in modules:
            raise ValueError(f"{where}.module: {eq['module']!r} is not one of {sorted(modules)}")
        if not eq["reason"].strip():
            raise ValueError(f"{where}.reason: say why the mutant cannot change behaviour")
    return Config(
        modules=modules,
        operators=re.compile("|".join(f"(?:{p})" for p in section["operators"])),
        pytest_args=list(section["pytest_args"]),
        timeout_factor=float(section["timeout_factor"]),
        min_timeout=float(section["min_timeout"]),
        max_timeout=float(section["max_timeout"]),
        equivalent=list(section.get("equivalent", [])),
    )


def session_files(module: Module, config: Config) -> tuple[Path, Path, str]:
    """(cosmic-ray config, session db, fingerprint of what makes the mutants and their results:
    the source, the operators and pytest's arguments; the equivalent list is applied on top)."""
    source = (ROOT / module.path).read_bytes()
    settings = json.dumps([config.operators.pattern, config.pytest_args], sort_keys=True).encode()
    digest = hashlib.sha256(source + settings).hexdigest()
    folder = WORKDIR / module.name
    return folder / "cosmic-ray.toml", folder / "session.sqlite", digest


def mutant_line(source: str, operator: str, occurrence: int, line: int) -> str:
    """The text of ``line`` once the mutation is applied (how the equivalent list names it)."""
    mutated = mutate_code(source, get_operator(operator)(), occurrence)
    return mutated.splitlines()[line - 1].strip() if mutated else ""


def skip_reason(config: Config, module: Module, source: str, m) -> str | None:
    """Why a mutant is not scored (an unselected operator, or a listed equivalent), or None."""
    if not config.operators.fullmatch(m.operator_name):
        return NOT_SELECTED
    line = m.start_pos[0]
    text = source.splitlines()[line - 1].strip()
    same_line = [eq for eq in config.equivalent if eq["module"] == module.name and eq["line"] == text]
    if not same_line:
        return None
    mutant = mutant_line(source, m.operator_name, m.occurrence, line)
    reasons = [eq["reason"] for eq in same_line if eq["mutant"] == mutant]
    return "equivalent: " + reasons[0] if reasons else None


def mark_skipped(session: Path, config: Config, module: Module) -> None:
    """Skip mutants of unselected operators and the listed equivalent ones, with their reason;
    follows edits of the equivalent list: a newly listed survivor is skipped, a mutant whose
    entry was removed is pending again."""
    source = (ROOT / module.path).read_text()
    unlisted = []
    with use_db(str(session), WorkDB.Mode.open) as db:
        done = [(item, result) for item, result in db.completed_work_items
                if result.test_outcome == TestOutcome.SURVIVED
                or (result.output or "").startswith("equivalent: ")]
        for item in [*db.pending_work_items, *(item for item, _ in done)]:
            reason = skip_reason(config, module, source, item.mutations[0])
            if reason:
                db.set_result(item.job_id, WorkResult(output=reason, worker_outcome=WorkerOutcome.SKIPPED))
        unlisted = [item.job_id for item, result in done
                    if (result.output or "").startswith("equivalent: ")
                    and not skip_reason(config, module, source, item.mutations[0])]
    with sqlite3.connect(session) as db:
        db.executemany("DELETE FROM work_results WHERE job_id = ?", [(j,) for j in unlisted])


def tests_digest(module: Module) -> str:
    """The module's test list and the text of its test files."""
    files = sorted(p for t in module.tests if (p := ROOT / t).is_file())
    listed = json.dumps(module.tests).encode()
    return hashlib.sha256(listed + b"".join(p.read_bytes() for p in files)).hexdigest()


def retest_survivors(session: Path) -> None:
    """The tests changed: the survivors run again, first (killed mutants stay killed)."""
    with sqlite3.connect(session) as db:
        survivors = "SELECT job_id FROM work_results WHERE test_outcome = 'SURVIVED'"
        db.execute(f"CREATE TABLE IF NOT EXISTS retest AS {survivors} LIMIT 0")
        db.execute(f"INSERT INTO retest {survivors}")
        db.execute("DELETE FROM work_results WHERE test_outcome = 'SURVIVED'")


def run_order(session: Path) -> dict[str, int]:
    """job id -> 0 for mutants to test again (they run first); others sort after, by job id."""
    with sqlite3.connect(session) as db:
        has_table = db.execute("SELECT 1 FROM sqlite_master WHERE name = 'retest'").fetchone()
        return dict.fromkeys((r for (r,) in db.execute("SELECT job_id FROM retest")), 0) if has_table else {}


def pytest_command(module: Module, config: Config) -> str:
    return shlex.join([sys.executable, "-m", "pytest", *config.pytest_args, *module.tests])


def prepare(module: Module, config: Config) -> Path:
    """A cosmic-ray session for the module: reused if its fingerprint is unchanged."""
    cr_config, session, digest = session_files(module, config)
    stamp = session.with_suffix(".digest")
    tests_stamp = session.with_suffix(".tests")
    if session.exists() and stamp.exists() and stamp.read_text() == digest:
        if not tests_stamp.exists() or tests_stamp.read_text() != tests_digest(module):
            retest_survivors(session)
    else:
        cr_config.parent.mkdir(parents=True, exist_ok=True)
        session.unlink(missing_ok=True)
        cr_config.write_text(toml.dumps({"cosmic-ray": {  # cosmic-ray's own runner is not used
            "module-path": module.path, "timeout": config.max_timeout, "excluded-modules": [],
            "test-command": pytest_command(module, config), "distributor": {"name": "local"},
        }}))
        subprocess.run([BIN / "cosmic-ray", "init", cr_config, session], cwd=ROOT, check=True)
    with sqlite3.connect(session) as db:  # a run that scored nothing is tried again
        db.execute("DELETE FROM work_results WHERE worker_outcome NOT IN ('NORMAL', 'SKIPPED')")
    mark_skipped(session, config, module)
    stamp.write_text(digest)
    tests_stamp.write_text(tests_digest(module))
    return session


def hold_lock(module: Module) -> None:
    """One run per module: a second would mutate the same file, or fingerprint a live mutant."""
    WORKDIR.mkdir(parents=True, exist_ok=True)
    lock = (WORKDIR / f"{module.name}.lock").open("w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(f"{module.name}: another mutation run holds {lock.name}")
    HELD_LOCKS.append(lock)  # released when this process exits


def run_workers(names: list[str], config: Config, limit: int | None, jobs: int) -> list[str]:
    """A worker process per module, ``jobs`` at a time, at most one writing mutants to disk;
    largest module first. Returns the modules whose worker failed."""
    queue = sorted(names, key=lambda n: -(ROOT / config.modules[n].path).stat().st_size)
    running: dict[str, subprocess.Popen] = {}
    failed = []
    while queue or running:
        for name, proc in list(running.items()):
            if proc.poll() is not None:
                del running[name]
                if proc.returncode:
                    failed.append(name)
        disk_busy = any(config.disk_mutants(n) for n in running)
        startable = [n for n in queue if not (disk_busy and config.disk_mutants(n))]
        if startable and len(running) < jobs:
            name = startable[0]
            queue.remove(name)
            command = [sys.executable, "-m", "scripts.dev.mutation_worker", "--module", name]
            running[name] = subprocess.Popen(command + (["--limit", str(limit)] if limit else []),
                                             cwd=ROOT)
            continue
        time.sleep(0.5)
    return failed


def report(module: Module, session: Path) -> tuple[int, int]:
    """Print the module's score and survivors; return (killed, scored)."""
    lines = (ROOT / module.path).read_text().splitlines()
    killed = scored = pending = 0
    equivalent, survivors, failed, timeouts = [], [], [], []
    with use_db(str(session), WorkDB.Mode.open) as db:
        pending = len(db.pending_work_items)
        for item, result in db.completed_work_items:
            (m,) = item.mutations
            where = f"{module.path}:{m.start_pos[0]} {m.operator_name} #{m.occurrence}"
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                if result.output != NOT_SELECTED:
                    equivalent.append(f"{where}: {result.output}")
                continue
            if result.worker_outcome != WorkerOutcome.NORMAL:  # the mutation itself failed
                failed.append(f"{where}: {result.worker_outcome}")
                continue
            scored += 1
            if result.test_outcome == TestOutcome.SURVIVED:
                survivors.append(f"{where}\n      {lines[m.start_pos[0] - 1].strip()}\n"
                                 + "".join(f"      {d}\n" for d in (result.diff or "").splitlines()
                                           if d[:1] in "+-" and d[:3] not in ("+++", "---")))
            else:
                killed += 1
                if (result.output or "").startswith(TIMED_OUT):
                    timeouts.append(f"{where}: {result.output.splitlines()[0]}")
    score = 100.0 * killed / scored if scored else 0.0
    print(f"{module.name}: {killed}/{scored} killed ({score:.1f}%), {len(equivalent)} equivalent"
          f" skipped, {pending} not run")
    for line in equivalent:
        print(f"  equivalent {line}")
    for line in failed:
        print(f"  not scored (no test run) {line}")
    for line in timeouts:  # killed, but a loaded machine can slow a survivor down this much
        print(f"  killed by timeout {line}")
    for line in survivors:
        print(f"  SURVIVED {line}", end="")
    return killed, scored


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--module", action="append", help="a module name from [tool.mutation.modules]")
    parser.add_argument("--report-only", action="store_true", help="print the last results, run nothing")
    parser.add_argument("--limit", type=int, help="run at most this many mutants per module now"
                        " (a fixed random sample; the next run goes on with the rest)")
    parser.add_argument("--jobs", type=int, default=2, help="modules run at once (default 2)")
    parser.add_argument("--min-score", type=float, default=90.0, help="exit 1 below this %% (default 90)")
    args = parser.parse_args(argv)
    config = load_config()
    names = args.module or list(config.modules)
    unknown = sorted(set(names) - config.modules.keys())
    if unknown:
        parser.error(f"--module: unknown {unknown}; expected one of {sorted(config.modules)}")
    failed = [] if args.report_only else run_workers(names, config, args.limit, args.jobs)
    below = list(failed)
    for name in names:
        session = session_files(config.modules[name], config)[1]
        if name in failed or not session.exists():
            print(f"{name}: {'the worker failed (see above)' if name in failed else 'no session yet'}")
            continue
        killed, scored = report(config.modules[name], session)
        if not scored or 100.0 * killed / scored < args.min_score:
            below.append(name)
    if below:
        print(f"below {args.min_score}%: {', '.join(below)}")
    return 1 if below else 0


if __name__ == "__main__":
    sys.exit(main())
