"""What the DSpark draft learns from: the target's own greedy sequences, as vLLM computes them.

For each prompt the target (real vLLM, CPU build, in this process) decodes greedily; then
each whole sequence is run once more as a prompt to record, at every position, the aux
hidden states the DSpark proposer would receive (``dspark_target_layer_ids``, the mean
over hc streams of each tapped layer's output, exactly the tensors vLLM's DeepSeek-V4
model emits for a drafter) and the target's logits. Nothing of the draft is involved, so
the traces are the same whatever the draft's weights.

``collect_traces`` must run in a process without another vLLM engine (global distributed
state), with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` so the model lives in that process;
``collect_traces_in_child`` runs it in a spawned child (the engine also pins the
process's torch threads, which training should choose itself).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

__all__ = ["Trace", "collect_traces", "collect_traces_in_child", "random_prompts", "text_prompts"]


@dataclass
class Trace:
    """One sequence: ``tokens [L]`` (prompt then the target's greedy continuation)."""

    tokens: torch.Tensor  # int64 [L]
    prompt_len: int
    aux: torch.Tensor  # bf16 [L, m*H]: the proposer's input at every position
    logits: torch.Tensor  # bf16 [L, V]: row j predicts token j+1


def random_prompts(seed: int, count: int, vocab: int, first_id: int, bos: int) -> list[list[int]]:
    """``count`` prompts of 4..40 ordinary tokens after BOS, a pure function of ``seed``."""
    rng = random.Random(seed)
    return [
        [bos] + [rng.randrange(first_id, vocab) for _ in range(rng.randint(4, 40))]
        for _ in range(count)
    ]


def text_prompts(seed: int, count: int, lines: list[str], encode, bos: int) -> list[list[int]]:
    """``count`` prompts of 1..300 tokens of text after BOS, a pure function of ``seed``.

    ``lines`` are joined in a seeded order and cut at a seeded length; ``encode`` maps a
    string to token ids (no special tokens). Prompts like the demo's and a chat's, where
    the random-token ones are unlike anything served.
    """
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        length = rng.randint(1, 300)
        ids: list[int] = []
        while len(ids) < length:
            ids += encode(rng.choice(lines) + " ")
        out.append([bos] + ids[: length - 1])
    return out


class _Recorder:
    """Wraps the target model's forward: turns aux outputs on, keeps them and the logits."""

    def __init__(self, model, layer_ids: list[int]):
        self.model = model
        self.inner = model.model
        self.inner.aux_hidden_state_layers = tuple(i + 1 for i in layer_ids)
        self.forward = self.inner.forward
        self.recording = False
        self.records: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.inner.forward = self._forward

    def _forward(self, *args, **kwargs):
        out = self.forward(*args, **kwargs)
        hidden, aux = out
        if self.recording:
            logits = self.model.compute_logits(hidden)
            self.records.append((torch.cat(aux, dim=-1).clone(), logits.to(torch.bfloat16)))
        return hidden


def collect_traces(
    engine_kwargs: dict,
    prompts: list[list[int]],
    gen_len: int,
    layer_ids: list[int],
    show_progress: bool = True,
) -> list[Trace]:
    """Greedy sequences of the target for ``prompts`` with their aux states and logits."""
    from tqdm import tqdm
    from vllm import LLM, SamplingParams

    longest = max(len(p) for p in prompts) + gen_len
    # No prefix caching: the second pass must compute every row of the sequence, not only
    # those past the blocks its first pass cached (a sequence over one 256-token block).
    llm = LLM(
        **{
            **engine_kwargs,
            "max_num_batched_tokens": max(longest, 256),
            "enable_prefix_caching": False,
        }
    )
    recorders = llm.apply_model(lambda model: _Recorder(model, layer_ids))
    recorder = recorders[0]
    greedy = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=show_progress)
    once = SamplingParams(max_tokens=1, temperature=0.0)
    traces = []
    recorder.recording = True
    for prompt, out in tqdm(
        list(zip(prompts, outs, strict=True)), desc="target traces", disable=not show_progress
    ):
        seq = list(prompt) + list(out.outputs[0].token_ids)
        recorder.records.clear()
        # One request alone, whole sequence in one chunk: one forward over its L rows.
        llm.generate([{"prompt_token_ids": seq}], once, use_tqdm=False)
        ((aux, logits),) = [r for r in recorder.records if r[0].shape[0] == len(seq)][:1]
        traces.append(Trace(torch.tensor(seq), len(prompt), aux.to(torch.bfloat16), logits))
    recorder.recording = False
    del llm
    return traces


def _child(path: str, args: tuple) -> None:
    torch.save([vars(t) for t in collect_traces(*args)], path)


def collect_traces_in_child(*args) -> list[Trace]:
    """``collect_traces(*args)`` in a spawned child process."""
    import multiprocessing as mp
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="target-traces-") as tmp:
        path = str(Path(tmp) / "traces.pt")
        proc = mp.get_context("spawn").Process(target=_child, args=(path, args))
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"collecting target traces failed (child exit {proc.exitcode})")
        return [Trace(**t) for t in torch.load(path)]
