"""Reasoning with thinking on and off (the profile's `serving.reasoning_parser: deepseek_v4`).

With thinking on the model's reasoning arrives apart from the answer, in `message.reasoning`
(older vLLM releases called it `reasoning_content`); a request turns thinking off with
`chat_template_kwargs: {"thinking": false}`, and then no reasoning field is set. The
profile's `serving.thinking` is the default for requests that say nothing.

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
question = [{"role": "user", "content": "Is 221 a prime number?"}]

for thinking in (True, False):
    reply = client.chat.completions.create(
        model=model,
        messages=question,
        max_tokens=1024,
        extra_body={"chat_template_kwargs": {"thinking": thinking}, **extra},
    )
    message = reply.choices[0].message
    reasoning = getattr(message, "reasoning", None) or getattr(message, "reasoning_content", None)
    print(f"thinking {'on' if thinking else 'off'}: reasoning "
          f"{'absent' if reasoning is None else f'{len(reasoning)} characters'}, "
          f"answer {len(message.content or '')} characters")
    print(f"  answer: {(message.content or '').strip()[:200]!r}")
