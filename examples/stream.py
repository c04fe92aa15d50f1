"""Streaming chat completion with the OpenAI Python SDK (`pip install openai`), thinking off.

Environment: see connection.py.
"""

from connection import client, extra, model

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
