"""Loading the DSpark draft from the published checkpoint's names and layout.

The rules are upstream's (``models/deepseek_v4/nvidia/dspark.py``): the name is mapped
first and every block-FP8 ``.scale`` rewritten after; a parameter the checkpoint never
writes is an error (vLLM does not track it for quantised models); a non-local expert is
skipped under expert parallelism; the stage count defaults to 3 without ``n_mtp_layers``.
Run against the tiny bf16 checkpoint's draft (a fresh one per test, never loaded twice).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from tests.support.tiny import ensure_tiny_model, vllm_single_process


@pytest.fixture(scope="module")
def checkpoint():
    from safetensors.torch import load_file

    model_dir = ensure_tiny_model()
    return vllm_single_process(model_dir), load_file(str(model_dir / "model.safetensors"))


def _new_draft(vc, monkeypatch, hf_config=None):
    """A draft built (not loaded) in ``vc``; its layer names do not clash with others'."""
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v4.cpu.dspark import DSparkDeepseekV4ForCausalLM
    from vllm.utils.torch_utils import set_default_torch_dtype

    monkeypatch.setattr(vc.compilation_config, "static_forward_context", {})
    if hf_config is not None:
        monkeypatch.setattr(vc.model_config, "hf_config", hf_config)
    with set_current_vllm_config(vc), set_default_torch_dtype(torch.bfloat16):
        return DSparkDeepseekV4ForCausalLM(vllm_config=vc)


def _mtp(tensors):
    return [(n, t) for n, t in tensors.items() if n.startswith("mtp.")]


def test_every_scale_is_rewritten_after_the_name_mapping(checkpoint, monkeypatch):
    vc, _ = checkpoint
    draft = _new_draft(vc, monkeypatch)
    fp4 = SimpleNamespace(**{**vars(draft.config), "expert_dtype": "fp4"})
    monkeypatch.setattr(draft, "config", fp4)
    assert draft._map_name("mtp.0.main_proj.scale") == "main_proj.weight_scale_inv"
    assert draft._map_name("mtp.1.attn.wo_a.scale") == "layers.1.attn.wo_a.weight_scale_inv"
    assert (
        draft._map_name("mtp.0.ffn.shared_experts.w2.scale")
        == "layers.0.ffn.shared_experts.down_proj.weight_scale_inv"
    )
    assert draft._map_name("mtp.1.ffn.experts.7.w3.scale") == "layers.1.ffn.experts.7.w3.weight_scale"
    # mHC scales are parameters of their own, not FP8 scales.
    assert draft._map_name("mtp.1.hc_head_scale") == "hc_head_scale"
    assert draft._map_name("mtp.0.hc_attn_scale") == "layers.0.hc_attn_scale"
    fp8 = SimpleNamespace(**{**vars(draft.config), "expert_dtype": "fp8"})
    monkeypatch.setattr(draft, "config", fp8)
    assert (
        draft._map_name("mtp.1.ffn.experts.7.w3.scale")
        == "layers.1.ffn.experts.7.w3.weight_scale_inv"
    )


def test_a_tensor_missing_from_the_checkpoint_is_named(checkpoint, monkeypatch):
    vc, tensors = checkpoint
    draft = _new_draft(vc, monkeypatch)
    weights = [(n, t) for n, t in _mtp(tensors) if n != "mtp.1.attn.wo_b.weight"]
    with pytest.raises(ValueError, match=r"1 parameter\(s\): layers\.1\.attn\.wo_b\.weight"):
        draft.load_weights(weights)
    # One expert missing: its fused parameter is written by the others, the expert is named.
    draft = _new_draft(vc, monkeypatch)
    weights = [(n, t) for n, t in _mtp(tensors) if n != "mtp.1.ffn.experts.5.w3.weight"]
    with pytest.raises(ValueError, match=r"1 parameter\(s\): layers\.1\.ffn\.experts\.5\.w3\.weight"):
        draft.load_weights(weights)
    # The whole checkpoint loads every parameter.
    draft = _new_draft(vc, monkeypatch)
    assert draft.load_weights(_mtp(tensors)) == {n for n, _ in draft.named_parameters()}


def test_unknown_and_foreign_names(checkpoint, monkeypatch):
    vc, tensors = checkpoint
    draft = _new_draft(vc, monkeypatch)
    with pytest.raises(ValueError, match="maps to 'layers.0.attn.not_a_weight'"):
        draft.load_weights([("mtp.0.attn.not_a_weight", torch.zeros(1))])
    experts = draft.config.n_routed_experts
    with pytest.raises(ValueError, match="no expert parameter"):
        draft.load_weights([(f"mtp.0.ffn.experts.{experts}.w1.weight", torch.zeros(1))])
    # Target weights and stages past the draft's depth are not the draft's.
    assert draft._map_name("layers.0.attn.wkv.weight") is None
    assert draft._map_name(f"mtp.{len(draft.layers)}.attn.wkv.weight") is None


def test_non_local_experts_are_skipped_under_expert_parallelism(checkpoint, monkeypatch):
    """With an expert map the loader of an expert another rank owns returns False."""
    vc, tensors = checkpoint
    draft = _new_draft(vc, monkeypatch)
    written = []
    for name, param in draft.named_parameters():
        if ".ffn.experts." not in name:
            continue
        loader = param.weight_loader

        def local_only(param, tensor, target, *, shard_id, expert_id, return_success, _l=loader):
            if expert_id % 2:
                return False
            written.append(expert_id)
            return _l(param, tensor, target, shard_id=shard_id, expert_id=expert_id,
                      return_success=return_success)

        param.weight_loader = local_only
    draft.load_weights(_mtp(tensors))
    assert written and set(written) == set(range(0, draft.config.n_routed_experts, 2))


def test_stage_count_is_three_without_n_mtp_layers(checkpoint, monkeypatch):
    """The published config has no ``n_mtp_layers`` and 3 stages (upstream's default)."""
    vc, tensors = checkpoint
    hf = copy.deepcopy(vc.model_config.hf_config)
    assert hf.n_mtp_layers == 2
    del hf.n_mtp_layers
    draft = _new_draft(vc, monkeypatch, hf_config=hf)
    assert len(draft.layers) == 3 and draft.shape.num_draft_layers == 3
    assert draft.context_wkv_proj.output_size == 3 * draft.shape.head_dim
    # This checkpoint has 2 stages: the third stage's parameters are named as missing.
    with pytest.raises(ValueError, match=r"layers\.2\.attn\.") as err:
        draft.load_weights(_mtp(tensors))
    assert "mtp.0..mtp.2" in str(err.value)


def test_native_mega_moe_is_refused_before_any_weight(checkpoint, monkeypatch):
    vc, _ = checkpoint
    monkeypatch.setattr(vc.kernel_config, "moe_backend", "deep_gemm_mega_moe")
    with pytest.raises(ValueError, match="moe_backend='deep_gemm_mega_moe' is not supported"):
        _new_draft(vc, monkeypatch)


def test_dense_weight_uses_the_layers_block_size():
    """``out=192`` with 128x128 blocks: 2 block rows, the second partial."""
    from vllm.models.deepseek_v4.common.dspark.layers import _dense_weight

    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(192, 256, generator=gen).to(torch.float8_e4m3fn)
    exponents = torch.tensor([[-3, 1], [4, -7]], dtype=torch.float32)
    scale = torch.exp2(exponents).to(torch.float8_e8m0fnu)
    layer = SimpleNamespace(weight=weight, weight_scale_inv=scale, weight_block_size=[128, 128])
    want = weight.float().clone()
    for bi in range(2):
        for bj in range(2):
            want[bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128] *= 2.0 ** exponents[bi, bj]
    assert torch.equal(_dense_weight(layer), want)
    # Inferring the block from the shapes (192 / 2 = 96 rows) would scale rows 96..127 wrong.
    assert not torch.equal(want[96:128], weight.float()[96:128] * 2.0 ** exponents[1, 0])
