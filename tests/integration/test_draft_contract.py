"""The DSpark draft against the published checkpoint's tensor contract, at full size.

No weights: the draft is built on the meta device from the published config values
(``fixtures/dsv4_flash_dspark_config.json``: 3 stages, 256 experts, FP8 block + MXFP4) at
TP=1 and as both ranks of TP=2, and the checkpoint's ``mtp.*`` names, shapes and dtypes
(generated from the config) go through its own ``load_weights`` (``support/
draft_contract.py``). Every name must reach a parameter, vLLM's loaders check every shard
shape, and a parameter or expert left unwritten is named. The checkpoint side is checked
against an independent census of the published files (tensors per stage).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.net import free_port
from tests.support.paths import FIXTURES, REPO

pytestmark = pytest.mark.dist

CONFIG = FIXTURES / "dsv4_flash_dspark_config.json"
DROPPED = "mtp.1.ffn.experts.200.w2.scale"
RENAMED = ("mtp.0.main_proj.scale", "mtp.0.main_proj.weight_scale")
# Tensors per stage in the published shards (mtp.0 adds main_proj + main_norm, mtp.2 the
# head stack, Markov and confidence heads).
CENSUS = {"mtp.0": 1568, "mtp.1": 1565, "mtp.2": 1572}


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict:
    """TP=1 (with a dropped and a renamed tensor) and both TP=2 ranks, run at once."""
    out = tmp_path_factory.mktemp("contract")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    base = [sys.executable, "-m", "tests.support.draft_contract", "--config", str(CONFIG)]
    tp1 = [*base, "--port", str(free_port()), "--out", str(out / "tp1.json"),
           "--drop", DROPPED, "--rename", "=".join(RENAMED)]
    port = str(free_port())
    runs = {"tp1": tp1}
    for rank in (0, 1):
        runs[f"tp2_rank{rank}"] = [*base, "--tp", "2", "--rank", str(rank), "--port", port,
                                   "--out", str(out / f"tp2_rank{rank}.json")]
    # vLLM's CPU communicator names its shared-memory group after VLLM_DIST_IDENT.
    env["VLLM_DIST_IDENT"] = f"draft-contract-{port}"
    procs = {k: subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 text=True) for k, cmd in runs.items()}
    for key, proc in procs.items():
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{key} failed:\n{err[-4000:]}"
    return {k: json.loads((out / f"{k}.json").read_text()) for k in runs}


def test_checkpoint_side_matches_the_published_census(reports):
    ckpt = reports["tp1"]["checkpoint"]
    for stage, count in CENSUS.items():
        assert sum(n.startswith(f"{stage}.") for n in ckpt) == count, stage
    assert ckpt["mtp.0.main_proj.weight"] == [[4096, 12288], "torch.float8_e4m3fn"]
    assert ckpt["mtp.0.main_proj.scale"] == [[32, 96], "torch.float8_e8m0fnu"]
    assert ckpt["mtp.1.ffn.experts.7.w1.weight"] == [[2048, 2048], "torch.int8"]
    assert ckpt["mtp.1.ffn.experts.7.w1.scale"] == [[2048, 128], "torch.float8_e8m0fnu"]
    assert ckpt["mtp.1.ffn.experts.7.w2.weight"] == [[4096, 1024], "torch.int8"]
    assert ckpt["mtp.2.attn.wo_a.scale"] == [[64, 32], "torch.float8_e8m0fnu"]
    assert ckpt["mtp.2.markov_head.markov_w1.weight"] == [[129280, 256], "torch.bfloat16"]
    assert ckpt["mtp.2.confidence_head.proj.weight"] == [[1, 4352], "torch.bfloat16"]
    assert ckpt["mtp.0.attn.attn_sink"] == [[64], "torch.float32"]
    assert not any(".main_proj." in n for n in ckpt if not n.startswith("mtp.0."))


@pytest.mark.parametrize("key", ["tp1", "tp2_rank0", "tp2_rank1"])
def test_every_tensor_reaches_a_parameter_and_every_parameter_is_written(reports, key):
    report = reports[key]
    assert report["full"]["ok"], report["full"]
    assert report["layers"] == 3
    assert set(report["full"]["loaded"]) == set(report["params"])
    assert report["params"]["main_proj.weight_scale_inv"] == [[32, 96], "torch.float8_e8m0fnu"]
    print(f"{key}: draft holds {report['bytes'] / 2**30:.2f} GiB")


def test_tp2_ranks_hold_halves_of_the_experts_and_the_whole_attention(reports):
    tp1, r0, r1 = (reports[k]["params"] for k in ("tp1", "tp2_rank0", "tp2_rank1"))
    assert r0 == r1 and set(r0) == set(tp1)
    w13 = "layers.0.ffn.experts.routed_experts.w13_weight"
    assert tp1[w13][0] == [256, 2 * 2048, 2048] and r0[w13][0] == [256, 2048, 2048]
    down = "layers.1.ffn.shared_experts.down_proj.weight"
    assert tp1[down][0] == [4096, 2048] and r0[down][0] == [4096, 1024]
    assert r0["layers.2.attn.wq_b.weight"] == tp1["layers.2.attn.wq_b.weight"]
    assert reports["tp2_rank0"]["bytes"] < reports["tp1"]["bytes"]


def test_a_dropped_or_renamed_tensor_fails_with_its_name(reports):
    tp1 = reports["tp1"]
    assert not tp1["drop"]["ok"] and "layers.1.ffn.experts.200.w2.weight_scale" in tp1["drop"]["error"]
    assert not tp1["rename"]["ok"] and repr(RENAMED[1]) in tp1["rename"]["error"]
