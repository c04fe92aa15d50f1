"""What a process under mutation testing runs first: a mutant in place of a source file, and a
record of which lines of that file run.

`mutation_worker.py` installs both in each forked test child. Python subprocesses of the tests
(spawned TP ranks, tools run as programs) install them from the environment through a
generated `sitecustomize.py` (its folder is put first on PYTHONPATH), so they import the same
mutant and report their lines too. Standard library only: it runs before anything else.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
from pathlib import Path

ENV_TARGETS = "MUTATION_TARGETS"  # JSON list: the paths under which the mutated file is imported
ENV_MUTANT = "MUTATION_MUTANT"  # a file holding the mutant's source (absent: the file on disk is the mutant)
ENV_LINES = "MUTATION_LINES_DIR"  # where subprocesses write the target lines they ran

SITECUSTOMIZE = f"""\
import importlib.util as _util
_spec = _util.spec_from_file_location("_mutation_hook", {str(Path(__file__).resolve())!r})
_hook = _util.module_from_spec(_spec)
_spec.loader.exec_module(_hook)
_hook.install_from_env()
"""


def spellings(paths: list[str]) -> frozenset[str]:
    """Each path as given and resolved: code objects carry the name they were imported under."""
    return frozenset(paths) | {os.path.realpath(p) for p in paths}


class MutantLoader(importlib.abc.Loader):
    """Executes the mutant's source under the real file's name (tracebacks, __file__)."""

    def __init__(self, source: str, origin: str):
        self.source, self.origin = source, origin

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        exec(compile(self.source, self.origin, "exec", dont_inherit=True), module.__dict__)

    def get_source(self, name: str) -> str:
        return self.source


class MutantFinder(importlib.abc.MetaPathFinder):
    """Any import that would load one of ``targets`` (by any module name) loads the mutant."""

    def __init__(self, targets: frozenset[str], source: str):
        self.targets, self.source = targets, source

    def find_spec(self, name, path, target=None):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.origin is None or os.path.realpath(spec.origin) not in self.targets:
            return spec
        mutant = importlib.machinery.ModuleSpec(name, MutantLoader(self.source, spec.origin),
                                                origin=spec.origin)
        mutant.has_location = True
        return mutant


class LineRecorder:
    """The lines of the target file that run while recording (this thread and new threads)."""

    def __init__(self, targets: frozenset[str]):
        self.targets = targets
        self.lines: set[int] = set()

    def _enter(self, frame, event, arg):
        return self._line if frame.f_code.co_filename in self.targets else None

    def _line(self, frame, event, arg):
        if event == "line":
            self.lines.add(frame.f_lineno)
        return self._line

    def start(self) -> None:
        threading.settrace(self._enter)
        sys.settrace(self._enter)

    def stop(self) -> None:
        sys.settrace(None)
        threading.settrace(None)


def install_mutant(targets: frozenset[str], source: str) -> None:
    sys.meta_path.insert(0, MutantFinder(targets, source))


def install_from_env() -> None:
    """In a subprocess: the mutant and the line record the parent test process asked for."""
    if ENV_TARGETS not in os.environ:
        return
    targets = spellings(json.loads(os.environ[ENV_TARGETS]))
    if os.environ.get(ENV_MUTANT):
        install_mutant(targets, Path(os.environ[ENV_MUTANT]).read_text())
    if os.environ.get(ENV_LINES):
        recorder = LineRecorder(targets)
        out = Path(os.environ[ENV_LINES]) / f"{os.getpid()}.json"
        atexit.register(lambda: out.write_text(json.dumps(sorted(recorder.lines))))
        recorder.start()
