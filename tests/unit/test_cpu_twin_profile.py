"""recipe/profiles/cpu-2x.yaml is spark-2x with only its device- and model-bound keys changed.

The rehearsal (`make rehearse`) proves the two-Spark launch on CPU only as far as the two
profiles agree, so every key in which they differ is listed here with its reason; any other
difference (a serving knob changed in one profile and not in the other) fails.
"""

from __future__ import annotations

from scripts import recipe
from tests.support.profile_keys import flat_keys, raw_profile

# key -> why it may differ between the Sparks and their CPU twin
DEVICE_BOUND = {
    "name": "the profile's own name",
    "description": "the profile's own description",
    "device": "cuda on the Sparks, cpu here",
    "model.id": "the tiny generated checkpoint instead of DeepSeek-V4-Flash-DSpark",
    "model.revision": "a local checkpoint has no hub revision",
    "model.dtype": "the tiny checkpoint is bf16 (auto picks FP8 on the Sparks)",
    "model.kv_cache_dtype": "fp8_ds_mla needs the CUDA sparse-MLA kernels",
    "model.trust_remote_code": "the real checkpoint ships code, the tiny one none",
    "serving.max_model_len": "the tiny model's size",
    "serving.max_num_batched_tokens": "memory/compute knob: a smaller chunk on CPU",
    "serving.enforce_eager": "no CUDA graphs on CPU",
    "serving.attention_backend": "vLLM's CPU DeepSeek-V4 backend",
    "speculative.num_speculative_tokens": "the tiny checkpoint's DSpark block size (4, not 5)",
    "speculative.checkpoint_block_size": "the tiny checkpoint's DSpark block size (4, not 5)",
    "env.VLLM_CPU_KVCACHE_SPACE": "memory knob: KV cache GiB per CPU node",
}


def differing_keys(a: dict, b: dict) -> set[str]:
    fa, fb = flat_keys(a), flat_keys(b)
    return {k for k in fa.keys() | fb.keys() if fa.get(k, KeyError) != fb.get(k, KeyError)}


def test_cpu_twin_differs_from_spark_only_in_device_bound_keys():
    drift = differing_keys(raw_profile("spark-2x"), raw_profile("cpu-2x"))
    assert drift - DEVICE_BOUND.keys() == set(), "keys that drifted between the profiles"
    assert DEVICE_BOUND.keys() - drift == set(), "listed keys that no longer differ: unlist them"


def test_drift_detection_sees_a_serving_knob_and_a_new_key():
    spark, twin = raw_profile("spark-2x"), raw_profile("cpu-2x")
    twin["serving"]["max_num_seqs"] += 1
    twin["speculative"]["extra"] = 1
    assert differing_keys(spark, twin) - DEVICE_BOUND.keys() == {
        "serving.max_num_seqs",
        "speculative.extra",
    }


def test_cpu_twin_runs_the_spark_launch():
    """What the rehearsal must exercise as the Sparks do, asserted on the loaded profile."""
    twin = recipe.load_profile("cpu-2x")
    assert twin["device"] == "cpu"
    assert twin["parallel"]["tensor_parallel_size"] == 2 and twin["parallel"]["nnodes"] == 2
    srv, spec = twin["serving"], twin["speculative"]
    assert srv["async_scheduling"] and srv["enable_prefix_caching"]
    assert spec["method"] == "dspark" and spec["draft_sample_method"] == "probabilistic"
    argv = recipe.serve_argv(twin, node_rank=1, master_addr="10.99.0.1")
    assert "--async-scheduling" in argv and "--headless" in argv
