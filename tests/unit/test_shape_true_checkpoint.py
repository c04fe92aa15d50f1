"""The shape-true tiny checkpoint against the published tensor contract, on the meta device.

``scripts/tiny/shape_true.py`` must write every tensor of the layers it has with the
published checkpoint's name, shape and dtype. The draft stages are compared with the
meta-device contract at published size (``tests/support/draft_contract.py``, itself checked
against the published shards' census in ``integration/test_draft_contract.py``) for the
experts the tiny has; the target layers with shapes stated from the published checkpoint.
No weights are drawn for the large tensors (``materialise`` keeps them on the meta device).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from scripts.tiny import shape_true
from tests.support.draft_contract import checkpoint_tensors
from tests.support.paths import FIXTURES

PUBLISHED_VOCAB = 129280
E4M3, E8M0, I8 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8
# (name, shape, dtype) of target-layer tensors in the published checkpoint
TARGET = [
    ("layers.1.attn.wq_a.weight", (1024, 4096), E4M3),
    ("layers.1.attn.wq_a.scale", (8, 32), E8M0),
    ("layers.1.attn.wq_b.weight", (32768, 1024), E4M3),
    ("layers.1.attn.wkv.weight", (512, 4096), E4M3),
    ("layers.1.attn.wo_a.weight", (8192, 4096), E4M3),
    ("layers.1.attn.wo_a.scale", (64, 32), E8M0),
    ("layers.1.attn.wo_b.weight", (4096, 8192), E4M3),
    ("layers.1.attn.indexer.wq_b.weight", (8192, 1024), E4M3),
    ("layers.1.ffn.shared_experts.w1.weight", (2048, 4096), E4M3),
    ("layers.1.ffn.shared_experts.w2.scale", (32, 16), E8M0),
    ("layers.2.ffn.experts.7.w1.weight", (2048, 2048), I8),
    ("layers.2.ffn.experts.7.w1.scale", (2048, 128), E8M0),
    ("layers.2.ffn.experts.7.w2.weight", (4096, 1024), I8),
    ("layers.0.ffn.gate.tid2eid", (PUBLISHED_VOCAB, 6), torch.int64),
    ("layers.0.hc_attn_fn", (24, 16384), torch.float32),
    ("layers.0.attn.attn_sink", (64,), torch.float32),
]


@pytest.fixture(scope="module")
def tensors():
    args = shape_true.tiny_args(PUBLISHED_VOCAB, shape_true.EXPERTS, 0)
    cfg = shape_true.build_config(args)
    with torch.device("cpu"):
        out = shape_true.build_real_tensors(cfg, 0, lambda *a: None,
                                            materialise=lambda t, gen: t, designed=False)
    return cfg, out


def test_config_has_the_published_sizes_and_every_compress_ratio(tensors):
    cfg, _ = tensors
    published = json.loads((FIXTURES / "dsv4_flash_dspark_config.json").read_text())
    for key in ("hidden_size", "num_attention_heads", "head_dim", "qk_rope_head_dim",
                "q_lora_rank", "o_lora_rank", "o_groups", "moe_intermediate_size",
                "num_experts_per_tok", "dspark_markov_rank", "dspark_block_size",
                "quantization_config", "expert_dtype"):
        assert cfg[key] == published[key], key
    assert set(cfg["compress_ratios"]) == set(published["compress_ratios"])
    assert "n_mtp_layers" not in cfg


def test_draft_stages_equal_the_published_contract(tensors):
    cfg, mine = tensors
    published = json.loads((FIXTURES / "dsv4_flash_dspark_config.json").read_text())
    contract = checkpoint_tensors(published)
    expert = re.compile(r"\.experts\.(\d+)\.")

    def kept(name):
        m = expert.search(name)
        return m is None or int(m.group(1)) < shape_true.EXPERTS

    want = {n: (tuple(t.shape), t.dtype) for n, t in contract.items() if kept(n)}
    got = {n: (tuple(t.shape), t.dtype) for n, t in mine.items() if n.startswith("mtp.")}
    assert set(got) == set(want)
    for name, (shape, dtype) in got.items():
        if ".ffn.gate." in name:  # one router row per expert: 8 here, 256 published
            assert shape[0] == shape_true.EXPERTS and shape[1:] == want[name][0][1:], name
            assert dtype == want[name][1], name
        else:
            assert (shape, dtype) == want[name], name


@pytest.mark.parametrize("name, shape, dtype", TARGET, ids=[t[0] for t in TARGET])
def test_target_layers_have_the_published_shapes(tensors, name, shape, dtype):
    _, mine = tensors
    assert (tuple(mine[name].shape), mine[name].dtype) == (shape, dtype)
