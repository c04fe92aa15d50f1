"""What every Python example needs to reach the server, read from the environment.

OPENAI_BASE_URL (default http://127.0.0.1:8000/v1), OPENAI_API_KEY (or VLLM_API_KEY),
OPENAI_MODEL (default deepseek-v4-flash), OPENAI_EXTRA_BODY (optional JSON of extra request
fields, e.g. '{"top_k": 20}'). Run an example as `python examples/NAME.py`: Python then finds
this module beside it.
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
