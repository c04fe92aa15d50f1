"""Structured output: the answer is JSON that matches a JSON schema (vLLM's guided decoding).
Thinking is off, so the whole answer is under the schema.

Environment: see connection.py.
"""

import json

from connection import client, extra, model

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
