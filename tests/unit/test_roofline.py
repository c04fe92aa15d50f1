"""The roofline's byte counts against an independent oracle: the tensors of the tiny
checkpoint (every name and shape the real checkpoint has, in bf16), read from its
safetensors header; KV bytes and step ranges against hand-computed values."""

from __future__ import annotations

import copy
import json
import math
import random
import re
import struct

import pytest

from scripts import recipe
from scripts.bench import roofline
from tests.support.paths import REPO
from tests.support.tiny import ensure_tiny_model

DTYPE_BYTES = {"BF16": 2, "F32": 4, "I32": 4, "I64": 8}
# TP-sharded (column/row-parallel) tensors; everything else is replicated on every GPU.
SHARDED = re.compile(r"\.attn\.(wq_b|wo_a|wo_b)\.weight$|shared_experts\.|^head\.weight$")


@pytest.fixture(scope="module")
def tensors() -> dict[str, int]:
    """name -> bytes, from the checkpoint file's header."""
    path = ensure_tiny_model() / "model.safetensors"
    with path.open("rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    header.pop("__metadata__", None)
    return {k: math.prod(v["shape"]) * DTYPE_BYTES[v["dtype"]] for k, v in header.items()}


def tiny(tp: int = 1) -> roofline.Model:
    profile = copy.deepcopy(recipe.load_profile("cpu-tiny"))
    profile["parallel"]["tensor_parallel_size"] = tp
    config, _ = roofline.load_config(profile, None)
    return roofline.build(config, profile)


def _read_per_step(name: str) -> bool:
    """Tensors a step reads whole: not the embedding (rows gathered), not the routed experts
    (counted per expert picked), not tid2eid / Markov W1 (rows gathered)."""
    return not (name == "embed.weight" or ".experts." in name or "tid2eid" in name
                or "markov_w1" in name or "confidence_head" in name)


def test_one_routed_expert_is_exactly_its_three_matrices(tensors):
    one = sum(tensors[f"layers.0.ffn.experts.0.w{i}.weight"] for i in (1, 2, 3))
    assert tiny().expert == one
    assert tiny(tp=2).expert == one / 2


def test_dense_bytes_are_the_checkpoint_tensors_a_step_reads(tensors):
    """Left out by design: norms, biases, attention sinks (under 0.5% here, less on the real
    model, whose matrices are 16x wider); never more than the checkpoint holds."""
    target = sum(b for k, b in tensors.items() if not k.startswith("mtp.") and _read_per_step(k))
    m = tiny()
    assert target * 0.995 < m.dense <= target
    draft = sum(b for k, b in tensors.items()
                if k.startswith("mtp.") and _read_per_step(k) and "markov" not in k)
    draft += tensors["head.weight"]  # the draft's logits come from the target's head
    assert draft * 0.995 < m.draft_dense <= draft
    assert m.markov == tensors["mtp.1.markov_head.markov_w2.weight"]


def test_tensor_parallel_halves_exactly_the_sharded_tensors(tensors):
    sharded = sum(b for k, b in tensors.items() if not k.startswith("mtp.") and SHARDED.search(k))
    assert tiny(1).dense - tiny(2).dense == pytest.approx(sharded / 2, rel=1e-12)


def test_kv_bytes_hand_computed():
    """Tiny: layers C0, C4, C128; window 128; bf16 KV slot = 512 x 2 bytes; indexer 128."""
    m = tiny()
    slot = 1024
    ctx = 64  # inside the window; 16 C4 entries (all under top-512), no C128 entry yet
    assert roofline.kv_bytes(m, ctx) == 3 * ctx * slot + 16 * slot + 16 * 128
    ctx = 4096  # window 128 each; C4: top-512 of 1024 + indexer 1024 keys; C128: 32 entries
    assert roofline.kv_bytes(m, ctx) == 3 * 128 * slot + 512 * slot + 1024 * 128 + 32 * slot


def test_distinct_experts_matches_a_simulation():
    m = tiny()
    assert roofline.distinct_experts(m, 1) == pytest.approx(m.topk)
    rng = random.Random(0)
    trials = 4000
    seen = [len({e for _ in range(5) for e in rng.sample(range(m.experts), m.topk)})
            for _ in range(trials)]
    mean = sum(seen) / trials
    sd = (sum((x - mean) ** 2 for x in seen) / trials) ** 0.5
    assert roofline.distinct_experts(m, 5) == pytest.approx(mean, abs=4 * sd / trials**0.5)


def test_step_ranges_and_predicted_rates():
    m = tiny()
    decode_low, decode_high = roofline.step_bytes(m, 1, 64, speculative=False)
    experts = len(m.layers) * m.expert * roofline.distinct_experts(m, 1)
    assert decode_low == decode_high == m.dense + roofline.kv_bytes(m, 64) + experts
    low, high = roofline.step_bytes(m, 2, 64, speculative=True)
    assert decode_high < low < high
    p = roofline.predict(m, 100.0, 2, 64, acceptance_length=3.0)
    assert p["decode_tok_s"] == 2 * 100e9 / roofline.step_bytes(m, 2, 64, False)[0]
    assert p["tok_s_low"] == 2 * 3.0 * 100e9 / high
    assert p["tok_s_high"] == 2 * 3.0 * 100e9 / low
    assert "tok_s_low" not in roofline.predict(m, 100.0, 2, 64, acceptance_length=None)


def test_readme_holds_the_spark_table_the_command_prints(capsys):
    assert roofline.main(["--profile", "spark-2x", "--acceptance", "2.74", "4.4"]) == 0
    table = capsys.readouterr().out.split("\n\n")[1].strip()
    assert table in (REPO / "scripts/bench/README.md").read_text()


def test_readme_holds_the_four_spark_limits_the_command_prints(capsys):
    assert roofline.main(["--profile", "spark-4x"]) == 0
    limits = capsys.readouterr().out.split("\n\n")[2].strip().splitlines()
    assert limits[1].startswith("limit TP=4 c=1 prose (accept len 2.74): decode ")
    assert limits[2].startswith("limit TP=4 c=1 code (accept len 4.40): decode ")
    readme = (REPO / "scripts/bench/README.md").read_text()
    assert all(line in readme for line in limits)


def test_tp4_divides_exactly_the_sharded_tensors_and_replicates_the_rest(tensors):
    """Oracle: the checkpoint's tensors, split by name into sharded and replicated."""
    sharded = sum(b for k, b in tensors.items() if not k.startswith("mtp.") and SHARDED.search(k))
    assert tiny(1).dense - tiny(4).dense == pytest.approx(sharded * 3 / 4, rel=1e-12)
    assert tiny(4).replicated == pytest.approx(tiny(1).dense - sharded, rel=1e-12)
    assert tiny(4).replicated == tiny(1).replicated  # no TP divides it
    assert tiny(4).expert == tiny(1).expert / 4


def test_collectives_of_a_tp4_step_hand_computed():
    """Tiny at TP=4: 3 layers, hidden 256, vocab 1024, k=4, 2 draft layers; bf16 messages.
    Target pass: 2 x 3 + 1 = 7 all-reduces of rows x 256 x 2 bytes, each 2 x 3/4 of it per
    GPU, and 3/4 of the rows x 1024 x 2 bytes of logits gathered; 8 collectives. Draft block:
    2 x 2 + 1 = 5 all-reduces and one gather over k = 4 rows."""
    m = tiny(4)
    decode = 7 * 1.5 * (1 * 256 * 2) + 0.75 * (1 * 1024 * 2)  # 6912 bytes
    assert decode == 6912
    got = roofline.fabric_seconds(m, 1, False, fabric_gbs=1.0, latency_us=10.0)
    assert got == pytest.approx(8 * 10e-6 + 6912 / 1e9, rel=1e-12)
    target = 7 * 1.5 * (5 * 256 * 2) + 0.75 * (5 * 1024 * 2)  # 34560
    draft = 5 * 1.5 * (4 * 256 * 2) + 0.75 * (4 * 1024 * 2)  # 21504
    got = roofline.fabric_seconds(m, 1, True, fabric_gbs=1.0, latency_us=10.0)
    assert got == pytest.approx((8 + 6) * 10e-6 + (target + draft) / 1e9, rel=1e-12)
    assert roofline.fabric_seconds(tiny(1), 1, True, 1.0, 10.0) == 0.0


def test_limit_is_bytes_at_the_bandwidth_plus_the_collectives():
    m = tiny(4)
    comm = roofline.fabric_seconds(m, 1, True, 1.0, 10.0)
    low, high = roofline.step_bytes(m, 1, 64, speculative=True)
    got = roofline.limit(m, 100.0, 1.0, 10.0, 1, 64, 3.0)
    assert got["tok_s_low"] == pytest.approx(3.0 / (high / 100e9 + comm), rel=1e-12)
    assert got["tok_s_high"] == pytest.approx(3.0 / (low / 100e9 + comm), rel=1e-12)
    # without collectives (TP=1) the limit is the roofline's prediction
    m1 = tiny(1)
    free = roofline.limit(m1, 100.0, 1.0, 10.0, 1, 64, 3.0)
    pred = roofline.predict(m1, 100.0, 1, 64, 3.0)
    assert free["tok_s_low"] == pytest.approx(pred["tok_s_low"], rel=1e-12)
    assert free["decode_tok_s"] == pytest.approx(pred["decode_tok_s"], rel=1e-12)


def test_tp_flag_overrides_the_profile(capsys):
    assert roofline.main(["--profile", "spark-2x", "--tp", "4"]) == 0
    by_flag = capsys.readouterr().out.split("\n", 1)[1]
    assert roofline.main(["--profile", "spark-4x"]) == 0
    assert capsys.readouterr().out.split("\n", 1)[1] == by_flag
    assert roofline.main(["--profile", "spark-2x", "--fabric-gbs", "0"]) == 2
    assert "--fabric-gbs must be > 0" in capsys.readouterr().err


def test_bad_arguments_are_named(capsys, tmp_path):
    assert roofline.main(["--profile", "spark-2x", "--config", str(tmp_path / "none.json")]) == 2
    assert "config.json: none at" in capsys.readouterr().err
    assert roofline.main(["--acceptance", "0.5"]) == 2
    assert "--acceptance must be >= 1" in capsys.readouterr().err
