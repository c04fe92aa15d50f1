"""The memory-bound twin's geometry (scripts/tiny/membound.py), not its timings.

Oracle: the byte table's formula against the tensors ``make_tiny_model`` actually writes for
the twin's layers (shapes on the meta device, summed by name), and the published ratios from
the published config fixture.
"""

from __future__ import annotations

import pytest
import torch

from scripts.tiny import make_tiny_model as tiny
from scripts.tiny import membound


class _MetaInit(tiny._Init):
    """make_tiny_model's draws as shapes only."""

    def normal(self, shape, std, dtype=None):
        return torch.empty(shape, dtype=dtype or torch.bfloat16, device="meta")


def _twin_config():
    args = membound.tiny_args(membound.parse_args([]))
    return tiny.build_config(args, args.vocab_size)


def test_byte_table_matches_the_written_tensors():
    cfg = _twin_config()
    init = _MetaInit(0)
    L, E, k = cfg["num_hidden_layers"], cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    attention = routed = shared = 0
    for i, ratio in enumerate(cfg["compress_ratios"][:L]):
        for name, t in tiny._decoder_layer(init, cfg, f"layers.{i}", ratio, i == 0).items():
            size = t.numel() * t.element_size()
            if ".attn." in name and t.dim() == 2 and t.dtype == torch.bfloat16:  # projections
                attention += size
            elif ".ffn.experts." in name:
                routed += size
            elif ".ffn.shared_experts." in name:
                shared += size
    table = membound.byte_table(cfg, 2, 2)
    assert table["attention_MB"] == pytest.approx(attention / L / 1e6, rel=0.01)
    assert table["routed_active_MB"] == pytest.approx(routed / L / E * k / 1e6, rel=1e-6)
    assert table["shared_MB"] == pytest.approx(shared / L / 1e6, rel=1e-6)


def test_twin_keeps_the_published_ratios():
    twin, pub = membound.byte_table(_twin_config(), 2, 2), membound.published_table()
    for got, want in zip(twin["ratio_attention_routed_shared"],
                         pub["ratio_attention_routed_shared"], strict=True):
        assert got == pytest.approx(want, rel=0.1)
    assert twin["experts_per_token_over_experts"] == pub["experts_per_token_over_experts"]
    assert twin["draft_stages_over_layers"] == pytest.approx(3 / 43, rel=0.03)
    assert twin["decode_step_MB"] > 4 * 32 * 2**20 / 1e6  # well beyond a 32 MiB L3
