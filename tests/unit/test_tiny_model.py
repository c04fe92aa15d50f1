"""scripts/tiny/make_tiny_model.py: a tiny DeepSeek-V4 (+DSpark) checkpoint in DeepSeek's layout."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from scripts.tiny import make_tiny_model as mtm
from tests.support.paths import REPO
from tests.support.tiny import generate_tiny_model


def make(out: Path, *args: str) -> Path:
    return generate_tiny_model(out, *args)


def tensors(model: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_tensor(k).dtype) for k in f.keys()}


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make(tmp_path_factory.mktemp("m") / "tiny")


def test_config_uses_deepseek_fields_and_cpu_kernel_sizes(base):
    cfg = json.loads((base / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV4ForCausalLM"]
    assert cfg["model_type"] == "deepseek_v4"
    assert cfg["torch_dtype"] == "bfloat16"
    assert (cfg["head_dim"], cfg["qk_rope_head_dim"], cfg["index_head_dim"]) == (512, 64, 128)
    assert (cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["index_topk"]) == (64, 6, 512)
    assert cfg["compress_ratios"] == [0, 4, 128]
    assert cfg["num_hidden_layers"] == 3
    assert cfg["rope_scaling"]["rope_type"] == "yarn"
    assert "quantization_config" not in cfg
    assert not any(k.startswith("dspark_") for k in cfg) and "n_mtp_layers" not in cfg


def test_weights_have_deepseek_names_shapes_and_dtypes(base):
    cfg = json.loads((base / "config.json").read_text())
    t = tensors(base)
    H, V, hc, E = cfg["hidden_size"], cfg["vocab_size"], cfg["hc_mult"], cfg["n_routed_experts"]
    heads, hd, ql = cfg["num_attention_heads"], cfg["head_dim"], cfg["q_lora_rank"]
    mix = (2 + hc) * hc
    assert t["embed.weight"] == ((V, H), torch.bfloat16)
    assert t["head.weight"] == ((V, H), torch.bfloat16)
    assert t["hc_head_fn"] == ((hc, hc * H), torch.float32)
    assert t["hc_head_base"] == ((hc,), torch.float32)
    assert t["hc_head_scale"] == ((1,), torch.float32)
    assert not any(k.startswith("mtp.") for k in t)
    for i, ratio in enumerate(cfg["compress_ratios"]):
        p = f"layers.{i}"
        assert t[f"{p}.hc_attn_fn"] == ((mix, hc * H), torch.float32)
        assert t[f"{p}.hc_ffn_scale"] == ((3,), torch.float32)
        assert t[f"{p}.attn.wq_a.weight"] == ((ql, H), torch.bfloat16)
        assert t[f"{p}.attn.wq_b.weight"] == ((heads * hd, ql), torch.bfloat16)
        assert t[f"{p}.attn.wkv.weight"] == ((hd, H), torch.bfloat16)
        og, ol = cfg["o_groups"], cfg["o_lora_rank"]
        assert t[f"{p}.attn.wo_a.weight"] == ((og * ol, heads * hd // og), torch.bfloat16)
        assert t[f"{p}.attn.attn_sink"] == ((heads,), torch.float32)
        has_comp = any(k.startswith(f"{p}.attn.compressor.") for k in t)
        has_idx = any(k.startswith(f"{p}.attn.indexer.") for k in t)
        assert has_comp == (ratio > 1) and has_idx == (ratio == 4)
        if ratio > 1:
            coff = 2 if ratio == 4 else 1
            assert t[f"{p}.attn.compressor.ape"] == ((ratio, coff * hd), torch.float32)
            assert t[f"{p}.attn.compressor.wkv.weight"][0] == (coff * hd, H)
        if ratio == 4:
            assert t[f"{p}.attn.indexer.compressor.ape"][0] == (4, 2 * 128)
            assert t[f"{p}.attn.indexer.wq_b.weight"][0] == (cfg["index_n_heads"] * 128, ql)
        experts = {k.split(".")[4] for k in t if k.startswith(f"{p}.ffn.experts.")}
        assert len(experts) == E
        if i < cfg["num_hash_layers"]:
            assert t[f"{p}.ffn.gate.tid2eid"] == ((V, cfg["num_experts_per_tok"]), torch.int32)
            assert f"{p}.ffn.gate.bias" not in t
        else:
            assert t[f"{p}.ffn.gate.bias"] == ((E,), torch.float32)


def test_hash_routing_table_picks_distinct_valid_experts(base):
    with safe_open(str(base / "model.safetensors"), "pt") as f:
        tid2eid = f.get_tensor("layers.0.ffn.gate.tid2eid")
    assert int(tid2eid.min()) >= 0 and int(tid2eid.max()) < 64
    assert all(len(set(row)) == len(row) for row in tid2eid.tolist())


def test_dspark_fields_and_draft_weights(dspark):
    cfg = json.loads((dspark / "config.json").read_text())
    H, V, hc, L = cfg["hidden_size"], cfg["vocab_size"], cfg["hc_mult"], cfg["num_hidden_layers"]
    assert cfg["dspark_block_size"] == 4  # recipe/profiles/cpu-tiny.yaml checkpoint_block_size
    assert cfg["dspark_target_layer_ids"] == [0, 1, 2]
    assert cfg["dspark_markov_rank"] == 32
    assert cfg["dspark_noise_token_id"] == 3
    assert cfg["n_mtp_layers"] == 2 and cfg["enable_confidence_head"] is True
    # like DeepSeek-V4-Flash-DSpark: one (pure SWA) compress ratio per draft stage
    assert cfg["compress_ratios"] == [0, 4, 128, 0, 0]
    t = tensors(dspark)
    r, taps = cfg["dspark_markov_rank"], len(cfg["dspark_target_layer_ids"])
    assert t["mtp.0.main_proj.weight"] == ((H, taps * H), torch.bfloat16)
    assert t["mtp.0.main_norm.weight"] == ((H,), torch.bfloat16)
    assert "mtp.1.main_proj.weight" not in t
    for j in range(2):
        assert t[f"mtp.{j}.attn.wkv.weight"][0] == (512, H)
        assert t[f"mtp.{j}.attn.kv_norm.weight"][0] == (512,)
        assert t[f"mtp.{j}.hc_attn_fn"][0] == ((2 + hc) * hc, hc * H)
        assert t[f"mtp.{j}.ffn.gate.bias"][0] == (64,)
        assert not any(
            k.startswith((f"mtp.{j}.attn.compressor", f"mtp.{j}.attn.indexer")) for k in t
        )
    last = "mtp.1"
    assert t[f"{last}.norm.weight"][0] == (H,)
    assert t[f"{last}.hc_head_fn"] == ((hc, hc * H), torch.float32)
    assert t[f"{last}.hc_head_base"][0] == (hc,) and t[f"{last}.hc_head_scale"][0] == (1,)
    assert t[f"{last}.markov_head.markov_w1.weight"] == ((V, r), torch.bfloat16)
    assert t[f"{last}.markov_head.markov_w2.weight"] == ((V, r), torch.bfloat16)
    assert t[f"{last}.confidence_head.proj.weight"] == ((1, H + r), torch.float32)
    assert not any(k.startswith("mtp.0.markov_head") or k == "mtp.0.norm.weight" for k in t)
    # the target part is the same as without --dspark (same config, same seed)
    assert L == 3 and t["layers.2.attn.compressor.ape"][0] == (128, 512)


def test_dspark_options(tmp_path):
    out = make(
        tmp_path / "m",
        "--dspark",
        "--layers",
        "4",
        "--compress-ratios",
        "4,0,128,0",
        "--mtp-layers",
        "1",
        "--block-size",
        "5",
        "--markov-rank",
        "16",
        "--target-layer-ids",
        "1,3",
        "--no-confidence-head",
    )
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["compress_ratios"] == [4, 0, 128, 0, 0]
    assert cfg["dspark_block_size"] == 5 and cfg["dspark_target_layer_ids"] == [1, 3]
    assert cfg["enable_confidence_head"] is False
    t = tensors(out)
    assert t["mtp.0.main_proj.weight"][0] == (256, 2 * 256)
    assert t["mtp.0.markov_head.markov_w1.weight"][0] == (1024, 16)
    assert "mtp.0.hc_head_fn" in t and not any("confidence_head" in k for k in t)
    assert "layers.0.attn.indexer.weights_proj.weight" in t


def test_same_seed_same_bytes_other_seed_other_weights(base, tmp_path):
    again = make(tmp_path / "again")
    assert digest(again) == digest(base)
    other = make(tmp_path / "other", "--seed", "1")
    d_other, d_base = digest(other), digest(base)
    assert d_other["model.safetensors"] != d_base["model.safetensors"]
    assert d_other["config.json"] == d_base["config.json"]


def test_tokenizer_is_local_and_matches_the_config(dspark):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(dspark))
    cfg = json.loads((dspark / "config.json").read_text())
    assert len(tok) <= cfg["vocab_size"]
    assert tok.bos_token_id == cfg["bos_token_id"] == 0
    assert tok.eos_token_id == cfg["eos_token_id"] == 1
    assert tok.convert_tokens_to_ids("<｜dspark_noise｜>") == cfg["dspark_noise_token_id"]
    ids = tok("The quick brown fox jumps over the lazy dog.").input_ids
    assert ids[0] == 0 and len(ids) > 3
    assert (
        tok.decode(ids, skip_special_tokens=True) == "The quick brown fox jumps over the lazy dog."
    )
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.startswith("<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜>")


def test_refuses_a_non_empty_output_without_force(base, tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit, match="not empty; pass --force"):
        mtm.main(["--out", str(out), "--quiet"])
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    make(out, "--force")
    assert digest(out) == digest(base)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_empty_output_dir_is_fine_and_failures_leave_nothing(tmp_path, monkeypatch):
    out = tmp_path / "empty"
    out.mkdir()
    make(out)
    assert (out / "model.safetensors").is_file()

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(mtm, "build_tensors", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        mtm.main(["--out", str(tmp_path / "failed"), "--quiet"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_o_groups_for_tp4(tmp_path):
    """TP=4 needs o_groups divisible by 4: vLLM gives each rank o_groups / TP of them."""
    cfg_tensors = tensors(make(tmp_path / "m", "--o-groups", "4"))
    # wo_a: o_groups x o_lora_rank rows, heads / o_groups x head_dim columns (4 x 128, 512)
    assert cfg_tensors["layers.0.attn.wo_a.weight"][0] == (4 * 128, 1 * 512)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["o_groups"] == 4


@pytest.mark.parametrize(
    "args, message",
    [
        (["--compress-ratios", "0,8,128"], "each ratio must be one of"),
        (["--compress-ratios", "0,4"], "expected --layers=3"),
        (["--experts", "8"], "invalid choice"),
        (["--topk", "4"], "invalid choice"),
        (["--dspark", "--target-layer-ids", "0,3"], "--target-layer-ids must be in"),
        (["--num-heads", "3"], "--num-heads must be even"),
        (["--o-groups", "3"], "--o-groups must divide --num-heads=4"),
        (["--bf16-twin", "twin"], "--bf16-twin needs --format real"),
        (["--dspark", "--format", "real", "--mtp-layers", "2"], "3 stages as published"),
        (["--dspark", "--format", "real", "--no-confidence-head"], "has a confidence head"),
    ],
)
def test_bad_options_are_refused(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        mtm.main(["--out", str(tmp_path / "m"), *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_cli_prints_progress(tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.tiny.make_tiny_model",
            "--out",
            str(tmp_path / "m"),
            "--layers",
            "1",
            "--compress-ratios",
            "0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "[1/3] training tokenizer" in res.stdout and "wrote" in res.stdout
