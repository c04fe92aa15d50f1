"""The target model without speculation, in a child process: the greedy oracle's engine.

The demo and the end-to-end tests need the plain target beside a DSpark engine: to score
outputs by teacher forcing, to draft the target's own greedy continuation (oracle drafts)
and to decode a greedy reference. Two vLLM engines must not share one process (global
distributed and config state), so this one runs in a spawned child and answers calls over a
pipe. ``env`` perturbs the child's numerics (``ONEDNN_MAX_CPU_ISA``, ``OMP_NUM_THREADS``)
without touching the parent's engine.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from typing import Any

from scripts.verify.teacher_forcing import (
    EPSILON_NATS,
    OracleReport,
    prompt_logprobs,
    teacher_force,
)

# In-process vLLM on CPU without network: what the child needs, unless the caller says else.
ENGINE_ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def _serve(conn, engine_kwargs: dict[str, Any]) -> None:
    """Child: build the plain target, answer (method, args) until ``close``."""
    try:
        from vllm import LLM

        llm = LLM(**engine_kwargs)
        conn.send(("ok", None))
    except Exception:  # the parent raises it with the child's traceback
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        method, args = conn.recv()
        if method == "close":
            return
        try:
            call = {"greedy": _greedy, "prompt_logprobs": prompt_logprobs}.get(
                method, teacher_force
            )
            conn.send(("ok", call(llm, *args)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


def _greedy(llm, prefixes: list[list[int]], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prefixes], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


class PlainTarget:
    """Handle on the child's plain-target engine; use as a context manager."""

    def __init__(self, engine_kwargs: dict[str, Any], env: dict[str, str] | None = None):
        """``engine_kwargs``: ``vllm.LLM`` arguments (``model`` included, no speculation)."""
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # At TP > 1 the child starts vLLM's rank processes, which a daemonic process may not
        # have; it still ends with the parent: its pipe closes and recv() raises.
        daemon = engine_kwargs.get("tensor_parallel_size", 1) == 1
        self._proc = ctx.Process(target=_serve, args=(child, engine_kwargs), daemon=daemon)
        env = {**{k: os.environ.get(k, v) for k, v in ENGINE_ENV_DEFAULTS.items()}, **(env or {})}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            self._proc.start()  # a spawned child copies os.environ at start
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        child.close()
        self._answer("starting the plain target")

    def _answer(self, what: str):
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"plain target died while {what} (exit {self._proc.exitcode})")
        if status != "ok":
            raise RuntimeError(f"plain target failed while {what}:\n{value}")
        return value

    def greedy(self, prefixes: list[list[int]], max_tokens: int) -> list[list[int]]:
        """The target's greedy continuation (``max_tokens`` tokens) of each prefix."""
        self._conn.send(("greedy", (prefixes, max_tokens)))
        return self._answer("decoding greedily")

    def prompt_logprobs(
        self, sequences: list[list[int]], top: int, alone: bool = False
    ) -> list[list[dict[int, float] | None]]:
        """``teacher_forcing.prompt_logprobs`` on the child's engine."""
        self._conn.send(("prompt_logprobs", (sequences, top, alone)))
        return self._answer("scoring prompt logprobs")

    def teacher_force(
        self,
        prompts: list[list[int]],
        outputs: list[list[int]],
        reference_outputs: list[list[int]] | None = None,
        epsilon: float = EPSILON_NATS,
    ) -> OracleReport:
        """``teacher_forcing.teacher_force`` on the child's engine."""
        self._conn.send(("teacher_force", (prompts, outputs, reference_outputs, epsilon)))
        return self._answer("scoring by teacher forcing")

    def close(self) -> None:
        if self._proc.is_alive():
            self._conn.send(("close", None))
            self._proc.join(timeout=60)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()

    def __enter__(self) -> PlainTarget:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
