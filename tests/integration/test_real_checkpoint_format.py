"""The published checkpoint format on CPU: the tiny checkpoint, the torch kernels, the draft.

``make_tiny_model.py --format real`` writes the tiny checkpoint as DeepSeek-V4-Flash-DSpark
is published (FP8 e4m3 + UE8M0 128x128 block scales, MXFP4 routed experts, 3 stages, no
``n_mtp_layers``) and ``--bf16-twin`` its exact bf16 dequantisation, the oracle here:
the files decode to the twin bit for bit (MXFP4 through vLLM's own reference decoder), and
the draft loaded from the quantised files holds, dequantised, exactly the twin draft's
parameters. The torch CPU kernels that run these formats without AMX are checked against
references and are shown to step aside where a native kernel can serve.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from vllm.model_executor.layers.fused_moe.flashinfer_moe_ep import (
    _dequant_mxfp4_ue8m0_gran32 as vllm_mxfp4_reference,
)

from scripts.tiny import checkpoint_quant as cq
from tests.support.tiny import ensure_real_format_models, vllm_single_process

PUBLISHED_QUANTIZATION = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}


@pytest.fixture(scope="module")
def models():
    real, twin = ensure_real_format_models()
    return {
        "real": (real, load_file(str(real / "model.safetensors"))),
        "twin": (twin, load_file(str(twin / "model.safetensors"))),
    }


def _config(path):
    return json.loads((path / "config.json").read_text())


def test_config_is_the_published_one(models):
    real_cfg, twin_cfg = _config(models["real"][0]), _config(models["twin"][0])
    assert real_cfg["quantization_config"] == PUBLISHED_QUANTIZATION
    assert real_cfg["expert_dtype"] == "fp4"
    for absent in ("n_mtp_layers", "enable_confidence_head"):
        assert absent not in real_cfg and absent not in twin_cfg
    assert "quantization_config" not in twin_cfg
    assert {k: v for k, v in twin_cfg.items() if k != "expert_dtype"} == {
        k: v for k, v in real_cfg.items() if k not in ("expert_dtype", "quantization_config")
    }
    tensors = models["real"][1]
    assert {n.split(".")[1] for n in tensors if n.startswith("mtp.")} == {"0", "1", "2"}


def test_tensors_have_the_published_dtypes_and_scale_shapes(models):
    tensors = models["real"][1]
    fp8 = [n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn]
    assert {n.split(".", 2)[-1] if n.startswith("mtp.") else n.split(".", 2)[-1] for n in fp8} >= {
        "attn.wq_a.weight", "attn.wkv.weight", "attn.wo_a.weight", "ffn.shared_experts.w2.weight",
    }
    assert "mtp.0.main_proj.weight" in fp8 and "layers.1.attn.indexer.wq_b.weight" in fp8
    assert not any(".compressor." in n or ".gate." in n or "markov" in n for n in fp8)
    for name in fp8:
        scale = tensors[name.removesuffix(".weight") + ".scale"]
        n, k = tensors[name].shape
        assert scale.dtype == torch.float8_e8m0fnu
        assert tuple(scale.shape) == (-(-n // 128), -(-k // 128)), name
    expert = tensors["mtp.1.ffn.experts.3.w2.weight"]
    cfg = _config(models["real"][0])
    assert expert.dtype == torch.int8
    assert tuple(expert.shape) == (cfg["hidden_size"], cfg["moe_intermediate_size"] // 2)
    assert tuple(tensors["mtp.1.ffn.experts.3.w2.scale"].shape) == (
        cfg["hidden_size"], cfg["moe_intermediate_size"] // 32,
    )
    assert tensors["mtp.2.confidence_head.proj.weight"].dtype == torch.bfloat16
    assert tensors["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert tensors["mtp.0.hc_attn_fn"].dtype == torch.float32


def test_the_files_decode_to_the_twin_bit_for_bit(models):
    real, twin = models["real"][1], models["twin"][1]
    assert set(twin) == {n for n in real if not n.endswith(".scale")}
    for name, want in twin.items():
        got = real[name]
        scale = real.get(name.removesuffix(".weight") + ".scale")
        if got.dtype == torch.float8_e4m3fn:
            got = cq.dequantize_fp8_block(got, scale)
        elif got.dtype == torch.int8:
            got = vllm_mxfp4_reference(got, scale)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    # The quantised weights are not the bf16 draw: the twin is a real dequantisation.
    w = twin["mtp.0.attn.wq_b.weight"].float()
    assert (w.abs() > 0).float().mean() > 0.9


def test_torch_dequantisers_equal_the_references():
    from vllm.model_executor.kernels.linear.scaled_mm.cpu_torch import dequantize_fp8_blocks
    from vllm.model_executor.layers.fused_moe.experts.cpu_torch_mxfp4_moe import (
        dequantize_mxfp4,
    )

    gen = torch.Generator().manual_seed(11)
    packed = torch.randint(0, 256, (64, 128), generator=gen, dtype=torch.int32).to(torch.uint8)
    scale = torch.randint(110, 140, (64, 8), generator=gen, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(dequantize_mxfp4(packed, scale, torch.bfloat16),
                       vllm_mxfp4_reference(packed, scale))
    for n, k in ((256, 384), (192, 320)):  # whole blocks; partial last blocks
        w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        q, s = cq.quantize_fp8_block(w)
        assert torch.equal(dequantize_fp8_blocks(q, s, (128, 128), torch.bfloat16),
                           cq.dequantize_fp8_block(q, s))


def test_torch_kernels_step_aside_for_native_ones(monkeypatch):
    from vllm.model_executor.kernels.linear.scaled_mm import cpu as native_linear
    from vllm.model_executor.kernels.linear.scaled_mm.cpu_torch import (
        TorchCPUFp8BlockScaledMMKernel,
    )
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.model_executor.layers.fused_moe.experts.cpu_torch_mxfp4_moe import (
        TorchCPUExpertsMxfp4,
    )

    config = SimpleNamespace(out_dtype=torch.bfloat16)
    native = native_linear.CPUFp8BlockScaledMMKernel
    has_native = native.is_supported()[0] or native_linear.CPUFp8W8A8BlockScaledMMKernel.is_supported()[0]
    if not has_native and not torch.cpu._is_amx_tile_supported():
        # This CPU: no native kernel, so the torch ones serve.
        assert TorchCPUFp8BlockScaledMMKernel.can_implement(config) == (True, None)
        assert TorchCPUExpertsMxfp4._supports_current_device()
    monkeypatch.setattr(native, "is_supported", classmethod(lambda cls, cc=None: (True, None)))
    monkeypatch.setattr(native, "can_implement", classmethod(lambda cls, c: (True, None)))
    ok, reason = TorchCPUFp8BlockScaledMMKernel.can_implement(config)
    assert not ok and "CPUFp8BlockScaledMMKernel" in reason
    monkeypatch.setattr(cpu_moe.CPUExpertsMxfp4, "_supports_current_device", staticmethod(lambda: True))
    assert not TorchCPUExpertsMxfp4._supports_current_device()


def test_torch_mxfp4_experts_equal_a_per_token_reference():
    """Rows grouped by expert (repeats, an expert of another rank) vs one row at a time."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.cpu_torch_mxfp4_moe import (
        TorchCPUExpertsMxfp4,
    )

    gen = torch.Generator().manual_seed(5)
    experts, hidden, inter, tokens, top_k, limit = 6, 64, 32, 9, 3, 2.5
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen)
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    q13 = [cq.quantize_mxfp4(w) for w in w13]
    q2 = [cq.quantize_mxfp4(w) for w in w2]
    layer = object.__new__(TorchCPUExpertsMxfp4)
    layer.quant_config = SimpleNamespace(
        w1_scale=torch.stack([s.view(torch.uint8) for _, s, _ in q13]),
        w2_scale=torch.stack([s.view(torch.uint8) for _, s, _ in q2]),
        w1_bias=None, w2_bias=None, gemm1_clamp_limit=limit,
    )
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, experts + 2, (tokens, top_k), generator=gen)  # 2 experts elsewhere
    expert_map = torch.tensor([0, 1, -1, 2, 3, 4, -1, 5])
    weights = torch.rand(tokens, top_k, generator=gen)
    out = torch.empty_like(x)
    layer.apply(out, x, torch.stack([p.view(torch.uint8) for p, _, _ in q13]),
                torch.stack([p.view(torch.uint8) for p, _, _ in q2]), weights, ids,
                MoEActivation.SILU, experts + 2, expert_map, None, None, None, None, None, False)
    want = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for j in range(top_k):
            e = int(expert_map[ids[t, j]])
            if e < 0:
                continue
            gate, up = (x[t].float() @ q13[e][2].float().t()).chunk(2)
            h = torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
            want[t] += weights[t, j] * (h @ q2[e][2].float().t())
    torch.testing.assert_close(out.float(), want, rtol=0.03, atol=0.03 * float(want.abs().max()))
    assert (want.abs() > 1.0).any()  # the tolerance is below the outputs' scale


def _loaded_draft(model_dir, tensors, monkeypatch):
    """A draft of ``model_dir`` with its ``mtp.*`` weights loaded, not yet processed."""
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v4.cpu.dspark import DSparkDeepseekV4ForCausalLM
    from vllm.utils.torch_utils import set_default_torch_dtype

    vc = vllm_single_process(model_dir)
    monkeypatch.setattr(vc.compilation_config, "static_forward_context", {})
    with set_current_vllm_config(vc), set_default_torch_dtype(torch.bfloat16):
        draft = DSparkDeepseekV4ForCausalLM(vllm_config=vc)
    draft.load_weights((n, t) for n, t in tensors.items() if n.startswith("mtp."))
    return draft, vc


def test_draft_from_the_quantised_files_is_the_twin_draft_bit_for_bit(models, monkeypatch):
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    real, real_vc = _loaded_draft(*models["real"], monkeypatch)
    twin, twin_vc = _loaded_draft(*models["twin"], monkeypatch)
    real_params, twin_params = dict(real.named_parameters()), dict(twin.named_parameters())
    scales = {n for n in real_params if n.endswith(("weight_scale_inv", "weight_scale"))}
    assert set(real_params) - scales == set(twin_params)
    assert {n.rsplit(".", 1)[0] for n in scales} >= {"main_proj", "context_wkv_proj"}
    block = real.main_proj.weight_block_size
    for name, want in twin_params.items():
        got = real_params[name]
        module = name.rsplit(".", 1)[0]
        if got.dtype == torch.float8_e4m3fn:
            scale = real_params[f"{module}.weight_scale_inv"]
            assert list(block) == [128, 128]
            got = cq.dequantize_fp8_block(got.data, scale.data)
        elif name.endswith(("w13_weight", "w2_weight")):
            scale = real_params[f"{name}_scale"]
            got = torch.stack([vllm_mxfp4_reference(w, s) for w, s in zip(got, scale, strict=True)])
        assert got.dtype == want.dtype and torch.equal(got, want), name
    # The grouped wo_a the attention multiplies with, taken before the FP8 kernel runs.
    for vc, draft in ((real_vc, real), (twin_vc, twin)):
        with set_current_vllm_config(vc):
            process_weights_after_loading(draft, vc.model_config, torch.device("cpu"))
    for a, b in zip(real.layers, twin.layers, strict=True):
        assert torch.equal(a.attn._wo_a_grouped, b.attn._wo_a_grouped)
    # Same weights, other kernels (torch W8A16 and MXFP4 vs vLLM's bf16 CPU GEMMs and
    # fused MoE): the layers agree to bf16 rounding.
    s = real.shape
    gen = torch.Generator().manual_seed(2)
    aux = torch.randn(24, s.hidden_size * len(s.target_layer_ids), generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, s.vocab_size, (24,), generator=gen)
    outs = {}
    for key, draft, vc in (("real", real, real_vc), ("twin", twin, twin_vc)):
        with torch.inference_mode(), set_current_vllm_config(vc), set_forward_context(None, vc):
            projected = draft.main_proj(aux)
            outs[key] = (projected, draft.layers[0].ffn(draft.main_norm(projected), ids))
    for got, want in zip(outs["real"], outs["twin"], strict=True):
        ulps = float((got.float() - want.float()).abs().max() / _bf16_step(want))
        print(f"real vs twin layer output: {ulps:.2f} bf16 steps")
        assert ulps <= 4, ulps


def _bf16_step(t: torch.Tensor) -> float:
    """One bf16 rounding step at the largest magnitude of ``t``."""
    return float(t.float().abs().max()) * 2.0**-7
