"""The self-test record: one JSON file per run, and the verdict preflight reads from them.

A record names what was proven where: the image (its ID, or ``none`` outside one), the
device (GPU name and driver, or ``cpu``), the profile and its runner, the tensor-parallel
size, and every check with ``PASS``, ``FAIL`` or ``SKIPPED`` (a skipped check never counts
as passed). Preflight asks ``verdict``: the newest record for this image and GPU decides.

    python -m scripts.selftest.record verdict --dir DIR --image-id ID --gpu NAME
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SCHEMA = 1
STATUSES = ("PASS", "FAIL", "SKIPPED")
REPO = Path(__file__).resolve().parents[2]
DEFAULT_DIR = REPO / ".cache" / "selftest"


def new_record(*, image_id: str, device: dict, profile: str, runner: str, tp: int,
               content_sha256: str) -> dict:
    return {
        "schema": SCHEMA,
        "result": "RUNNING",
        "image_id": image_id or "none",
        "device": device,
        "profile": profile,
        "runner": runner,
        "tensor_parallel_size": tp,
        "content_sha256": content_sha256,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "checks": [],
    }


def add_check(record: dict, name: str, status: str, detail: str) -> None:
    if status not in STATUSES:
        raise ValueError(f"check {name}: status must be one of {STATUSES}, got {status!r}")
    record["checks"].append({"name": name, "status": status, "detail": detail})


def finish(record: dict) -> dict:
    """Set ``result``: PASS when at least one check ran and none failed."""
    statuses = [c["status"] for c in record["checks"]]
    record["result"] = "PASS" if "PASS" in statuses and "FAIL" not in statuses else "FAIL"
    record["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return record


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text).strip("-").lower()[:40] or "none"


def write(record: dict, folder: Path) -> Path:
    """``folder/selftest-<image>-<device>-tp<N>.json``, written whole (temp file + rename)."""
    folder.mkdir(parents=True, exist_ok=True)
    image = _slug(record["image_id"].removeprefix("sha256:")[:12])
    name = f"selftest-{image}-{_slug(record['device']['name'])}-tp{record['tensor_parallel_size']}"
    path = folder / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)
    return path


def load_all(folder: Path) -> list[dict]:
    """Every readable record in ``folder``, newest first (unreadable files are skipped)."""
    records = []
    for path in folder.glob("selftest-*.json"):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and rec.get("schema") == SCHEMA:
            rec["_path"] = str(path)
            records.append(rec)
    return sorted(records, key=lambda r: r.get("finished", ""), reverse=True)


def verdict(folder: Path, image_id: str, gpu: str) -> tuple[bool, str]:
    """(ok, one line): the newest record for ``image_id`` on ``gpu`` must have passed."""
    mine = [r for r in load_all(folder)
            if r.get("image_id") == image_id and r.get("device", {}).get("name") == gpu]
    if not mine:
        return False, f"no self-test record for image {image_id[:19]} on {gpu} in {folder}"
    rec = mine[0]
    failed = [c["name"] for c in rec.get("checks", []) if c.get("status") == "FAIL"]
    skipped = sum(c.get("status") == "SKIPPED" for c in rec.get("checks", []))
    if rec.get("result") != "PASS":
        why = f"checks failed: {', '.join(failed)}" if failed else f"result {rec.get('result')}"
        return False, f"the last self-test of this image on {gpu} FAILED ({why}; {rec['_path']})"
    return True, (f"self-test passed {rec.get('finished', '?')} on {gpu} at TP="
                  f"{rec.get('tensor_parallel_size')} ({skipped} checks skipped; {rec['_path']})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verdict", help="print PASS/FAIL for this image and GPU (exit 0/1)")
    v.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    v.add_argument("--image-id", required=True)
    v.add_argument("--gpu", required=True)
    args = ap.parse_args(argv)
    ok, line = verdict(args.dir, args.image_id, args.gpu)
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
