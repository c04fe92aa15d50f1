"""Tear an in-process engine down so a runner can start the next one in the same process."""

from __future__ import annotations

import gc


def release_engine_memory() -> None:
    """Free what the last engine held (its caches, its distributed state); call after the
    caller dropped its last reference to the engine."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()
