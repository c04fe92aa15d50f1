"""`make ab`: the same sweep against two server configurations, one after the other on the same
machine, and one table of B / A ratios per level (each ratio from this run's two sweeps only).

    python -m scripts.bench.ab --profile cpu-tiny            # DSpark vs no speculation
    python -m scripts.bench.ab --profile spark-2x --launch manual \\
        --a overlay:speculative.runner=overlay --b upstream:speculative.runner=upstream

A configuration is NAME:section.key=value,... over the profile. `--launch local` starts
`scripts/serve.py` with the derived profile and stops it after its sweep; `--launch manual`
(the Spark pair) names the shipped profile that equals it and waits until the pair runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from .. import recipe
from . import report
from .__main__ import add_sweep_args, check_args, default_stem, measure, write_outputs

# (column, getter of a level); ratios are B / A.
RATIOS = [
    ("server decode tok/s", lambda lv: lv["server_decode_tok_s"]),
    ("output tok/s", lambda lv: lv["vllm_bench"]["output_throughput"]),
    *((f"{name} {p}", lambda lv, k=f"{p}_{key}_ms": lv["vllm_bench"][k])
      for name, key in (("TTFT", "ttft"), ("ITL", "itl")) for p in ("p50", "p99")),
    ("accept len", lambda lv: (report.acceptance([lv]) or {}).get("mean_acceptance_length")),
]
LEVEL_KEY = ("content", "prompt_len", "concurrency")


def parse_variant(text: str, profile: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """NAME:section.key=value,... -> (NAME, the profile with those keys set, validated)."""
    name, _, overrides = text.partition(":")
    if not name:
        raise ValueError(f"configuration {text!r}: expected NAME:section.key=value,...")
    derived = copy.deepcopy(profile)
    for item in filter(None, overrides.split(",")):
        path, eq, value = item.partition("=")
        section, dot, key = path.partition(".")
        if not (eq and dot) or key not in derived.get(section, {}):
            raise ValueError(f"configuration {name}: {item!r} is not section.key=value of a "
                             "key the profile has")
        derived[section][key] = yaml.safe_load(value)
    derived["name"] = f"{profile['name']}-{name}"
    return name, recipe.validate(derived)


def shipped_profile(derived: dict[str, Any]) -> str | None:
    """The shipped profile equal to `derived` but for name and description (what the image of
    a Spark pair can run by setting PROFILE), if any."""
    def keys(p: dict) -> dict:
        return {k: v for k, v in p.items() if k not in ("name", "description")}
    names = recipe.list_profiles()
    return next((n for n in names if keys(recipe.load_profile(n)) == keys(derived)), None)


def ratio_table(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Per level present in both sweeps: B / A of every RATIOS column (None where either
    side is missing or zero)."""
    index = {tuple(lv[k] for k in LEVEL_KEY): lv for lv in a["levels"]}
    rows = []
    for lv_b in b["levels"]:
        lv_a = index.get(tuple(lv_b[k] for k in LEVEL_KEY))
        if lv_a is not None:
            pairs = [(label, get(lv_a), get(lv_b)) for label, get in RATIOS]
            rows.append({**{k: lv_b[k] for k in LEVEL_KEY}, "ratios": {
                label: vb / va if va and vb is not None else None for label, va, vb in pairs}})
    return rows


def stated_temperature(temperature: float | None, profile: dict[str, Any]) -> str:
    """The requests' sampling temperature in words: ``--temperature``, else the server's
    default, which vLLM takes from the model's generation_config.json (1.0 without one)."""
    if temperature is not None:
        return f"{temperature:g} (--temperature)"
    extra = " ".join(map(str, profile["serving"].get("extra_args") or []))
    if "generation-config" in extra:
        return "the server's default, as serving.extra_args sets it"
    path = Path(recipe.model_ref(profile)) / "generation_config.json"
    if not path.is_file():
        return "the server's default (the model's generation_config.json is not local)"
    value = json.loads(path.read_text()).get("temperature")
    return f"{1.0 if value is None else value:g} (the server's default: {path.name})"


def acceptance_lines(ab: dict[str, Any]) -> list[str]:
    """Acceptance length per content type of each side that speculates."""
    lines = []
    for side in (ab["a"], ab["b"]):
        per_content = report.content_acceptance(side["result"]["levels"])
        if per_content:
            cells = ", ".join(f"{kind} {acc['mean_acceptance_length']:.2f}"
                              for kind, acc in per_content.items())
            lines.append(f"- acceptance length of {side['name']}: {cells}")
    return lines


def speed_by_concurrency(ab: dict[str, Any]) -> dict[int, float]:
    """A / B of server decode tok/s per concurrency: the geometric mean over that
    concurrency's levels (content types x prompt lengths) of each level's A / B."""
    by_c: dict[int, list[float]] = {}
    for row in ab["ratios"]:
        b_over_a = row["ratios"]["server decode tok/s"]
        if b_over_a:
            by_c.setdefault(row["concurrency"], []).append(1.0 / b_over_a)
    return {c: math.exp(statistics.mean(map(math.log, v))) for c, v in sorted(by_c.items())}


def position_lines(ab: dict[str, Any]) -> list[str]:
    """Per draft position, the share of drafts accepted there, per concurrency (speculating
    sides only): the acceptance curve the speed ratio comes from."""
    lines = []
    for side in (ab["a"], ab["b"]):
        levels = side["result"]["levels"]
        for c in sorted({lv["concurrency"] for lv in levels}):
            acc = report.acceptance([lv for lv in levels if lv["concurrency"] == c])
            if acc:
                cells = ", ".join(f"{x:.2f}" for x in acc["per_position"])
                lines.append(f"- {side['name']} c={c}: acceptance length "
                             f"{acc['mean_acceptance_length']:.2f}, per position [{cells}]")
    return lines


def summary_line(ab: dict[str, Any]) -> str:
    """``ab: DSpark/plain c=1 X.XXx, c=4 Y.YYx`` (A / B decode rate per concurrency)."""
    names = ("DSpark", "plain") if (ab["a"]["name"], ab["b"]["name"]) == ("dspark", "no-spec") \
        else (ab["a"]["name"], ab["b"]["name"])
    cells = ", ".join(f"c={c} {x:.2f}x" for c, x in speed_by_concurrency(ab).items())
    return f"ab: {names[0]}/{names[1]} {cells}"


def ab_markdown(ab: dict[str, Any]) -> str:
    a, b = ab["a"], ab["b"]
    p = a["result"]["provenance"]
    lines = [
        f"## A/B: `{b['name']}` / `{a['name']}`, profile `{ab['profile']}`", "",
        *(f"- {side} = {s['name']}: {s['overrides'] or 'the profile as is'}"
          for side, s in (("A", a), ("B", b))),
        f"- temperature: {ab.get('temperature', 'not recorded')}",
        *acceptance_lines(ab),
        *position_lines(ab),
        f"- {b['name']} / {a['name']} decode tok/s is the table's first column; "
        + ", ".join(f"{a['name']} / {b['name']} at c={c}: {x:.2f}x (geometric mean over levels)"
                    for c, x in speed_by_concurrency(ab).items()),
        f"- run one after the other, {p['created_utc']}, commit {p['commit']}"
        f"{' (dirty)' if p['dirty'] else ''}, client machine {p['gpu'] or p['cpu']}, "
        f"vLLM {p['vllm_server'] or p['vllm_client']}", "",
        "| content | prompt | C | " + " | ".join(f"{c} B/A" for c, _ in RATIOS) + " |",
        "|---|---:|---:|" + "---:|" * len(RATIOS),
    ]
    for row in ab["ratios"]:
        cells = ["–" if x is None else f"{x:.2f}" for x in row["ratios"].values()]
        lines.append(f"| {' | '.join(str(row[k]) for k in LEVEL_KEY)} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def wait_healthy(base_url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(base_url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before /health")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base_url}/health did not answer within {timeout_s:.0f}s")
        time.sleep(2)


@contextlib.contextmanager
def local_server(profile_file: Path, port: int, log: Path, timeout_s: float) -> Iterator[str]:
    """`scripts/serve.py` for the derived profile, in its own process group, always stopped."""
    base = f"http://127.0.0.1:{port}"
    with contextlib.suppress(RuntimeError):  # raised when nothing answers: the port is free
        wait_healthy(base, 0)
        raise ValueError(f"a server already answers on port {port}: stop it (or pass --port)")
    cmd = [sys.executable, "-m", "scripts.serve", "--profile",
           str(profile_file), "--", "--port", str(port)]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=recipe.REPO,
                                start_new_session=True, env=dict(os.environ))
    try:
        wait_healthy(base, timeout_s, proc)
        yield base
    finally:
        stop_process_group(proc, grace_s=60)


def stop_process_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM a server's process group; SIGKILL it if it is still there after ``grace_s``."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=grace_s)


def run_variant(args: argparse.Namespace, name: str, profile: dict, stem: Path) -> dict:
    out = stem.with_name(f"{stem.name}-{name}")
    out.mkdir(parents=True, exist_ok=True)
    profile_file = out / "profile.yaml"
    profile_file.write_text(yaml.safe_dump(profile, sort_keys=False))
    print(f"[ab] configuration {name}", file=sys.stderr, flush=True)
    if args.launch == "local":
        port = args.port or profile["serving"]["port"]
        with local_server(profile_file, port, out / "server.log", args.startup_s) as base:
            return measure(args, base, profile, out)
    shipped = shipped_profile(profile)
    where = f"PROFILE={shipped}" if shipped else \
        f"a profile like {profile_file} (add it to recipe/profiles/, rebuild the image)"
    input(f"[ab] restart the server pair with {where} in docker/.env, then press Enter: ")
    base = args.base_url or f"http://127.0.0.1:{profile['serving']['port']}"
    wait_healthy(base, args.startup_s)
    return measure(args, base, profile, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench.ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", default="dspark:", help="configuration A (default: %(default)s)")
    ap.add_argument("--b", default="no-spec:speculative.method=none",
                    help="configuration B (default: %(default)s)")
    ap.add_argument("--launch", choices=("local", "manual"), default="local")
    ap.add_argument("--base-url", help="manual launch: the server root")
    ap.add_argument("--port", type=int, help="local launch: port (default: the profile's)")
    ap.add_argument("--startup-s", type=float, default=900.0, help="wait for /health this long")
    add_sweep_args(ap)
    args = ap.parse_args(argv)
    try:
        profile = recipe.load_profile(args.profile)
        check_args(args, profile)
        variants = [(text, *parse_variant(text, profile)) for text in (args.a, args.b)]
        print(f"[ab] temperature: {stated_temperature(args.temperature, profile)}",
              file=sys.stderr, flush=True)
        stem = default_stem(args, "ab")
        sides = [{"name": name, "overrides": text.partition(":")[2],
                  "result": run_variant(args, name, prof, stem)} for text, name, prof in variants]
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"ab: error: {exc}", file=sys.stderr)
        return 2
    for side in sides:
        write_outputs(side["result"], stem.with_name(f"{stem.name}-{side['name']}"))
    ab = {"kind": "dspark-serving-ab", "profile": args.profile,
          "temperature": stated_temperature(args.temperature, profile),
          "a": sides[0], "b": sides[1],
          "ratios": ratio_table(sides[0]["result"], sides[1]["result"])}
    ab["a_over_b_decode_by_concurrency"] = speed_by_concurrency(ab)
    stem.with_suffix(".json").write_text(json.dumps(ab, indent=2) + "\n", encoding="utf-8")
    stem.with_suffix(".md").write_text(ab_markdown(ab), encoding="utf-8")
    print(ab_markdown(ab))
    print(f"wrote {stem}.json, {stem}.md and the outputs of both sweeps", file=sys.stderr)
    print(summary_line(ab))
    return 0


if __name__ == "__main__":
    sys.exit(main())
