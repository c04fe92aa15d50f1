"""The tiny checkpoint as vLLM reads it: its tokenizer carries the tokens DeepSeek-V4's
encoder and parser need (vLLM imported, no engine)."""

from __future__ import annotations

import json

from scripts.tiny import make_tiny_model as mtm


def test_tokenizer_carries_the_tokens_deepseek_v4s_encoder_and_parser_need(dspark):
    """Oracle: the marker strings of vLLM's own DeepSeek-V4 encoder and parser. Each is one
    token, and the DSML tool-call block markers are non-special, so detokenized text keeps them
    as the parser's text side expects."""
    from transformers import AutoTokenizer
    from vllm.parser.deepseek_v4 import deepseek_v4_config
    from vllm.tokenizers import deepseek_v4_encoding as enc

    tok = AutoTokenizer.from_pretrained(str(dspark))
    encoder = [enc.bos_token, enc.eos_token, enc.USER_SP_TOKEN, enc.ASSISTANT_SP_TOKEN,
               enc.LATEST_REMINDER_SP_TOKEN, enc.thinking_start_token, enc.thinking_end_token]
    parser = set(deepseek_v4_config().token_id_terminals.values())
    for marker in [*encoder, *sorted(parser)]:
        ids = tok.encode(marker, add_special_tokens=False)
        assert len(ids) == 1 and tok.decode(ids) == marker, (marker, ids)
    for marker in set(mtm.CHAT_TOKENS):
        ids = tok.encode(f"a{marker}b", add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=True) == f"a{marker}b"
    assert {m for m in mtm.CHAT_TOKENS if m.startswith("<")} <= parser
    assert mtm.CHAT_TOKENS[-1] == enc.dsml_token
    # Inside any other DSML tag the marker is one token.
    tag = tok.encode(f'<{enc.dsml_token}invoke name="f">', add_special_tokens=False)
    assert tok.convert_tokens_to_ids(enc.dsml_token) in tag
    assert len(tok) == json.loads((dspark / "config.json").read_text())["vocab_size"]
