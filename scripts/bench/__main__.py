"""`python -m scripts.bench`: the serving sweep's command line (writes JSON + Markdown [+ PNG]).

Exit codes: 0 done; 1 no request succeeded (or any failed, with --strict); 2 bad arguments,
server unreachable or without /tokenize.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import recipe
from . import provenance
from .report import markdown_report, write_plots
from .schema import outline, validate_result
from .server import BenchError
from .sweep import SweepConfig, run_sweep_async

DEFAULT_OUT_DIR = recipe.REPO / "bench-results"


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _json_obj(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


# (flag, argparse keywords); defaults that are SweepConfig fields are filled in build_parser.
_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--base-url", dict(help="server root, with or without /v1 (default: http://127.0.0.1:PORT "
                        "with the --profile's serving port, else http://127.0.0.1:8000)")),
    ("--model", dict(help="served model name (default: the first one GET /v1/models lists)")),
    ("--endpoint", dict(choices=("completions", "chat"), help="completions sends exact token-id "
                        "prompts; chat sends messages padded through the chat template")),
    ("--concurrency", dict(type=_int_list, metavar="N,N,..",
                           help="concurrent streams per level")),
    ("--prompt-lens", dict(type=_int_list, metavar="N,N,..", help="prompt lengths in tokens, "
                           "exact via /tokenize (default: 256,2048, leaving out those that do "
                           "not fit the server's max_model_len; given lengths that do not fit "
                           "are an error)")),
    ("--output-len", dict(type=int, help="completion tokens per request; EOS is ignored so "
                          "every request generates exactly this many")),
    ("--rounds", dict(type=int, help="requests per level = rounds x concurrency, kept "
                      "`concurrency` in flight")),
    ("--warmup", dict(type=int, help="warm-up requests before the sweep, excluded")),
    ("--seed", dict(type=int, help="seed for filler text and per-request sampling seeds")),
    ("--run-id", dict(help="fixed id in the unique prompt prefixes (default: random, so "
                      "repeated runs stay cold for the prefix cache)")),
    ("--temperature", dict(type=float, help="sampling temperature (0 = greedy)")),
    ("--no-ignore-eos", dict(dest="ignore_eos", action="store_false",
                             help="let requests stop at EOS (output lengths then vary)")),
    ("--no-chunk-usage", dict(dest="chunk_usage", action="store_false", help="do not ask for "
                              "per-chunk usage (stream_options.continuous_usage_stats); per-chunk "
                              "token counts then come from token_ids if the server sends them "
                              "(--extra-body '{\"return_token_ids\": true}'), else ITL is per "
                              "chunk")),
    ("--request-timeout", dict(type=float, help="seconds before one request counts as timed out")),
    ("--ramp-s", dict(type=float, help="stagger the first `concurrency` requests of a level by "
                      "this many seconds each (0 = all at once)")),
    ("--extra-body", dict(type=_json_obj, metavar="JSON", help="JSON merged into every request "
                          "body, e.g. '{\"chat_template_kwargs\": {\"thinking\": false}}'")),
    ("--api-key", dict(default=os.environ.get("VLLM_API_KEY") or None,
                       help="bearer token (default: $VLLM_API_KEY)")),
    ("--profile", dict(help="recipe profile recorded in the result (recipe/profiles/NAME.yaml; "
                       "default: the profile whose served_name matches the server's model)")),
    ("--pins", dict(dest="pins_path", type=Path, help="pins file recorded in the result")),
    ("--note", dict(help="free text stored in the result and shown in the report")),
    ("--out-dir", dict(type=Path, default=DEFAULT_OUT_DIR, help="directory for the outputs")),
    ("--name", dict(help="output file stem (default: serving-PROFILE-YYYYmmdd-HHMMSS)")),
    ("--plot", dict(action="store_true", help="also write STEM-tok_s.png (aggregate tok/s vs "
                    "concurrency) and STEM-ttft.png (TTFT vs prompt length)")),
    ("--progress", dict(action=argparse.BooleanOptionalAction,
                        help="progress bar on stderr (default: on when stderr is a terminal)")),
    ("--strict", dict(action="store_true",
                      help="exit 1 if any request failed (default: only if none succeeded)")),
    ("--schema", dict(action="store_true", help="print the result JSON format and exit")),
]  # fmt: skip


_NO_DEFAULT = ("base_url", "model", "prompt_lens")  # resolved in _config


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m scripts.bench",
        description="Streaming serving benchmark for a vLLM OpenAI-compatible server: "
        "concurrency x prompt-length sweep with TTFT, ITL, decode tok/s and "
        "speculative-decoding acceptance. Writes JSON + Markdown (+ PNG with --plot) "
        "under --out-dir. Run from the repository root.",
        epilog="Examples:\n"
        "  # local CPU tiny server (make serve); the URL comes from the profile's port\n"
        "  python -m scripts.bench --profile cpu-tiny --concurrency 1,2,4 --prompt-lens 64,256 "
        "--output-len 32 --plot\n"
        "  # two Sparks, from any machine that reaches the head\n"
        "  python -m scripts.bench --base-url http://SPARK_HEAD:8000 --profile spark-2x --plot\n"
        "  # then: python -m scripts.bench.compare bench-results/A.json bench-results/B.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = SweepConfig(base_url="")
    for flag, kwargs in _FLAGS:
        field = kwargs.get("dest", flag[2:].replace("-", "_"))
        if "default" not in kwargs and hasattr(defaults, field) and field not in _NO_DEFAULT:
            kwargs = dict(kwargs, default=getattr(defaults, field))
            if kwargs.get("action") is None and kwargs["default"] is not None:
                kwargs["help"] += " (default: %(default)s)"
        ap.add_argument(flag, **kwargs)
    return ap


def _config(args: argparse.Namespace) -> SweepConfig:
    values = {k: v for k, v in vars(args).items() if k in SweepConfig.__dataclass_fields__}
    if args.base_url is None:
        values["base_url"] = (
            provenance.profile_base_url(args.profile) if args.profile else "http://127.0.0.1:8000"
        )
    values["prompt_lens"] = args.prompt_lens or SweepConfig.prompt_lens
    values["fit_prompt_lens"] = args.prompt_lens is None
    values["progress"] = sys.stderr.isatty() if args.progress is None else args.progress
    return SweepConfig(**values)


def write_outputs(result: dict[str, Any], args: argparse.Namespace) -> list[Path]:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    stem = args.out_dir / (args.name or f"serving-{result['recipe']['profile']}-{stamp}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = stem.with_suffix(".json"), stem.with_suffix(".md")
    json_path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    md_path.write_text(markdown_report(result), encoding="utf-8")
    return [json_path, md_path] + (write_plots(result, stem) if args.plot else [])


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.schema:
        print("\n".join(outline()))
        return 0
    try:
        result = asyncio.run(run_sweep_async(_config(args)))
    except (BenchError, recipe.RecipeError) as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        return 130
    validate_result(result)
    written = write_outputs(result, args)
    print(markdown_report(result))
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)

    n_req = sum(r["num_requests"] for r in result["runs"])
    n_ok = sum(r["num_ok"] for r in result["runs"])
    if n_ok == 0:
        print(f"bench: error: all {n_req} requests failed", file=sys.stderr)
        return 1
    if args.strict and n_ok < n_req:
        print(f"bench: error: {n_req - n_ok} of {n_req} requests failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
