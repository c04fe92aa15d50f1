"""`make selftest`: the overlay's DSpark proves itself on this node's device before it serves.

Loads the shape-true tiny DeepSeek-V4-Flash-DSpark checkpoint (``scripts/tiny/shape_true.py``:
every layer at the published shapes and formats, few layers) with the profile's serving
settings, then checks on the device: greedy output lossless by teacher forcing against the
plain target on a batch mixing prefill chunks and verify rows, drafts accepted (acceptance
length above 1.5), sampled requests complete and a seeded one reproduces, and the plain and
DSpark step times. The CUDA-only checks (draft-block CUDA graph replay, no device-to-host
read under CUDA's sync debug mode, NCCL at TP=2) are SKIPPED elsewhere, never passed. The
JSON record it writes is what preflight reads before `make up`.

    python -m scripts.selftest [--profile NAME] [--tp 2] [--record-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

from scripts import recipe
from scripts.node.content_hash import content_hash
from scripts.selftest import checks, cuda_checks, device, record
from scripts.selftest.engines import engine_kwargs, kernels
from scripts.verify.plain_target import ENGINE_ENV_DEFAULTS

REPO = Path(__file__).resolve().parents[2]
# The published per-layer shapes on a GPU; on a CPU the same layers and formats at the CPU
# tiny's sizes (a forward at the published shapes takes about a minute on 2 CPU cores).
MODELS = {
    "cuda": (REPO / "models" / "tiny-dsv4-dspark-shape-true", "published"),
    "cpu": (REPO / "models" / "tiny-dsv4-dspark-shape-true-cpu", "cpu"),
}
STEPS = 8


def progress(i: int, text: str) -> None:
    print(f"[{i}/{STEPS}] {text}", flush=True)


def ensure_model(path: Path, size: str) -> Path:
    if not (path / "config.json").exists():
        from scripts.tiny import shape_true

        print(f"      generating the shape-true tiny checkpoint ({size} sizes): {path}", flush=True)
        shape_true.main(["--out", str(path), "--size", size, "--force", "--quiet"])
    return path


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=None,
                    help="recipe profile (default: spark-2x on CUDA, cpu-2x on CPU)")
    ap.add_argument("--tp", type=int, default=1, choices=(1, 2),
                    help="tensor-parallel size (2: both ranks; PAIR=1 in make)")
    ap.add_argument("--model", type=Path, default=None,
                    help="checkpoint (default: the shape-true tiny for this device)")
    ap.add_argument("--record-dir", type=Path, default=record.DEFAULT_DIR)
    return ap.parse_args(argv)


def run(args, rec: dict, dev: dict, profile: dict) -> dict:
    """Every check in order, recorded as it finishes; returns the measurements."""
    from scripts.verify.engine import make_engine
    from scripts.verify.plain_target import PlainTarget

    def note(name, status, detail):
        record.add_check(rec, name, status, detail)
        print(f"      {status:7} {name}: {detail}", flush=True)

    facts: dict = {}
    progress(2, f"loading the checkpoint with profile {profile['name']} (TP={args.tp}): "
                "plain target (child process) and DSpark engine")
    target_kwargs = engine_kwargs(profile, args.model, args.tp, speculative=False)
    spec_kwargs = {**engine_kwargs(profile, args.model, args.tp, speculative=True),
                   "disable_log_stats": False}
    t0 = time.monotonic()
    with PlainTarget(target_kwargs) as target:
        engine = make_engine(spec_kwargs)
        vocab = engine.vllm_config.model_config.get_vocab_size()
        used = engine.collective_rpc(lambda w: kernels(w.model_runner.drafter.model))[0]
        note("load", "PASS", f"{time.monotonic() - t0:.0f}s; draft kernels: FP8 "
             f"{', '.join(used['fp8_linear'])}, MoE {', '.join(used['moe_experts'])}")

        progress(3, "greedy batch mixing prefill chunks and verify rows, teacher-forced")
        status, detail, greedy = checks.greedy_lossless(engine, target, vocab)
        note("greedy_lossless", status, detail)
        facts.update(greedy)

        progress(4, "acceptance of the drafts")
        note("acceptance", *checks.acceptance_check(greedy["acceptance_length"],
                                                    greedy["drafting_steps"]))

        progress(5, "sampled requests; a seeded one twice")
        note("sampled_seeded", *checks.sampled(engine, vocab))

        progress(6, "plain and DSpark step times")
        plain_ms, dspark_ms, per_step = checks.step_times(engine, target, vocab)
        facts.update(plain_step_ms=plain_ms, dspark_step_ms=dspark_ms,
                     tokens_per_dspark_step=per_step)
        note("step_times", "PASS", f"plain decode step {plain_ms:.1f} ms, DSpark step "
             f"{dspark_ms:.1f} ms ({per_step:.2f} tokens per step, batch {checks.DECODE_BATCH})")

        progress(7, "CUDA-only checks")
        kind = dev["kind"]
        note("cuda_graph_replay", *(checks.cuda_only("cuda_graph_replay", kind)
                                    or cuda_checks.graph_replay(engine)))
        note("no_host_read_sync_debug", *(
            checks.cuda_only("no_host_read_sync_debug", kind)
            or cuda_checks.no_host_read(engine, lambda: checks.mixed_batch(engine, vocab))))
    nccl = checks.cuda_only("nccl_tp2", kind) or (
        ("SKIPPED", "nccl_tp2: run with PAIR=1") if args.tp == 1 else None)
    if nccl is None:
        nccl = ("PASS", "TP=2 over NCCL served every check above")
    note("nccl_tp2", *nccl)
    return facts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for key, value in ENGINE_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    t0 = time.monotonic()
    dev = device.describe()
    name = args.profile or ("spark-2x" if dev["kind"] == "cuda" else "cpu-2x")
    profile = recipe.load_profile(name)
    if (profile["device"] == "cuda") != (dev["kind"] == "cuda"):
        print(f"selftest: profile {name} is for device {profile['device']}, this node has "
              f"{dev['kind']}: pick another profile (--profile / PROFILE=)", file=sys.stderr)
        return 2
    os.environ.update(recipe.vllm_env(profile))
    if args.tp > 1:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    rec = record.new_record(
        image_id=os.environ.get("DSPARK_IMAGE_ID", "none"), device=dev, profile=name,
        runner=profile["speculative"]["runner"], tp=args.tp, content_sha256=content_hash(),
    )
    progress(1, f"device {dev['name']} (driver {dev['driver']}); shape-true tiny checkpoint")
    default, size = MODELS[dev["kind"]]
    args.model = ensure_model(args.model or default, size)
    facts: dict = {}
    try:
        facts = run(args, rec, dev, profile)
    except Exception:
        record.add_check(rec, "engine", "FAIL", traceback.format_exc()[-2000:])
        traceback.print_exc()
    rec.update(facts)
    rec["seconds"] = round(time.monotonic() - t0, 1)
    record.finish(rec)
    progress(8, "writing the record")
    path = record.write(rec, args.record_dir)
    passed = sum(c["status"] == "PASS" for c in rec["checks"])
    skipped = sum(c["status"] == "SKIPPED" for c in rec["checks"])
    failed = [c["name"] for c in rec["checks"] if c["status"] == "FAIL"]
    if failed:
        print(f"selftest: FAIL {', '.join(failed)}; {passed} checks passed, {skipped} skipped "
              f"(record: {path})")
        return 1
    print(f"selftest: PASS acceptance length {facts['acceptance_length']:.2f}, worst deficit "
          f"{facts['worst_deficit']:.3f} nats, {passed} checks passed, {skipped} skipped "
          f"(record: {path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
