"""Is the profile's model complete in this node's Hugging Face cache (the container never
downloads)? Resolves the revision through refs/, then checks config, every weight shard of the
index (dangling links count as missing) and unfinished downloads."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .report import Report


def _download_fix(cache_dir: Path, image: str, model: str, revision: str) -> str:
    return (
        f"docker run --rm -u $(id -u):$(id -g) -e HF_HOME=/cache -v {cache_dir}:/cache "
        f"--entrypoint hf {image} download {model} --revision {revision}"
    )


def _snapshot_problems(snap: Path, blobs: Path) -> tuple[list[str], int]:
    """(problems, number of weight shards) of one snapshot folder."""
    if not snap.is_dir():
        return [f"snapshot {snap} is missing"], 0
    problems = [] if (snap / "config.json").is_file() else ["config.json is missing"]
    index = snap / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as exc:
            return [f"model.safetensors.index.json is unreadable ({exc})"], 0
    else:
        shards = sorted(p.name for p in snap.iterdir() if p.name.endswith(".safetensors"))
        if not shards:
            problems.append("no *.safetensors weights")
    missing = [s for s in shards if not (snap / s).is_file()]
    if missing:
        problems.append(f"{len(missing)} of {len(shards)} weight shards missing or dangling "
                        f"(first: {missing[0]})")
    partial = [p for p in blobs.iterdir() if p.name.endswith(".incomplete")] if blobs.is_dir() else []
    if partial:
        problems.append(f"{len(partial)} unfinished downloads (*.incomplete) in {blobs}")
    return problems, len(shards)


def check(
    cache_dir: Path, model: str, revision: str, image: str, container_uid: int, report: Report
) -> None:
    """PASS/WARN/FAIL lines for `model`@`revision` in `cache_dir` (an HF_HOME with hub/)."""
    if not cache_dir.is_dir():
        report.fail("cache", f"MODEL_CACHE_DIR={cache_dir} does not exist",
                    "create it and download the model into it (see README: Two Sparks, step 4)")
        return
    fix = _download_fix(cache_dir, image, model, revision)
    repo = cache_dir / "hub" / f"models--{model.replace('/', '--')}"
    if model.startswith("/"):
        snap = Path(model)
    elif not repo.is_dir():
        report.fail("cache", f"{model} is not in the model cache ({repo} missing)",
                    f"download it on this node: {fix}",
                    f"or copy {repo} from the other node (rsync -a over the fabric link)")
        return
    else:
        ref = repo / "refs" / revision
        commit = revision if len(revision) == 40 and all(c in "0123456789abcdef" for c in revision) \
            else (ref.read_text().strip() if ref.is_file() else "")
        if not commit:
            report.fail("cache", f"{model} has no revision '{revision}' in the cache ({ref} missing)",
                        f"download that revision: {fix}")
            return
        snap = repo / "snapshots" / commit
    problems, n_shards = _snapshot_problems(snap, repo / "blobs")
    if problems:
        report.fail("cache", f"model cache for {model}@{revision} is incomplete: {'; '.join(problems)}",
                    f"finish the download on this node: {fix}")
        return
    report.passed("cache", f"{model}@{revision} in {cache_dir}: {n_shards} weight shards present")
    if revision == "main":
        report.warn("cache", f"the profile serves revision 'main' of {model}: pin a commit hash in "
                    "the profile's model.revision so both nodes and every restart load the same weights")
    owner = cache_dir.stat().st_uid
    if owner != container_uid and not os.access(cache_dir, os.W_OK):
        report.warn("cache", f"{cache_dir} is owned by uid {owner} but the container runs as "
                    f"{container_uid}: set CONTAINER_UID/CONTAINER_GID in docker/.env")
