"""DeepSeek-V4's chat features on the real cpu-tiny server (DSpark on), as OpenAI clients use them.

One shared server (the session fixture ``cpu_tiny_server``) answers every test: forced tool calls
(``tool_choice`` required and named, streamed and not, greedy and sampled) whose arguments parse
and match the tool's JSON schema; a tool-result turn that goes through vLLM's DeepSeek-V4 encoder
exactly as DeepSeek's reference encoding spells it; reasoning split from content by the
thinking mode; cached prompt tokens in usage; the requests vLLM refuses under speculation; and
greedy decoding under a grammar judged token by token against the target's best allowed token.

The tiny model's weights are random: it never closes its reasoning by itself, so requests that
need content or a tool call after thinking either turn thinking off or give a
``thinking_token_budget`` (vLLM then forces ``</think>``); and it would loop on the whitespace
the DSML grammar allows between parameters, so tool-call requests carry a frequency penalty.
"""

from __future__ import annotations

import json
import urllib.request
import uuid

import jsonschema
import pytest

from scripts.node.metrics import spec_decode_counters
from scripts.verify.teacher_forcing import EPSILON_NATS
from tests.support import grammar_oracle as grammar
from tests.support.paths import REPO

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.e2e

MODEL_DIR = REPO / "models" / "tiny-dsv4-dspark"
MODEL = "tiny-dsv4"
NO_THINKING = {"chat_template_kwargs": {"thinking": False}}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "unit": {"type": "string", "enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
# Keys in the order vLLM's request model keeps them (it renders the tools to the model that way).
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast.",
                                      "parameters": WEATHER, "strict": True}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time.",
                                      "parameters": {
                                          "type": "object",
                                          "properties": {"city": WEATHER["properties"]["city"]},
                                          "required": ["city"], "additionalProperties": False},
                                      "strict": True}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next three days?"}]
# Enough for the tiny tokenizer's spelled-out DSML tags around three parameters.
TOOL_MAX_TOKENS = 480
TOOL_PENALTY = {"frequency_penalty": 1.0}


@pytest.fixture(scope="module")
def server(cpu_tiny_server):
    return cpu_tiny_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, timeout=600,
                         max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


@pytest.fixture(scope="module", autouse=True)
def spec_before(server):
    """The server's spec-decode counters before this module's first request."""
    return spec_decode_counters(_get(server, "/metrics"))


def _get(server, path: str) -> str:
    req = urllib.request.Request(server.base_url + path, headers=server.headers)
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.read().decode()


def _post(server, path: str, body: dict) -> dict:
    req = urllib.request.Request(server.base_url + path, data=json.dumps(body).encode(),
                                 headers={**server.headers, "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def _forced_call(client, tool_choice, stream: bool, temperature: float, **extra):
    """(calls as [(name, arguments)], finish_reason, content, reasoning) of one request."""
    # Sampled requests are seeded (reproducible across runs, multi-chunk prompt included) and
    # make one call, so they end within TOOL_MAX_TOKENS.
    args = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                max_tokens=TOOL_MAX_TOKENS, temperature=temperature, seed=20261203,
                parallel_tool_calls=temperature == 0, **TOOL_PENALTY)
    body = {**NO_THINKING, **extra}
    if not stream:
        choice = client.chat.completions.create(**args, extra_body=body).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        reasoning = getattr(choice.message, "reasoning", None)
        return calls, choice.finish_reason, choice.message.content, reasoning
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    content, reasoning, finish = "", "", None
    for chunk in client.chat.completions.create(**args, stream=True, extra_body=body):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning", None) or ""
        for call in delta.tool_calls or []:
            if call.function and call.function.name:
                names[call.index] = names.get(call.index, "") + call.function.name
            if call.function and call.function.arguments:
                arguments[call.index] = arguments.get(call.index, "") + call.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    calls = [(names[i], arguments.get(i, "")) for i in sorted(names)]
    return calls, finish, content, reasoning


def _check_calls(calls, allowed: set[str]) -> list[dict]:
    """Every call names an allowed tool and its arguments are JSON its schema accepts."""
    assert calls, "no tool call"
    parsed = []
    for name, arguments in calls:
        assert name in allowed, name
        value = json.loads(arguments)
        jsonschema.validate(value, SCHEMAS[name])
        parsed.append(value)
    return parsed


NAMED = {"type": "function", "function": {"name": "get_weather"}}
FORCED = [  # each of choice / stream / sampling appears both ways
    ("required", False, 0.0),
    ("named", True, 0.0),
    ("required", True, 0.7),
    ("named", False, 0.7),
]


@pytest.mark.parametrize("choice,stream,temperature", FORCED,
                         ids=[f"{c}-{'stream' if s else 'whole'}-{'greedy' if t == 0 else 'sampled'}"
                              for c, s, t in FORCED])
def test_forced_tool_call_parses_and_matches_the_schema(client, choice, stream, temperature):
    tool_choice = NAMED if choice == "named" else "required"
    calls, finish, content, _ = _forced_call(client, tool_choice, stream, temperature)
    _check_calls(calls, {"get_weather"} if choice == "named" else set(SCHEMAS))
    # As OpenAI answers: a named choice is the caller's, so the turn just stops.
    assert finish == ("stop" if choice == "named" else "tool_calls")
    assert "DSML" not in (content or "")  # the call markup never leaks into content


def test_thinking_then_a_forced_tool_call(client):
    """Thinking on: the reasoning (ended by the budget) comes apart, then the forced call."""
    calls, finish, content, reasoning = _forced_call(
        client, "required", False, 0.0, chat_template_kwargs={}, thinking_token_budget=4)
    _check_calls(calls, set(SCHEMAS))
    assert finish == "tool_calls" and reasoning and "DSML" not in reasoning + (content or "")


def test_tool_result_turn_round_trips_through_the_deepseek_v4_encoder(server, client, tokenizer):
    """Oracle: DeepSeek's reference encoding of the same conversation (vLLM's copy of
    encoding_dsv4.py, tools on the system message, chat mode), tokenized locally. The server's
    prompt must be exactly those tokens, and it must spell the call and its result in DSML."""
    from vllm.tokenizers.deepseek_v4_encoding import encode_messages

    calls, _, _, _ = _forced_call(client, NAMED, False, 0.0)
    (name, arguments), = calls
    args = _check_calls(calls, {"get_weather"})[0]
    result = json.dumps({"forecast": ["sun", "rain", "sun"], "unit": args["unit"]})
    turn = [*ASK,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_0", "type": "function",
                 "function": {"name": name, "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_0", "content": result}]
    reply = _post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": turn, "tools": TOOLS, "max_tokens": 4, "temperature": 0,
        "return_token_ids": True, **NO_THINKING})
    reference = encode_messages([{"role": "system", "tools": TOOLS}, *turn],
                                thinking_mode="chat", drop_thinking=True, reasoning_effort=None)
    expected = tokenizer.encode(reference, add_special_tokens=False)
    assert reply["prompt_token_ids"] == expected
    assert reply["usage"]["prompt_tokens"] == len(expected)
    prompt = tokenizer.decode(expected)
    assert f'<｜DSML｜invoke name="{name}">' in prompt
    for key, value in args.items():
        text = value if isinstance(value, str) else json.dumps(value)
        string = "true" if isinstance(value, str) else "false"
        assert f'<｜DSML｜parameter name="{key}" string="{string}">{text}</｜DSML｜parameter>' in prompt
    assert f"<tool_result>{result}</tool_result>" in prompt
    assert prompt.endswith("<｜Assistant｜></think>")


def _split(token_ids: list[int], thinking: bool, tokenizer, finished: bool) -> tuple[str, str]:
    """(reasoning, content) by DeepSeek-V4's format: <think> opens reasoning, </think> closes it;
    thinking mode starts inside it. The stop token is not text, and neither is a character cut
    by max_tokens (the detokenizer holds back incomplete UTF-8)."""
    start, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>"))
    if finished and token_ids and token_ids[-1] == tokenizer.eos_token_id:
        token_ids = token_ids[:-1]
    parts: dict[bool, list[int]] = {True: [], False: []}
    inside = thinking
    for token in token_ids:
        if token in (start, end):
            inside = token == start
        else:
            parts[inside].append(token)
    return tuple(tokenizer.decode(parts[side]).rstrip("\ufffd") for side in (True, False))


THINKING = [
    ("on-budget", {"thinking_token_budget": 6}, True),
    ("on", {}, True),
    ("off", NO_THINKING, False),
    ("off-by-effort", {"reasoning_effort": "none"}, False),
]


@pytest.mark.parametrize("case,extra,thinking", THINKING, ids=[t[0] for t in THINKING])
def test_reasoning_is_separated_by_the_thinking_mode(server, tokenizer, case, extra, thinking):
    """The server's default is thinking on (cpu-tiny renders {"thinking": true}); a request turns
    it off with chat_template_kwargs. Oracle: the generated token ids split at the think tags."""
    reply = _post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": ASK, "max_tokens": 24, "temperature": 0,
        "return_token_ids": True, **extra})
    choice = reply["choices"][0]
    ids = choice["token_ids"]
    reasoning, content = _split(ids, thinking, tokenizer, choice["finish_reason"] == "stop")
    message = choice["message"]
    assert (message.get("reasoning") or "") == reasoning
    assert (message.get("content") or "") == content
    details = reply["usage"]["completion_tokens_details"]
    if case == "on-budget":  # vLLM ends the reasoning after exactly the budget
        assert ids.index(tokenizer.convert_tokens_to_ids("</think>")) == 6
        assert details["reasoning_tokens"] == 6 and reasoning and content
    elif case == "on":
        assert reasoning and details["reasoning_tokens"] > 0
    else:  # off: no reasoning, whatever the random model writes is content
        assert content and details["reasoning_tokens"] == 0


def test_streamed_reasoning_and_content_match_the_streamed_tokens(client, tokenizer):
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=24, temperature=0, stream=True,
        extra_body={"thinking_token_budget": 5, "return_token_ids": True})
    reasoning, content, ids, finish = "", "", [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning", None) or ""
        content += delta.content or ""
        ids += (chunk.choices[0].model_extra or {}).get("token_ids") or []
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, content) == _split(ids, True, tokenizer, finish == "stop")
    assert reasoning and content


def test_a_repeated_prompt_reports_cached_tokens(client):
    """The first request of a fresh prompt hits nothing; its repeat is served from the prefix
    cache (whole cache blocks only, so the prompt is several blocks long)."""
    fresh = uuid.uuid4().hex
    long_prompt = [{"role": "user", "content": f"{fresh} " + "the quick brown fox " * 50}]
    usages = [client.chat.completions.create(model=MODEL, messages=long_prompt, max_tokens=2,
                                             temperature=0, extra_body=NO_THINKING).usage
              for _ in range(2)]
    first, second = (u.prompt_tokens_details.cached_tokens for u in usages)
    assert usages[0].prompt_tokens == usages[1].prompt_tokens > 512
    assert first == 0 and 0 < second < usages[1].prompt_tokens


REFUSED = [
    ("min_p", {"temperature": 0.8, "extra_body": {"min_p": 0.1}},
     "not yet supported with speculative decoding"),
    ("logit_bias", {"logit_bias": {"42": 5}}, "not yet supported with speculative decoding"),
    ("n>1 greedy", {"n": 2, "temperature": 0}, "n must be 1 when using greedy sampling"),
]


@pytest.mark.parametrize("case,params,message", REFUSED, ids=[r[0] for r in REFUSED])
def test_what_speculation_refuses_is_a_clear_400(client, case, params, message):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **params)
    assert err.value.status_code == 400 and message in str(err.value)


def _constrained_greedy(server, tokenizer, kind: str) -> tuple[list[int], list[int]]:
    """(prompt ids, emitted ids) of one greedy request under a grammar, the two ways clients
    ask: a chat response_format with thinking off, a completion under structured_outputs.
    A completion prompt ends with </think>: the reasoning parser holds a grammar back until
    the reasoning has ended, and a raw prompt counts as thinking (README "Clients")."""
    if kind == "json":
        reply = _post(server, "/v1/chat/completions", {
            "model": MODEL, "messages": ASK, "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "weather", "schema": grammar.SCHEMA}},
            "return_token_ids": True, **NO_THINKING})
        return reply["prompt_token_ids"], reply["choices"][0]["token_ids"]
    prompt = tokenizer.encode("Weather report:</think>")
    choice = _post(server, "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0,
        "structured_outputs": {"regex": grammar.REGEX}, "return_token_ids": True})["choices"][0]
    return prompt, choice["token_ids"]


@pytest.mark.parametrize("kind", grammar.GRAMMARS)
def test_greedy_under_a_grammar_is_the_targets_best_allowed_token(server, tokenizer, kind):
    """Lossless under a grammar, by teacher forcing. DSpark decodes greedily under the
    constraint; the target then scores prompt + output in one prefill (the server's prompt
    logprobs over the whole vocabulary: a target forward, no draft involved). At each emitted
    position an independent xgrammar matcher, walked over the emitted tokens, gives the allowed
    set A (support/grammar_oracle.py). Exact: every emitted token is in A. Scored: its deficit,
    max over A of the target's logprob minus its own, stays within EPSILON_NATS."""
    vocab = json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"]
    prompt, emitted = _constrained_greedy(server, tokenizer, kind)
    assert emitted
    scored = _post(server, "/v1/completions", {
        "model": MODEL, "prompt": prompt + emitted, "max_tokens": 1, "temperature": 0,
        "prompt_logprobs": vocab})["choices"][0]["prompt_logprobs"]
    allowed = grammar.allowed_sets(tokenizer, vocab, kind, emitted)
    assert len(allowed) == len(emitted), f"token {len(allowed)} is not allowed by the grammar"
    positions = [{int(t): v["logprob"] for t, v in scored[len(prompt) + j].items()}
                 for j in range(len(emitted))]
    deficits = grammar.grammar_deficits(positions, emitted, allowed)
    worst = max(deficits)
    print(f"{kind}: {len(emitted)} tokens, worst deficit {worst:.4f} nats, epsilon {EPSILON_NATS}")
    assert worst <= EPSILON_NATS, deficits


def test_dspark_drafted_for_these_requests(server, spec_before):
    """Last in this module: the chat requests above went through DSpark's verify steps. (The
    tiny draft's weights are random, so it rarely guesses the target; acceptance is printed.)"""
    after = spec_decode_counters(_get(server, "/metrics"))
    drafts = after["num_drafts"] - spec_before["num_drafts"]
    accepted = after["num_accepted_tokens"] - spec_before["num_accepted_tokens"]
    print(f"dspark over the chat tests: {drafts:.0f} drafts, "
          f"{after['num_draft_tokens'] - spec_before['num_draft_tokens']:.0f} draft tokens, "
          f"{accepted:.0f} accepted")
    assert drafts > 0
