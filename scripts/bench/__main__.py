"""`python -m scripts.bench`: the serving sweep against a running server; writes
bench-results/NAME.{json,md}, NAME-acceptance.png, NAME-decode.png and NAME/levels/ (the
`vllm bench serve` JSON, prompts and log of every level). Exit 2: bad arguments or server.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import urllib.error
import uuid
from pathlib import Path
from typing import Any

from .. import recipe
from . import content, roofline
from .report import markdown, write_plots
from .sweep import RESULT_KIND, SweepConfig, provenance, run_sweep, scrape


def add_sweep_args(ap: argparse.ArgumentParser) -> None:
    """The flags the sweep and the A/B share (defaults: SweepConfig's)."""
    d, add = SweepConfig, ap.add_argument
    add("--profile", default="cpu-tiny", help="recipe profile of the server: port, served "
        "model, tokenizer, roofline (default: %(default)s)")
    add("--tokenizer", help="tokenizer for the prompts (default: the profile's model)")
    add("--content", dest="contents", nargs="+", default=d.contents,
        help=f"content types (default: {' '.join(d.contents)})")
    add("--concurrency", type=int, nargs="+", default=d.concurrency)
    add("--prompt-lens", type=int, nargs="+", default=d.prompt_lens)
    add("--output-len", type=int, default=d.output_len)
    add("--rounds", type=int, default=d.rounds, help="requests per level = rounds x concurrency")
    add("--warmup", type=int, default=d.warmup, help="warm-up requests, in no level")
    add("--endpoint", choices=("completions", "chat"), default=d.endpoint)
    add("--temperature", type=float, help="default: the server's")
    add("--api-key", default=os.environ.get("VLLM_API_KEY") or None,
        help="bearer token (default: $VLLM_API_KEY)")
    add("--bandwidth-gbs", type=float, default=roofline.GB10_GBS,
        help="memory bandwidth per GPU for the roofline (default: GB10, %(default)s)")
    add("--config", type=Path, help="the checkpoint's config.json for the roofline")
    add("--out-dir", type=Path, default=recipe.REPO / "bench-results")
    add("--name", help="output stem (default: serving-PROFILE-YYYYmmdd-HHMMSS)")
    add("--note", help="free text kept in the result")


def check_args(args: argparse.Namespace, profile: dict[str, Any]) -> None:
    for kind in args.contents:
        content.samples(kind)  # ValueError naming the known types
    if min(*args.concurrency, *args.prompt_lens) < 1 or args.output_len < 2 or args.rounds < 1 \
            or args.warmup < 0:
        raise ValueError("--concurrency and --prompt-lens must be >= 1, --output-len >= 2, "
                         "--rounds >= 1 and --warmup >= 0")
    for flag, values in (("--content", args.contents), ("--concurrency", args.concurrency),
                         ("--prompt-lens", args.prompt_lens)):
        if len(set(values)) < len(values):
            raise ValueError(f"{flag}: {' '.join(map(str, values))} repeats a value")
    limit = profile["serving"]["max_model_len"]
    if max(args.prompt_lens) + args.output_len > limit:
        raise ValueError(f"--prompt-lens {max(args.prompt_lens)} + --output-len "
                         f"{args.output_len} exceed the profile's max_model_len {limit}")


def measure(args: argparse.Namespace, base_url: str, profile: dict[str, Any],
            out_dir: Path) -> dict[str, Any]:
    """Run the sweep against `base_url`; the result, a roofline beside every level."""
    from vllm.tokenizers import get_tokenizer

    try:  # before anything is written: a server that is down or wants another key
        scrape(base_url, args.api_key)
    except OSError as exc:
        raise ValueError(f"{base_url}/metrics: {exc} (is the server up, and the API key "
                         "its key?)") from exc
    fields = {f.name for f in dataclasses.fields(SweepConfig)}
    cfg = SweepConfig(**{**{k: v for k, v in vars(args).items() if k in fields},
                         "base_url": base_url, "model": profile["model"]["served_name"],
                         "tokenizer": args.tokenizer or recipe.model_ref(profile),
                         "out_dir": out_dir, "tag": uuid.uuid4().hex[:8]})
    model = roofline.build(roofline.load_config(profile, args.config)[0], profile)
    trust = profile["model"]["trust_remote_code"]
    tokenizer = get_tokenizer(cfg.tokenizer, trust_remote_code=trust)
    levels = run_sweep(cfg, tokenizer, log=lambda line: print(line, file=sys.stderr, flush=True))
    for lv in levels:  # context: the prompt and half the output, the mean over a request
        lv["roofline"] = roofline.predict(
            model, args.bandwidth_gbs, lv["concurrency"], lv["prompt_len"] + cfg.output_len // 2,
            (lv["spec_decode"] or {}).get("mean_acceptance_length"))
    config = {k: v for k, v in dataclasses.asdict(cfg).items()
              if k not in ("api_key", "out_dir", "tag")}
    return {"kind": RESULT_KIND, "provenance": provenance(profile, base_url, args.api_key),
            "config": {**config, "bandwidth_gbs": args.bandwidth_gbs}, "note": args.note,
            "levels": levels}


def write_outputs(result: dict[str, Any], stem: Path) -> list[Path]:
    stem.parent.mkdir(parents=True, exist_ok=True)
    js, md = stem.with_suffix(".json"), stem.with_suffix(".md")
    js.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    md.write_text(markdown(result), encoding="utf-8")
    return [js, md, *write_plots(result, stem)]


def default_stem(args: argparse.Namespace, kind: str) -> Path:
    name = args.name or f"{kind}-{args.profile}-{time.strftime('%Y%m%d-%H%M%S')}"
    return args.out_dir / name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench", description=__doc__)
    ap.add_argument("--base-url", help="server root (default: --host at the profile's port)")
    ap.add_argument("--host", default="127.0.0.1", help="server address (default: %(default)s)")
    add_sweep_args(ap)
    args = ap.parse_args(argv)
    try:
        profile = recipe.load_profile(args.profile)
        check_args(args, profile)
        base_url = (args.base_url or
                    f"http://{args.host}:{profile['serving']['port']}").rstrip("/")
        stem = default_stem(args, "serving")
        result = measure(args, base_url, profile, stem)
    except (ValueError, recipe.RecipeError, urllib.error.URLError, OSError) as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 2
    written = write_outputs(result, stem)
    print(markdown(result))
    print("wrote " + ", ".join(map(str, written)), file=sys.stderr)
    return 0 if all(lv["vllm_bench"]["failed"] == 0 for lv in result["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
