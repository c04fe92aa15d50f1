"""`python -m scripts.bench`: the serving sweep against a running server; writes
bench-results/NAME.{json,md}, NAME-acceptance.png, NAME-decode.png and NAME/levels/ (the
`vllm bench serve` JSON and prompts of every level). Exit 2: bad arguments or server unusable.
"""

from __future__ import annotations

import argparse
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
from .sweep import RESULT_KIND, SweepConfig, int_list, provenance, run_sweep, server_version

DEFAULT_OUT_DIR = recipe.REPO / "bench-results"


def add_sweep_args(ap: argparse.ArgumentParser) -> None:
    """The flags the sweep and the A/B share."""
    d = SweepConfig
    ap.add_argument("--profile", default="cpu-tiny", help="recipe profile of the server: its "
                    "port, served model, tokenizer and roofline (default: %(default)s)")
    ap.add_argument("--tokenizer", help="tokenizer for the prompts (default: the profile's model)")
    ap.add_argument("--content", type=lambda s: tuple(s.split(",")), default=d.contents,
                    help=f"content types, comma-separated (default: {','.join(d.contents)})")
    ap.add_argument("--concurrency", type=int_list, default=d.concurrency, metavar="N,N")
    ap.add_argument("--prompt-lens", type=int_list, default=d.prompt_lens, metavar="N,N")
    ap.add_argument("--output-len", type=int, default=d.output_len)
    ap.add_argument("--rounds", type=int, default=d.rounds, help="requests per level = "
                    "rounds x concurrency (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=d.warmup, help="warm-up requests, excluded")
    ap.add_argument("--endpoint", choices=("completions", "chat"), default=d.endpoint)
    ap.add_argument("--temperature", type=float, help="default: the server's")
    ap.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY") or None,
                    help="bearer token (default: $VLLM_API_KEY)")
    ap.add_argument("--bandwidth-gbs", type=float, default=roofline.GB10_GBS,
                    help="memory bandwidth per GPU for the roofline (default: GB10, %(default)s)")
    ap.add_argument("--config", type=Path, help="the checkpoint's config.json for the roofline")
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    ap.add_argument("--name", help="output stem (default: serving-PROFILE-YYYYmmdd-HHMMSS)")
    ap.add_argument("--note", help="free text kept in the result")


def check_args(args: argparse.Namespace, profile: dict[str, Any]) -> None:
    for kind in args.content:
        content.samples(kind)  # ValueError naming the known types
    if args.output_len < 2 or args.rounds < 1 or args.warmup < 0:
        raise ValueError("--output-len must be >= 2, --rounds >= 1 and --warmup >= 0")
    limit = profile["serving"]["max_model_len"]
    if max(args.prompt_lens) + args.output_len > limit:
        raise ValueError(f"--prompt-lens {max(args.prompt_lens)} + --output-len "
                         f"{args.output_len} exceed the profile's max_model_len {limit}")


def measure(args: argparse.Namespace, base_url: str, profile: dict[str, Any],
            out_dir: Path) -> dict[str, Any]:
    """Run the sweep against `base_url` and return the result (levels with rooflines)."""
    from vllm.tokenizers import get_tokenizer

    tokenizer_ref = args.tokenizer or recipe.model_ref(profile)
    trust = profile["model"]["trust_remote_code"]
    cfg = SweepConfig(
        base_url=base_url, model=profile["model"]["served_name"], tokenizer=tokenizer_ref,
        out_dir=out_dir, contents=args.content, concurrency=args.concurrency,
        prompt_lens=args.prompt_lens, output_len=args.output_len, rounds=args.rounds,
        warmup=args.warmup, endpoint=args.endpoint, temperature=args.temperature,
        api_key=args.api_key, tag=uuid.uuid4().hex[:8],
    )
    levels = run_sweep(cfg, get_tokenizer(tokenizer_ref, trust_remote_code=trust),
                       log=lambda line: print(line, file=sys.stderr, flush=True))
    config, _ = roofline.load_config(profile, args.config)
    model = roofline.build(config, profile)
    for lv in levels:
        spec = lv.get("spec_decode") or {}
        lv["roofline"] = roofline.predict(
            model, args.bandwidth_gbs, lv["concurrency"], lv["prompt_len"] + cfg.output_len // 2,
            spec.get("mean_acceptance_length"))
    return {
        "kind": RESULT_KIND,
        "provenance": provenance(profile["name"], server_version(base_url, args.api_key)),
        "config": {"base_url": base_url, "model": cfg.model, "tokenizer": tokenizer_ref,
                   "contents": list(cfg.contents), "concurrency": list(cfg.concurrency),
                   "prompt_lens": list(cfg.prompt_lens), "output_len": cfg.output_len,
                   "rounds": cfg.rounds, "warmup": cfg.warmup, "endpoint": cfg.endpoint,
                   "temperature": cfg.temperature, "bandwidth_gbs": args.bandwidth_gbs},
        "note": args.note,
        "levels": levels,
    }


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
    ap.add_argument("--base-url", help="server root (default: 127.0.0.1 at the profile's port)")
    add_sweep_args(ap)
    args = ap.parse_args(argv)
    try:
        profile = recipe.load_profile(args.profile)
        check_args(args, profile)
        base_url = (args.base_url or
                    f"http://127.0.0.1:{profile['serving']['port']}").rstrip("/")
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
