"""A tool call with the OpenAI Python SDK: the model must call a tool (here the only one,
`get_weather`); the arguments arrive as a JSON string in `tool_calls`, matching the tool's
schema (the profile's `serving.tool_call_parser: deepseek_v4`), and the turn ends with
`finish_reason: tool_calls`. `tool_choice="auto"` lets the model decide; a named function
forces that one (the turn then ends with `stop`, as OpenAI's API does).

Environment: see connection.py.
"""

import json

from connection import client, extra, model

weather = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                "unit": {"type": "string", "enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
reply = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "What is the weather in Paris, in Celsius?"}],
    tools=[weather],
    tool_choice="required",
    max_tokens=512,
    extra_body={"chat_template_kwargs": {"thinking": False}, **extra},
)
for call in reply.choices[0].message.tool_calls or []:
    arguments = json.loads(call.function.arguments)
    print(f"tool call: {call.function.name} {json.dumps(arguments)}")
print(f"finish_reason: {reply.choices[0].finish_reason}")
