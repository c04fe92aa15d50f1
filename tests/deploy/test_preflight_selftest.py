"""Preflight's self-test gate against fake records and a fake image, no Docker engine.

With the overlay's runner (spark-2x) a node may only start once `make selftest` passed on
this GPU for this very image: no record, a failing one, one of another image or another GPU
all FAIL with the two fixes (run the self-test, or serve upstream's DSpark). The upstream
runner needs no record. The records are written by hand here in the documented format.
"""

from __future__ import annotations

import pytest

from tests.deploy.test_preflight import GOOD_IMAGE, IMAGE_ID, MODEL, run_preflight
from tests.support.spark_host import FakeHost, node_env, selftest_record

pytestmark = pytest.mark.timeout(60)
FIXES = ("fix: make selftest", "PROFILE=spark-2x-upstream")


@pytest.fixture
def node(tmp_path):
    host = FakeHost(tmp_path)
    return host, host.model_cache(MODEL), tmp_path / "records"


def gate(host, cache, records, profile="spark-2x", image=GOOD_IMAGE):
    return run_preflight(host, node_env(0, cache, PROFILE=profile), "--only", "gpu,image,selftest",
                         FAKE_IMAGE=image, SELFTEST_DIR=str(records))


def test_a_passing_record_of_this_image_and_gpu_passes(node):
    host, cache, records = node
    selftest_record(records, IMAGE_ID)
    rc, out = gate(host, cache, records)
    assert rc == 0, out
    assert "PASS  selftest self-test passed 2026-12-03T09:00:00Z on NVIDIA GB10" in out
    assert "1 checks skipped" in out


@pytest.mark.parametrize("case, expect", [
    ("none", "no self-test record for image sha256:0123456789ab on NVIDIA GB10"),
    ("failed", "the last self-test of this image on NVIDIA GB10 FAILED (checks failed: greedy_lossless"),
    ("other image", "no self-test record for image"),
    ("other gpu", "no self-test record for image"),
    ("newer failure", "FAILED"),
])
def test_overlay_runner_without_a_passing_record_fails(node, case, expect):
    host, cache, records = node
    records.mkdir()
    if case == "failed":
        selftest_record(records, IMAGE_ID, result="FAIL")
    elif case == "other image":
        selftest_record(records, "sha256:fedcba9876543210fedcba98")
    elif case == "other gpu":
        selftest_record(records, IMAGE_ID, gpu="NVIDIA H100")
    elif case == "newer failure":
        selftest_record(records, IMAGE_ID, finished="2026-12-03T09:00:00Z")
        selftest_record(records, IMAGE_ID, result="FAIL", finished="2026-12-03T10:00:00Z")
    rc, out = gate(host, cache, records)
    assert rc == 1, out
    fail = [ln for ln in out.splitlines() if ln.startswith("FAIL  selftest")]
    assert len(fail) == 1 and expect in fail[0], out
    assert all(fix in out for fix in FIXES), out


def test_upstream_runner_needs_no_record(node):
    host, cache, records = node
    rc, out = gate(host, cache, records, profile="spark-2x-upstream")
    assert rc == 0, out
    assert "PASS  selftest runner upstream: upstream's DSpark needs no self-test record" in out


def test_a_stale_image_fails_before_any_record_is_read(node):
    host, cache, records = node
    selftest_record(records, IMAGE_ID)
    stale = GOOD_IMAGE.rsplit("|", 1)[0] + "|" + "f" * 64
    rc, out = gate(host, cache, records, image=stale)
    assert rc == 1
    assert "built from other overlay/, recipe/ or docker/ files" in out
    assert "make image" in out
    assert "WARN  selftest skipped: the image check did not pass" in out
