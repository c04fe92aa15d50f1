"""Structured output: the answer is JSON that matches a JSON schema (vLLM's guided decoding).
Thinking is off, so the whole answer is under the schema.

Environment: as stream.py (OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL, OPENAI_EXTRA_BODY).
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

city = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "continent": {"type": "string", "enum": ["Europe", "Asia", "South America"]},
        "capital": {"type": "boolean"},
    },
    "required": ["name", "continent", "capital"],
    "additionalProperties": False,
}
reply = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Pick one of Paris, Tokyo or Lima and describe it."}],
    max_tokens=256,
    response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": city}},
    extra_body={"chat_template_kwargs": {"thinking": False}, **extra},
)
answer = json.loads(reply.choices[0].message.content)
print(f"json: {json.dumps(answer)}")
