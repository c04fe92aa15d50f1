"""``scripts/dev/gpu_check.py --device cpu``: the pure-torch step runs with torch alone.

The script loads the overlay's pure-torch modules from ``overlay/`` and must never import
the ``vllm`` package (GPU boxes that run it have torch only). On CPU the CUDA-only checks
(sync debug mode, graph capture) are reported as skipped, every other check must pass.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.paths import REPO

RUN = """
import sys
from scripts.dev import gpu_check
assert "vllm" not in sys.modules, "gpu_check imported the vllm package"
sys.exit(gpu_check.main(["--device", "cpu", "--out", {out!r}]))
"""


def test_gpu_check_on_cpu_passes_without_vllm(tmp_path):
    out = tmp_path / "gpu_check.json"
    code = RUN.format(out=str(out))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    checks = report["checks"]
    assert report["passed"] and report["failed"] == []
    for name in ("store_flat", "store_ragged", "packed_ingest_tp1", "markov_greedy"):
        assert checks[name]["passed"] is True, name
    assert checks["store_flat"]["path"] == "flat" and checks["store_ragged"]["path"] == "ragged"
    for name in ("sync_free", "graph_replay"):
        assert checks[name]["passed"] is None and "CUDA" in checks[name]["skipped"]
