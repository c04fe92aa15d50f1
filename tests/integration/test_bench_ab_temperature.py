"""The tiny checkpoint's default sampling as vLLM reads it, and the temperature `make ab` states.

Oracles: vLLM's own reading of a generation config (``ModelConfig.get_diff_sampling_param``,
the server's default sampling parameters) and generation_config.json files written here.
"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

from scripts import recipe
from scripts.bench import ab
from scripts.tiny.make_tiny_model import write_generation_config


def _vllm_default_sampling(folder) -> dict:
    """What ``vllm serve --generation-config FOLDER`` takes as its default sampling."""
    from vllm.config.model import ModelConfig

    cfg = SimpleNamespace(generation_config=str(folder), override_generation_config={},
                          trust_remote_code=False, code_revision=None, config_format="auto",
                          hf_token=None)
    cfg.try_get_generation_config = lambda: ModelConfig.try_get_generation_config(cfg)
    return ModelConfig.get_diff_sampling_param(cfg)


def test_vllm_serves_the_tiny_checkpoint_greedy_by_default(tmp_path):
    assert write_generation_config(tmp_path) is True
    assert _vllm_default_sampling(tmp_path) == {"temperature": 0.0}
    assert write_generation_config(tmp_path) is False  # already there: not rewritten
    # A checkpoint made before the default (no temperature): vLLM serves it at 1.0 ...
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert _vllm_default_sampling(tmp_path) == {}
    assert write_generation_config(tmp_path) is True  # ... until it is rewritten
    assert _vllm_default_sampling(tmp_path) == {"temperature": 0.0}


def _profile_at(folder, **serving):
    profile = copy.deepcopy(recipe.load_profile("cpu-tiny"))
    profile["model"]["id"] = str(folder)
    profile["serving"].update(serving)
    return profile


def test_ab_states_the_temperature_its_requests_run_at(tmp_path):
    assert ab.stated_temperature(0.6, _profile_at(tmp_path)) == "0.6 (--temperature)"
    assert "not local" in ab.stated_temperature(None, _profile_at(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    assert ab.stated_temperature(None, _profile_at(tmp_path)).startswith("0 (the server's default")
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert ab.stated_temperature(None, _profile_at(tmp_path)).startswith("1 (the server's default")
    flags = ["--generation-config", "vllm"]
    assert "serving.extra_args" in ab.stated_temperature(None, _profile_at(tmp_path, extra_args=flags))


def test_the_tiny_checkpoints_ensure_leaves_the_twin_alone(tmp_path):
    """The demo ensures its profile's checkpoint; for the memory-bound twin (served at 0.8,
    its membound.json beside it) that once rewrote the twin to greedy, so every later
    `make ab` on the twin ran at temperature 0, and retrained its draft with the tiny
    model's settings (with train=False here: the twin's folder must stay as it was)."""
    from scripts.tiny.ensure import ensure_tiny_model
    from scripts.tiny.membound import RECORD, TEMPERATURE

    twin, tiny = tmp_path / "twin", tmp_path / "tiny"
    for folder in (twin, tiny):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        write_generation_config(folder, TEMPERATURE)
    (twin / RECORD).write_text("{}")
    before = {f.name: f.read_bytes() for f in twin.iterdir()}
    assert ensure_tiny_model(twin, train=True) == twin.resolve()  # no training started
    ensure_tiny_model(tiny, train=False)
    assert {f.name: f.read_bytes() for f in twin.iterdir()} == before
    assert _vllm_default_sampling(twin) == {"temperature": TEMPERATURE}
    assert _vllm_default_sampling(tiny) == {"temperature": 0.0}


def test_the_tiny_checkpoint_is_ensured_by_one_process_at_a_time(tmp_path):
    """A second caller waits while another generates or trains the same checkpoint."""
    import fcntl
    import threading

    from scripts.tiny.ensure import ensure_tiny_model

    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "config.json").write_text("{}")
    done = threading.Event()
    with open(tmp_path / ".tiny.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        worker = threading.Thread(target=lambda: (ensure_tiny_model(tiny, train=False), done.set()))
        worker.start()
        assert not done.wait(1.0)  # blocked behind the holder
    worker.join(30)
    assert done.is_set()
    assert _vllm_default_sampling(tiny) == {"temperature": 0.0}
