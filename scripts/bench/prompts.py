"""Prompts of exact token length, each starting with a unique nonce (cold for the prefix cache).

Completions API: the prompt is a list of token ids the server's own /tokenize produced, so its
length is exact by construction. Chat API: the text is re-tokenized through the chat template
and trimmed until /tokenize reports the target (or the closest reachable length, recorded).
Filler is varied plain words with a fixed seed: neither one repeated token (which makes
drafters look pathologically good or bad) nor random ids.
"""

from __future__ import annotations

import random
import sys

from .server import BenchError, Server

_WORDS = (
    "the quick survey of river valleys shows that farmers moved their orchards closer to "
    "water after several dry summers while merchants built new roads between market towns "
    "engineers measured bridges and reported cracks in older stone arches teachers wrote "
    "letters about crowded classrooms and asked for more books a small museum opened a "
    "gallery of maps drawn by sailors who crossed the northern sea in winter storms "
    "scientists compared samples of soil from hills forests and coastal plains to learn how "
    "rain shaped the land musicians played at the harbor festival every evening in autumn "
    "doctors visited distant villages with medicine and careful notes on seasonal illness "
    "children collected shells painted stones and told stories about ancient lighthouses"
).split()

Messages = list[dict[str, str]]


class PromptBuilder:
    """Builds prompts of exact token length with a unique nonce at the very start."""

    def __init__(self, server: Server, seed: int, run_id: str):
        self.server = server
        self.seed = seed
        self.run_id = run_id
        self.filler_ids: list[int] = []
        self._chat_guess: dict[int, int] = {}
        self._warned: set[int] = set()

    def _filler_text(self, n_words: int) -> str:
        rng = random.Random(self.seed)
        out, count = [], 0
        while count < n_words:
            k = rng.randint(8, 18)
            words = [rng.choice(_WORDS) for _ in range(k)]
            out.append(" ".join(words).capitalize() + ".")
            count += k
        return "\n" + " ".join(out)

    async def prepare(self, max_len: int) -> None:
        """Tokenize enough filler for the longest prompt (ids without special tokens)."""
        n_words = max_len + 64
        for _ in range(8):
            self.filler_ids = await self.server.tokenize(self._filler_text(n_words), False)
            if len(self.filler_ids) >= max_len:
                return
            n_words *= 2
        raise BenchError(f"could not build {max_len} filler tokens via /tokenize")

    def nonce(self, tag: str) -> str:
        return f"Session {self.run_id}-{tag}. Read the notes below and continue them."

    async def completion_prompt(self, tag: str, length: int) -> list[int]:
        head = await self.server.tokenize(self.nonce(tag), True)
        need = length - len(head)
        if need < 0:
            raise BenchError(
                f"prompt length {length} is shorter than the unique prefix ({len(head)} tokens)"
            )
        return head + self.filler_ids[:need]

    async def _chat_messages(self, nonce: str, k: int) -> tuple[int, Messages]:
        """(templated length, messages) for the nonce plus the first k filler tokens."""
        text = nonce + " " + await self.server.detokenize(self.filler_ids[:k]) if k else nonce
        msgs = [{"role": "user", "content": text}]
        return await self.server.count_chat(msgs), msgs

    async def chat_prompt(self, tag: str, length: int) -> tuple[Messages, int]:
        """Messages whose chat-templated length is `length` (or the closest reachable)."""
        nonce = self.nonce(tag)
        k = self._chat_guess.get(length)
        if k is None:
            base, _ = await self._chat_messages(nonce, 0)
            k = length - base
            if k < 0:
                raise BenchError(
                    f"prompt length {length} is shorter than the chat template plus the "
                    f"unique prefix ({base} tokens)"
                )
        best: tuple[int, int, Messages] | None = None
        for _ in range(6):
            k = max(0, min(k, len(self.filler_ids)))
            n, msgs = await self._chat_messages(nonce, k)
            if best is None or abs(n - length) < abs(best[0] - length):
                best = (n, k, msgs)
            if n == length:
                break
            k += length - n
        assert best is not None
        if best[0] != length and length not in self._warned:
            self._warned.add(length)
            print(
                f"[bench] warning: chat prompt for length {length} reached {best[0]} tokens "
                "(the template/tokenizer merges at the boundary); the actual length is "
                "recorded per request as expected_prompt_tokens",
                file=sys.stderr,
            )
        self._chat_guess[length] = best[1]
        return best[2], best[0]
