"""Streaming chat completion with the OpenAI Python SDK (`pip install openai`), thinking off.

Environment: OPENAI_BASE_URL (default http://127.0.0.1:8000/v1), OPENAI_API_KEY (or
VLLM_API_KEY), OPENAI_MODEL (default deepseek-v4-flash), OPENAI_EXTRA_BODY (optional JSON
of extra request fields, e.g. '{"top_k": 20}').
"""

import json
import os

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
    api_key=os.environ.get("OPENAI_API_KEY") or os.environ.get("VLLM_API_KEY", ""),
)
model = os.environ.get("OPENAI_MODEL", "deepseek-v4-flash")
extra = json.loads(os.environ.get("OPENAI_EXTRA_BODY", "{}"))

stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Write a haiku about two small computers."}],
    max_tokens=128,
    stream=True,
    stream_options={"include_usage": True},
    extra_body={"chat_template_kwargs": {"thinking": False}, **extra},
)
finish, usage = None, None
for chunk in stream:
    if chunk.usage:
        usage = chunk.usage
    for choice in chunk.choices:
        print(choice.delta.content or "", end="", flush=True)
        finish = choice.finish_reason or finish
print()
print(f"finish_reason: {finish}; completion tokens: {usage.completion_tokens if usage else '?'}")
