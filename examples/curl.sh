#!/usr/bin/env bash
# The API with curl: the served models, then one chat completion (thinking off), raw JSON.
#   OPENAI_BASE_URL  default http://127.0.0.1:8000/v1 (the head node's API)
#   OPENAI_API_KEY   the key (VLLM_API_KEY in docker/.env); falls back to VLLM_API_KEY
#   OPENAI_MODEL     default deepseek-v4-flash (model.served_name of the profile)
set -euo pipefail
base="${OPENAI_BASE_URL:-http://127.0.0.1:8000/v1}"
key="${OPENAI_API_KEY:-${VLLM_API_KEY:-}}"
model="${OPENAI_MODEL:-deepseek-v4-flash}"

curl -sS --fail-with-body "$base/models" -H "Authorization: Bearer $key"
echo
curl -sS --fail-with-body "$base/chat/completions" \
  -H "Authorization: Bearer $key" -H "Content-Type: application/json" \
  -d @- <<JSON
{
  "model": "$model",
  "messages": [{"role": "user", "content": "Name three rivers in Europe."}],
  "max_tokens": 128,
  "chat_template_kwargs": {"thinking": false}
}
JSON
echo
