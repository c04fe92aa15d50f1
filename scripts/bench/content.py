"""Content-typed prompts of an exact token length, from the texts in prompts/ (no download).

DSpark's acceptance depends on what is generated (prose drafts worse than code or math), so
every sweep level is one content type. A file holds samples separated by lines `%%%`; request
i uses sample i (cycled), preceded by the type's other samples as filler and cut from the
left to the level's length, so the prompt always ends where the sample asks for output. A
unique first line per request keeps the server's prefix cache cold.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PROMPTS_DIR = Path(__file__).with_name("prompts")
CONTENT_TYPES = tuple(sorted(p.stem for p in PROMPTS_DIR.glob("*.txt")))


def samples(content_type: str) -> list[str]:
    if content_type not in CONTENT_TYPES:
        raise ValueError(f"content type {content_type!r}: expected one of {CONTENT_TYPES}")
    text = (PROMPTS_DIR / f"{content_type}.txt").read_text(encoding="utf-8")
    return [s.strip("\n") for s in text.split("\n%%%\n") if s.strip()]


def exact_prompt(tokenizer: Any, head: str, body: str, prompt_len: int) -> str:
    """`head` + the last tokens of `body`, `prompt_len` tokens in all (special tokens counted,
    as `vllm bench serve` counts them); a prompt that re-tokenizes differently raises."""
    special = len(tokenizer("").input_ids)
    head_ids = tokenizer(head, add_special_tokens=False).input_ids
    body_ids = tokenizer(body, add_special_tokens=False).input_ids
    keep = prompt_len - special - len(head_ids)
    if keep < 1:
        raise ValueError(f"prompt_len {prompt_len}: expected more than {prompt_len - keep} tokens")
    while len(body_ids) < keep + 4:
        body_ids = body_ids + body_ids
    for take in (keep, keep + 1, keep - 1, keep + 2, keep - 2, keep + 3):
        # a cut can re-tokenize into one token more or less: the nearest cut that fits wins
        text = head + tokenizer.decode(body_ids[len(body_ids) - take:])
        if take > 0 and len(tokenizer(text).input_ids) == prompt_len:
            return text
    raise ValueError(f"prompt_len {prompt_len}: no cut of the text re-tokenizes to that length")


def write_dataset(
    path: Path, tokenizer: Any, content_type: str, prompt_len: int, n: int, tag: str
) -> None:
    """`n` requests as the JSONL that `vllm bench serve --dataset-name custom` reads."""
    texts = samples(content_type)
    with path.open("w", encoding="utf-8") as out:
        for i in range(n):
            own = texts[i % len(texts)]
            filler = "\n\n".join(t for t in texts if t is not own)
            head = f"[request {content_type} {tag}-{i}]\n"
            prompt = exact_prompt(tokenizer, head, f"{filler}\n\n{own}" if filler else own,
                                  prompt_len)
            out.write(json.dumps({"prompt": prompt}) + "\n")
