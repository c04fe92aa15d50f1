"""Teacher forcing under a grammar: what a grammar allows at each emitted position, and how far
each emitted token falls below the target's best allowed token there.

The allowed sets come from an xgrammar matcher compiled here with the options vLLM's xgrammar
backend uses by default, walked over the emitted tokens: independent of vLLM's structured-output
state, which under speculative decoding advances over accepted drafts and rolls back rejected
ones. The deficit of an emitted token is ``max over A of logprob - its own logprob``, with the
plain target's logprobs over the whole vocabulary (A is the allowed set).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "days", "sunny"],
    "additionalProperties": False,
}
REGEX = r"(Paris|Tokyo|Lima), [1-7] days?, (sun|rain|snow)( and (sun|rain|snow))*\."
GRAMMARS = ("json", "regex")


def allowed_sets(
    tokenizer, vocab_size: int, kind: str, emitted: Sequence[int], any_whitespace: bool = True
) -> list[set[int]]:
    """The allowed token ids before each emitted token, as long as the emitted tokens are
    allowed (a forbidden token ends the list: its index is the list's length).

    ``any_whitespace=False`` is vLLM's ``structured_outputs_config.disable_any_whitespace``.
    """
    import torch
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer,
                                                                      vocab_size=vocab_size))
    separators = None if any_whitespace else (",", ":")
    compiled = (compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=any_whitespace,
                                             separators=separators)
                if kind == "json" else compiler.compile_regex(REGEX))
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    sets = []
    for token in emitted:
        matcher.fill_next_token_bitmask(bitmask)
        logits = torch.zeros(1, vocab_size)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        allowed = set(torch.nonzero(logits[0] == 0).flatten().tolist())
        if token not in allowed or not matcher.accept_token(token):
            break
        sets.append(allowed)
    return sets


def grammar_deficits(
    position_logprobs: Sequence[Mapping[int, float]],
    emitted: Sequence[int],
    allowed: Sequence[set[int]],
) -> list[float]:
    """Per emitted token: the best allowed logprob at its position minus its own.

    ``position_logprobs[j]`` maps every token id to its logprob before ``emitted[j]``.
    """
    if not len(position_logprobs) == len(emitted) == len(allowed):
        raise ValueError(
            f"need one logprob map and one allowed set per emitted token ({len(emitted)}), got "
            f"{len(position_logprobs)} and {len(allowed)}"
        )
    deficits = []
    for j, (scores, token, ok) in enumerate(zip(position_logprobs, emitted, allowed,
                                                strict=True)):
        missing = ok - scores.keys()
        if missing:
            raise ValueError(f"position {j}: no logprob for allowed tokens {sorted(missing)[:5]}")
        deficits.append(max(scores[a] for a in ok) - scores[token])
    return deficits
