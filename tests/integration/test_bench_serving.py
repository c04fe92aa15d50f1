"""The serving sweep on `vllm bench serve`, against a fake OpenAI server in this process.

The fake server streams a fixed number of tokens, requires an API key, and serves two
hand-written /metrics pages: `vllm_metrics_level_before.txt` until the first generation
request arrives, `vllm_metrics_level_after.txt` from then on. Oracles: vLLM's own saved
JSON of the level (our timings must be exactly its numbers), the counter increments written
by hand below (our /metrics deltas), and the requests the server actually received.
"""

from __future__ import annotations

import asyncio
import copy
import json
import socket
import threading

import pytest
from aiohttp import web

from scripts import recipe
from scripts.bench import __main__ as bench_cli
from scripts.bench import ab, content, levels, report
from scripts.node import metrics
from tests.support.tiny import ensure_tiny_model

pytestmark = pytest.mark.timeout(300)

from tests.support.paths import FIXTURES  # noqa: E402

BEFORE = (FIXTURES / "vllm_metrics_level_before.txt").read_text()
AFTER = (FIXTURES / "vllm_metrics_level_after.txt").read_text()
API_KEY = "fake-key-31f"
OUTPUT_LEN = 8

# The after page minus the before page, computed by hand from the two fixtures (ratios of
# small integers: exact in binary floating point after correctly rounded division).
EXPECTED_SPEC = {
    "num_drafts": 40, "num_draft_tokens": 160, "num_accepted_tokens": 80,
    "accepted_per_position": [34, 24, 14, 8], "acceptance_rate": 0.5,
    "mean_acceptance_length": 3.0, "acceptance_per_position": [0.85, 0.6, 0.35, 0.2],
}  # fmt: skip
EXPECTED_DSPARK = {
    "steps": {"flat": 15, "ragged": 25, "packed": 2},
    "context_rows": {"stored": 100, "rejected": 30}, "drafts_discarded": 12,
    "ragged_share": 0.625, "ring_slots_in_use": 3, "ring_slots_total": 8,
}  # fmt: skip
EXPECTED_TOKENS = {"generation": 16, "prompt": 128}


class FakeServer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer  # the served model's: prompt_tokens in the usage chunk
        self.bodies: list[dict] = []
        self.refused: list[str] = []  # paths asked without the key

    def _authorized(self, request: web.Request) -> bool:
        ok = request.headers.get("Authorization") == f"Bearer {API_KEY}"
        if not ok:
            self.refused.append(request.path)
        return ok

    async def metrics(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.Response(status=401)
        return web.Response(text=AFTER if self.bodies else BEFORE)

    async def version(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.Response(status=401)
        return web.json_response({"version": "0.32.0+fake"})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return web.Response(status=401)
        body = await request.json()
        self.bodies.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(body["max_tokens"]):
            await asyncio.sleep(0.002)
            chunk = {"choices": [{"index": 0, "text": f" t{i}"}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        prompt_tokens = len(self.tokenizer(body["prompt"]).input_ids)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": body["max_tokens"]}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture
def tiny_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_tiny_model())


@pytest.fixture
def fake(tiny_tokenizer):
    server = FakeServer(tiny_tokenizer)
    app = web.Application()
    app.router.add_get("/metrics", server.metrics)
    app.router.add_get("/version", server.version)
    app.router.add_get("/health", lambda request: web.Response(text=""))
    app.router.add_post("/v1/completions", server.completions)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.SockSite(runner, sock).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield server
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_sweep_reports_vllm_bench_numbers_and_hand_computed_metric_deltas(fake, tmp_path):
    argv = ["--base-url", fake.url, "--profile", "cpu-tiny", "--api-key", API_KEY,
            "--content", "code", "--concurrency", "2", "--prompt-lens", "64",
            "--output-len", str(OUTPUT_LEN), "--rounds", "1", "--warmup", "0",
            "--out-dir", str(tmp_path), "--name", "t"]
    assert bench_cli.main(argv) == 0
    result = json.loads((tmp_path / "t.json").read_text())
    (level,) = result["levels"]
    theirs = json.loads((tmp_path / "t" / "levels" / "code-p64-c2.json").read_text())
    # every timing and throughput we report is vLLM's, unchanged
    assert level["vllm_bench"] == theirs
    assert (theirs["completed"], theirs["failed"], theirs["max_concurrency"]) == (2, 0, 2)
    assert theirs["total_output_tokens"] == 2 * OUTPUT_LEN
    assert level["spec_decode"] == EXPECTED_SPEC
    assert level["dspark"] == EXPECTED_DSPARK
    assert level["tokens"] == EXPECTED_TOKENS
    assert level["server_decode_tok_s"] == EXPECTED_TOKENS["generation"] / theirs["duration"]
    row = next(line for line in (tmp_path / "t.md").read_text().splitlines()
               if line.startswith("| code | 64 | 2 |"))
    for key in ("p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms", "p50_tpot_ms",
                "output_throughput"):
        assert f"{theirs[key]:.1f}" in row, key
    assert "| 0.500 | 3.00 |" in row
    assert "| code | 40 | 0.500 | 3.00 | 0.85 0.60 0.35 0.20 |" in (tmp_path / "t.md").read_text()
    assert (tmp_path / "t-acceptance.png").stat().st_size > 0
    assert (tmp_path / "t-decode.png").stat().st_size > 0
    # the load the server received: 2 requests of 64 tokens (its tokenizer), EOS ignored
    assert theirs["total_input_tokens"] == 2 * 64
    assert len(fake.bodies) == 2
    assert all(b["max_tokens"] == OUTPUT_LEN and b["ignore_eos"] for b in fake.bodies)
    assert len({b["prompt"].splitlines()[0] for b in fake.bodies}) == 2  # cold prefixes
    # vLLM's client asks /metrics without the key (refused); ours always sends it
    assert fake.refused and set(fake.refused) == {"/metrics"}
    assert result["provenance"]["vllm_server"] == "0.32.0+fake"


def test_prompts_have_the_exact_length_and_end_with_their_sample(tiny_tokenizer, tmp_path):
    tok = tiny_tokenizer
    for kind in content.CONTENT_TYPES:
        for plen in (48, 300):
            path = tmp_path / f"{kind}.jsonl"
            content.write_dataset(path, tok, kind, plen, 4, "x")
            prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines()]
            assert [len(tok(p).input_ids) for p in prompts] == [plen] * 4, (kind, plen)
            own = content.samples(kind)
            assert prompts[1].endswith(own[1 % len(own)][-20:])
            assert prompts[1].startswith(f"[request {kind} x-1]\n")
    with pytest.raises(ValueError, match="content type 'poetry'"):
        content.samples("poetry")
    with pytest.raises(ValueError, match="prompt_len 3"):
        content.exact_prompt(tok, "[request code x-0]\n", "def f(): pass", 3)


@pytest.mark.parametrize("args,message", [
    (["--content", "code", "haiku"], "content type 'haiku'"),
    (["--concurrency", "1", "4", "1"], "--concurrency: 1 4 1 repeats a value"),
    (["--prompt-lens", "2000"], "exceed the profile's max_model_len 2048"),
    (["--base-url", "http://127.0.0.1:9"], "http://127.0.0.1:9/metrics: "),
])
def test_bad_arguments_and_an_unreachable_server_are_clear_errors(args, message, capsys,
                                                                    tmp_path):
    assert bench_cli.main([*args, "--out-dir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing half-written


def test_a_wrong_api_key_is_named_before_anything_runs(fake, capsys, tmp_path):
    argv = ["--base-url", fake.url, "--api-key", "not-the-key", "--out-dir", str(tmp_path)]
    assert bench_cli.main(argv) == 2
    assert "401" in capsys.readouterr().err and fake.bodies == []
    assert not any(tmp_path.iterdir())


def test_content_acceptance_sums_counters_over_levels():
    """Per content type the counters are summed before dividing (not a mean of ratios)."""
    def level(kind, drafts, draft_tokens, accepted, per_pos):
        spec = {"num_drafts": drafts, "num_draft_tokens": draft_tokens,
                "num_accepted_tokens": accepted, "accepted_per_position": per_pos}
        return {"content": kind, "spec_decode": spec}

    levels = [level("code", 10, 40, 30, [9, 8, 7, 6]), level("code", 30, 120, 30, [20, 6, 3, 1]),
              level("prose", 5, 20, 0, [0, 0, 0, 0]), {"content": "json", "spec_decode": None}]
    acc = report.content_acceptance(levels)
    assert list(acc) == ["code", "prose"]
    assert acc["code"]["acceptance_rate"] == 60 / 160
    assert acc["code"]["mean_acceptance_length"] == 1 + 60 / 40
    assert acc["code"]["per_position"] == [29 / 40, 14 / 40, 10 / 40, 7 / 40]
    assert acc["prose"]["mean_acceptance_length"] == 1.0


# ---- /metrics parsing ----------------------------------------------------------------------

# A /metrics page of a two-engine vLLM server with speculative decoding (label orders vary,
# escapes, NaN, exponents, histogram buckets).
VLLM_METRICS_SAMPLE = (FIXTURES / "vllm_metrics_sample.txt").read_text()


def test_parse_vllm_spec_decode_counters():
    c = metrics.spec_decode_counters(VLLM_METRICS_SAMPLE)
    assert c == {
        "num_drafts": 210.0,
        "num_draft_tokens": 1050.0,
        "num_accepted_tokens": 300.0,
        "accepted_per_position": [182.0, 81.0, 29.0, 7.0, 1.0],
    }
    samples = metrics.parse_prometheus(VLLM_METRICS_SAMPLE)
    http = [s for s in samples if s[0] == "http_requests_total"][0]
    assert http[1]["note"] == 'a "quoted" \\ value' and http[2] == 7.0
    assert [s for s in samples if s[0] == "process_start_time_seconds"][0][1] == {}


def test_spec_decode_delta_and_derived_figures():
    before = metrics.spec_decode_counters(VLLM_METRICS_SAMPLE)
    after = copy.deepcopy(before)
    after["num_drafts"] += 100
    after["num_draft_tokens"] += 500
    after["num_accepted_tokens"] += 180
    after["accepted_per_position"] = [
        a + d for a, d in zip(before["accepted_per_position"], [80, 50, 30, 15, 5], strict=True)
    ]
    d = metrics.spec_decode_delta(before, after)
    assert d["num_drafts"] == 100 and d["num_draft_tokens"] == 500
    assert d["num_accepted_tokens"] == 180
    assert d["accepted_per_position"] == [80, 50, 30, 15, 5]
    assert d["acceptance_rate"] == pytest.approx(0.36)
    assert d["mean_acceptance_length"] == pytest.approx(2.8)
    assert d["acceptance_per_position"] == pytest.approx([0.8, 0.5, 0.3, 0.15, 0.05])
    idle = metrics.spec_decode_delta(before, before)
    assert idle["num_drafts"] == 0 and idle["mean_acceptance_length"] is None
    assert idle["acceptance_per_position"] is None
    assert metrics.spec_decode_counters("# nothing\nvllm:num_requests_running 1\n") is None
    with pytest.raises(ValueError, match="backwards"):
        metrics.spec_decode_delta(after, before)


def test_level_deltas_of_the_fixture_pages_and_a_restarted_server():
    deltas, problems = levels.level_deltas(levels.read_level_snapshot(BEFORE),
                                               levels.read_level_snapshot(AFTER))
    assert problems == []
    assert deltas["spec_decode"] == EXPECTED_SPEC
    assert deltas["dspark"] == EXPECTED_DSPARK
    assert deltas["tokens"] == EXPECTED_TOKENS
    backwards, problems = levels.level_deltas(levels.read_level_snapshot(AFTER),
                                                  levels.read_level_snapshot(BEFORE))
    assert backwards == {"spec_decode": None, "dspark": None, "tokens": None}
    assert len(problems) == 3 and all("backwards" in p for p in problems)
    none, _ = levels.level_deltas(levels.read_level_snapshot("up 1\n"),
                                      levels.read_level_snapshot("up 1\n"))
    assert none == {"spec_decode": None, "dspark": None, "tokens": None}


def test_malformed_metrics_line_is_named():
    with pytest.raises(ValueError, match="line 2"):
        metrics.parse_prometheus("ok_metric 1\nthis is not a sample\n")


# ---- make ab ---------------------------------------------------------------------------


def test_ab_configuration_sets_profile_keys_and_names_bad_ones():
    profile = recipe.load_profile("cpu-tiny")
    name, derived = ab.parse_variant("no-spec:speculative.method=none", profile)
    assert name == "no-spec" and derived["speculative"]["method"] == "none"
    assert derived["name"] == "cpu-tiny-no-spec"
    assert profile["speculative"]["method"] == "dspark"  # the base profile is left alone
    assert "--speculative-config" not in recipe.serve_argv(derived)
    assert ab.parse_variant("dspark:", profile)[1]["speculative"] == profile["speculative"]
    with pytest.raises(ValueError, match="'speculative.metod=none'"):
        ab.parse_variant("x:speculative.metod=none", profile)
    with pytest.raises(ValueError, match="speculative.method"):
        ab.parse_variant("x:speculative.method=eagle", profile)
    with pytest.raises(ValueError, match="NAME:section.key=value"):
        ab.parse_variant(":speculative.method=none", profile)


def test_the_spark_runner_ab_has_a_shipped_profile_on_each_side():
    """spark-2x-upstream.yaml is spark-2x.yaml with speculative.runner=upstream and the
    concurrency FlashInfer's 64 decode rows allow without the overlay's row budget."""
    spark = recipe.load_profile("spark-2x")
    for text, shipped in (("overlay:speculative.runner=overlay", "spark-2x"),
                          ("upstream:speculative.runner=upstream,serving.max_num_seqs=10",
                           "spark-2x-upstream")):
        assert ab.shipped_profile(ab.parse_variant(text, spark)[1]) == shipped
    assert ab.shipped_profile(ab.parse_variant("k3:speculative.num_speculative_tokens=3",
                                               spark)[1]) is None


def _ab_level(kind, conc, decode, ttft50, accepted):
    bench = {"output_throughput": decode, "p50_ttft_ms": ttft50, "p99_ttft_ms": 2 * ttft50,
             "p50_itl_ms": 10.0, "p99_itl_ms": 20.0}
    spec = {"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": accepted,
            "accepted_per_position": [accepted, 0, 0, 0]} if accepted is not None else None
    return {"content": kind, "prompt_len": 64, "concurrency": conc, "vllm_bench": bench,
            "server_decode_tok_s": decode, "spec_decode": spec}


def test_ab_ratios_pair_each_level_with_the_same_level_of_the_other_run():
    a = {"levels": [_ab_level("code", 1, 40.0, 50.0, 10), _ab_level("code", 4, 80.0, 60.0, 20),
                    _ab_level("math", 1, 30.0, 40.0, 5)]}
    b = {"levels": [_ab_level("code", 4, 100.0, 30.0, None),
                    _ab_level("code", 1, 20.0, 100.0, None)]}
    rows = ab.ratio_table(a, b)
    assert [(r["content"], r["concurrency"]) for r in rows] == [("code", 4), ("code", 1)]
    assert rows[0]["ratios"]["server decode tok/s"] == 100.0 / 80.0
    assert rows[0]["ratios"]["TTFT p99"] == 60.0 / 120.0
    assert rows[1]["ratios"]["output tok/s"] == 20.0 / 40.0
    assert rows[1]["ratios"]["accept len"] is None  # B ran without speculation
    assert ab.ratio_table(b, a)[0]["ratios"]["accept len"] is None


def test_ab_refuses_a_port_where_a_server_already_answers(fake, tmp_path):
    port = int(fake.url.rsplit(":", 1)[1])
    with pytest.raises(ValueError, match=f"already answers on port {port}"):
        with ab.local_server(tmp_path / "profile.yaml", port, tmp_path / "log", 5):
            pass
    assert not (tmp_path / "log").exists()  # nothing was started
