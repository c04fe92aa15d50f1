"""`make setup` checks the machine before it installs anything: on another OS, another
architecture, too little disk or memory it stops within a second with one line naming the
shortfall, and creates nothing. The OS and architecture come from a fake `uname` on PATH;
disk and memory from thresholds above what this machine has, judged against os.statvfs and
/proc/meminfo read here."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.paths import REPO

CHECK = REPO / "scripts" / "setup" / "check_host.sh"


def fake_uname(bin_dir: Path, system: str, machine: str) -> dict[str, str]:
    bin_dir.mkdir(exist_ok=True)
    uname = bin_dir / "uname"
    uname.write_text(f'#!/bin/sh\ncase "$1" in -s) echo {system};; -m) echo {machine};; '
                     f'*) exec /bin/uname "$@";; esac\n')
    uname.chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")


def run(cmd: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    return done, time.monotonic() - start


def one_line(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in done.stderr.splitlines() if line.startswith("setup: ")]
    assert done.returncode != 0 and len(lines) == 1, done.stderr
    return lines[0]


@pytest.mark.parametrize(
    "system,machine,expected",
    [
        ("Darwin", "arm64", "setup: needs Linux, this is Darwin"),
        ("Linux", "riscv64", "setup: needs x86_64 (tested) or aarch64 (expected), this is riscv64"),
    ],
)
def test_make_setup_on_an_unsupported_machine_stops_at_once(tmp_path, system, machine, expected):
    venv = tmp_path / "venv"
    done, took = run(["make", "--no-print-directory", "setup", f"VENV={venv}"],
                     fake_uname(tmp_path / "bin", system, machine))
    assert one_line(done).startswith(expected)
    assert took < 1.0 and not venv.exists()


def test_aarch64_passes_with_a_note(tmp_path):
    done, _ = run([str(CHECK), str(tmp_path)], fake_uname(tmp_path / "bin", "Linux", "aarch64"))
    assert done.returncode == 0, done.stderr
    assert "aarch64: expected to work, tested on x86_64 only" in done.stderr


def test_too_little_disk_names_what_is_free(tmp_path):
    st = os.statvfs(tmp_path)
    free_gib = st.f_bavail * st.f_frsize // 2**30
    done, took = run([str(CHECK), str(tmp_path)],
                     dict(os.environ, SETUP_MIN_DISK_GB=str(free_gib + 1000)))
    line = one_line(done)
    assert re.search(rf"needs {free_gib + 1000} GiB free in .*, has (\d+) GiB", line), line
    assert abs(int(re.search(r"has (\d+) GiB", line).group(1)) - free_gib) <= 1
    assert took < 1.0


def test_too_little_memory_names_what_there_is(tmp_path):
    kib = int(re.search(r"^MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text(), re.M).group(1))
    done, _ = run([str(CHECK), str(tmp_path)],
                  dict(os.environ, SETUP_MIN_MEM_GB=str(kib // 2**20 + 1)))
    assert one_line(done) == (f"setup: needs {kib // 2**20 + 1} GiB of memory, has "
                              f"{kib // 2**20} GiB (SETUP_MIN_MEM_GB lowers the bar at your own risk)")


def test_this_machine_passes(tmp_path):
    done, _ = run([str(CHECK), str(tmp_path)],
                  dict(os.environ, SETUP_MIN_DISK_GB="1", SETUP_MIN_MEM_GB="1"))
    assert done.returncode == 0 and not done.stderr, done.stderr
