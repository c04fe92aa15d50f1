"""In-process V1 engines whose arguments come from a recipe profile (demo, benchmarks, runners)."""

from __future__ import annotations

from pathlib import Path

from scripts import recipe


class ChunkedPrefillOff(RuntimeError):
    """vLLM switched chunked prefill off: the overlay, which keeps it on, is not applied."""


def engine_kwargs(
    profile: str = "cpu-tiny",
    *,
    model: str | Path | None = None,
    speculative: bool = True,
    demo: bool = True,
    **overrides,
) -> dict:
    """``EngineArgs`` keywords of ``profile`` (with its ``demo`` section unless ``demo=False``);
    ``model`` and ``overrides`` replace the profile's values."""
    kwargs = recipe.engine_args(recipe.load_profile(profile), speculative=speculative, demo=demo)
    if model is not None:
        kwargs["model"] = str(model)
    kwargs.update(overrides)
    return kwargs


def make_engine(kwargs: dict):
    """An in-process ``LLMEngine``; refuses one without chunked prefill (overlay not applied)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
    if not engine.vllm_config.scheduler_config.enable_chunked_prefill:
        raise ChunkedPrefillOff(
            "vLLM turned chunked prefill off for DeepSeek-V4 on this CPU; the overlay keeps "
            "it on: is it applied (make setup)?"
        )
    return engine
