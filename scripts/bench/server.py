"""The server under test: discovery (model, max_model_len, version), tokenizer endpoints, /metrics."""

from __future__ import annotations

from typing import Any

import aiohttp


class BenchError(RuntimeError):
    """A problem that stops the benchmark before it measures anything (exit code 2)."""


def normalize_base_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if url.endswith("/v1"):
        url = url[:-3]
    return url


class Server:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str | None):
        self.session = session
        self.base = normalize_base_url(base_url)
        self.model: str = model or ""
        self.max_model_len: int | None = None
        self.version: str | None = None

    async def _get(self, path: str, timeout: float = 30.0) -> aiohttp.ClientResponse:
        return await self.session.get(
            self.base + path, timeout=aiohttp.ClientTimeout(total=timeout)
        )

    async def _models(self) -> list[Any]:
        url = self.base + "/v1/models"
        try:
            async with await self._get("/v1/models", timeout=15.0) as resp:
                if resp.status != 200:
                    text = await resp.text(errors="replace")
                    raise BenchError(
                        f"server at {self.base} answered GET /v1/models with HTTP {resp.status}: "
                        f"{text[:200]} (wrong --api-key?)"
                    )
                return (await resp.json(content_type=None)).get("data") or []
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            reason = str(exc) or type(exc).__name__
            raise BenchError(
                f"cannot reach the server at {self.base} (GET {url}: {reason}). "
                "Is it running? Locally: `make serve`; on Spark: `make up` on both "
                "nodes, then pass --base-url http://HEAD:8000"
            ) from exc
        except (ValueError, AttributeError) as exc:
            raise BenchError(f"{url} did not return an OpenAI model list: {exc!r:.200}") from exc

    async def probe(self) -> None:
        """Pick the model (or check the given one is served) and read what the server says."""
        models = await self._models()
        ids = [m.get("id") for m in models if isinstance(m, dict)]
        if not ids:
            raise BenchError(f"{self.base}/v1/models lists no models")
        if not self.model:
            self.model = ids[0]
        elif self.model not in ids:
            raise BenchError(f"model {self.model!r} is not served; the server has {ids}")
        card = next(m for m in models if isinstance(m, dict) and m.get("id") == self.model)
        if isinstance(card.get("max_model_len"), int):
            self.max_model_len = card["max_model_len"]
        try:
            async with await self._get("/version", timeout=10.0) as resp:
                if resp.status == 200:
                    self.version = (await resp.json(content_type=None)).get("version")
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
            self.version = None

    async def _post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            async with self.session.post(
                self.base + path, json=body, timeout=aiohttp.ClientTimeout(total=300)
            ) as resp:
                if resp.status == 404:
                    raise BenchError(
                        f"the server has no {path} endpoint; exact prompt lengths need vLLM's "
                        "tokenizer endpoints (/tokenize, /detokenize)"
                    )
                if resp.status != 200:
                    text = await resp.text(errors="replace")
                    raise BenchError(f"POST {path} failed with HTTP {resp.status}: {text[:300]}")
                return await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise BenchError(f"POST {path} failed: {exc!r:.300}") from exc

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        body = {"model": self.model, "prompt": text, "add_special_tokens": add_special_tokens}
        out = await self._post_json("/tokenize", body)
        if isinstance(out.get("max_model_len"), int) and self.max_model_len is None:
            self.max_model_len = out["max_model_len"]
        return list(out["tokens"])

    async def count_chat(self, messages: list[dict[str, str]]) -> int:
        body = {"model": self.model, "messages": messages, "add_generation_prompt": True}
        return int((await self._post_json("/tokenize", body))["count"])

    async def detokenize(self, tokens: list[int]) -> str:
        out = await self._post_json("/detokenize", {"model": self.model, "tokens": tokens})
        return str(out["prompt"])

    async def metrics_text(self) -> str | None:
        """The /metrics page now, or None if the server has none."""
        try:
            async with await self._get("/metrics", timeout=30.0) as resp:
                if resp.status != 200:
                    return None
                return await resp.text(errors="replace")
        except (aiohttp.ClientError, TimeoutError):
            return None
