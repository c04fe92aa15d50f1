"""The client examples (examples/) run as written against the real cpu-tiny server (DSpark on),
then the Grafana dashboard's every series exists on that server's /metrics.

The tiny model's weights are random, so the checks are about structure, judged here and not by
the examples: a tool call whose arguments parse and match the tool's schema, JSON that matches
the response schema, a reasoning field present with thinking on and absent with it off, a
stream that ends with a finish reason. The random model loops on the whitespace JSON allows, so
the Python examples get a frequency penalty through their OPENAI_EXTRA_BODY variable; and it
may write DeepSeek-V4's `<think>` on its own with thinking off (opening a reasoning block the
parser then reports, as it would for any model), so the reasoning example runs with that word
banned: the field then reflects the request's thinking mode alone.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request

import jsonschema
import pytest

from tests.support.paths import REPO

pytest.importorskip("openai")
pytestmark = pytest.mark.e2e

EXAMPLES = REPO / "examples"
DASHBOARD = REPO / "docker" / "monitoring" / "grafana" / "dashboards" / "dspark-vllm.json"
WEATHER_ARGS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {"name": {"enum": ["Paris", "Tokyo", "Lima"]},
                   "continent": {"enum": ["Europe", "Asia", "South America"]},
                   "capital": {"type": "boolean"}},
    "required": ["name", "continent", "capital"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def run_example(cpu_tiny_server):
    env = dict(os.environ, OPENAI_BASE_URL=cpu_tiny_server.base_url + "/v1",
               OPENAI_API_KEY=cpu_tiny_server.api_key, OPENAI_MODEL="tiny-dsv4")

    def run(name: str, **extra_body) -> str:
        path = EXAMPLES / name
        cmd = ["bash", str(path)] if path.suffix == ".sh" else [sys.executable, str(path)]
        body = json.dumps({"frequency_penalty": 1.0, **extra_body})
        done = subprocess.run(cmd, env=dict(env, OPENAI_EXTRA_BODY=body), capture_output=True,
                              text=True, timeout=900)
        assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stderr[-3000:]}"
        return done.stdout

    return run


def labelled(out: str, label: str) -> list[str]:
    return [line[len(label):].strip() for line in out.splitlines() if line.startswith(label)]


def test_curl_lists_the_model_and_completes_a_chat(run_example):
    models_line, chat_line = [line for line in run_example("curl.sh").splitlines() if line][:2]
    assert [m["id"] for m in json.loads(models_line)["data"]] == ["tiny-dsv4"]
    chat = json.loads(chat_line)
    (choice,) = chat["choices"]
    assert choice["finish_reason"] in ("stop", "length") and choice["message"]["content"]
    assert not choice["message"].get("reasoning")  # thinking off
    assert chat["usage"]["completion_tokens"] > 0


def test_streaming_example_streams_to_a_finish_reason(run_example):
    (finish,) = labelled(run_example("stream.py"), "finish_reason:")
    reason, tokens = re.fullmatch(r"(\w+); completion tokens: (\d+)", finish).groups()
    assert reason in ("stop", "length") and int(tokens) > 0


def test_tool_call_example_returns_a_call_matching_the_schema(run_example):
    out = run_example("tool_call.py")
    (call,) = labelled(out, "tool call:")
    name, arguments = call.split(" ", 1)
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER_ARGS)
    assert labelled(out, "finish_reason:") == ["tool_calls"]


def test_reasoning_example_has_reasoning_only_with_thinking_on(run_example):
    out = run_example("reasoning.py", bad_words=["<think>"])
    (on,) = labelled(out, "thinking on:")
    (off,) = labelled(out, "thinking off:")
    assert re.match(r"reasoning [1-9]\d* characters", on), on
    assert off.startswith("reasoning absent"), off


def test_json_schema_example_answers_json_matching_the_schema(run_example):
    (answer,) = labelled(run_example("json_schema.py"), "json:")
    jsonschema.validate(json.loads(answer), CITY)


def _exposed(metrics_text: str) -> list[tuple[str, dict[str, str]]]:
    samples = []
    for line in metrics_text.splitlines():
        if line and not line.startswith("#"):
            m = re.match(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s", line)
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
            samples.append((m.group(1), labels))
    return samples


def _queried(expr: str) -> list[tuple[str, dict[str, str]]]:
    """(series, equality or regex label matchers other than the dashboard's model variable)."""
    found = []
    for name, matchers in re.findall(r"(vllm:[\w:]+)(?:\{([^}]*)\})?", expr):
        wanted = dict(re.findall(r'(\w+)=~?"([^"]*)"', matchers))
        wanted.pop("model_name", None)
        found.append((name, wanted))
    return found


def _chat(server, max_tokens: int) -> None:
    body = json.dumps({"model": "tiny-dsv4", "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "Count to ten."}],
                       "chat_template_kwargs": {"thinking": False}}).encode()
    request = urllib.request.Request(server.base_url + "/v1/chat/completions", data=body,
                                     headers={**server.headers, "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as resp:
        assert json.load(resp)["usage"]["completion_tokens"] > 0


def test_every_series_the_dashboard_queries_is_on_metrics(cpu_tiny_server):
    """After some traffic (DSpark drafts for it), each series and label value a dashboard
    query names has a sample on the server's /metrics."""
    _chat(cpu_tiny_server, 24)
    request = urllib.request.Request(cpu_tiny_server.base_url + "/metrics",
                                     headers=cpu_tiny_server.headers)
    with urllib.request.urlopen(request, timeout=30) as resp:
        exposed = _exposed(resp.read().decode())
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    missing = []
    for name, wanted in {(n, tuple(sorted(w.items()))) for q in queries for n, w in _queried(q)}:
        if not any(n == name and all(re.fullmatch(v, labels.get(k, "")) for k, v in wanted)
                   for n, labels in exposed):
            missing.append(f"{name}{dict(wanted) or ''}")
    assert not missing, f"queried by the dashboard, absent from /metrics: {sorted(missing)}"
    names = {n for n, _ in exposed}
    assert "vllm:dspark_steps_total" in names and "vllm:spec_decode_num_drafts_total" in names
    model_var = next(v for v in dashboard["templating"]["list"] if v["name"] == "model")
    assert "tiny-dsv4" in {labels.get("model_name") for n, labels in exposed
                           if n == "vllm:num_requests_running"}, model_var["definition"]
