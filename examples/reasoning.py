"""Reasoning with thinking on and off (the profile's `serving.reasoning_parser: deepseek_v4`).

With thinking on the model's reasoning arrives apart from the answer, in `message.reasoning`
(older vLLM releases called it `reasoning_content`); a request turns thinking off with
`chat_template_kwargs: {"thinking": false}`, and then no reasoning field is set. The
profile's `serving.thinking` is the default for requests that say nothing.

Environment: see connection.py.
"""

from connection import client, extra, model

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
    print(
        f"thinking {'on' if thinking else 'off'}: reasoning "
        f"{'absent' if reasoning is None else f'{len(reasoning)} characters'}, "
        f"answer {len(message.content or '')} characters"
    )
    print(f"  answer: {(message.content or '').strip()[:200]!r}")
