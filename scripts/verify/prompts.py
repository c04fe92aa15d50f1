"""The demo's and the benchmarks' batch: eight prompts of very different lengths (1 to 300 tokens),
so engine steps mix prefill chunks and verify rows."""

from __future__ import annotations

MIXED_LENGTHS = (1, 4, 11, 27, 64, 130, 201, 300)

_TEXT = (
    "Speculative decoding drafts a block of tokens with a small model and lets the large "
    "model verify the whole block in one step. The draft keeps a window of context for "
    "every request, keyed by the request, so requests may arrive, finish and move around "
    "the batch without mixing their histories. "
)


def text_prompts(tokenizer, lengths=MIXED_LENGTHS) -> list[list[int]]:
    """Prefixes of one English text (BOS first when the tokenizer has one), one per length."""
    ids = tokenizer.encode(_TEXT * 12, add_special_tokens=False)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return [(bos + ids)[:n] for n in lengths]


def random_prompts(lengths=MIXED_LENGTHS, seed: int = 0) -> list[list[int]]:
    """Token ids drawn from [9, 1000) by one seeded torch generator, one list per length."""
    import torch

    rng = torch.Generator().manual_seed(seed)
    return [torch.randint(9, 1000, (n,), generator=rng).tolist() for n in lengths]
