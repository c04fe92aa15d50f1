"""The draft block as replayed graphs (``dspark_graphs``) drafts what the eager block does.

No GPU here: ``support.fake_cuda_graph`` stands in for vLLM's CUDAGraphWrapper with a
graph's replay semantics (captured input buffers, captured outputs overwritten), so the
static-buffer plumbing of the proposer is what is tested. Two proposers over one draft,
one eager and one graphed, get the same steps; their drafts, draft probabilities and
confidences must be equal (same shapes, same ops: bitwise on the same machine).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm.v1.spec_decode.dspark.graphs import DraftBlockGraphs, draft_graphs_wanted
from vllm.v1.spec_decode.dspark.step_plan import DSparkStepInput

from tests.support.fake_cuda_graph import FakeCUDAGraph
from tests.support.tiny import build_draft, ensure_tiny_model, make_proposer


@pytest.fixture(scope="module")
def env():
    return build_draft(ensure_tiny_model())


def use_graphs(p, wrap=FakeCUDAGraph):
    """The proposer's draft-block graphs, with ``wrap`` standing in for vLLM's wrapper."""
    p.use_draft_graphs(wrap)


def _steps(width, vocab, gen):
    """(req ids, [(first pos, rows, rejected)], sampled) per step; sizes 3, 3, 4, 1."""
    plans = [
        (["a", "b", "c"], [(0, 20, 0), (0, 7, 0), (0, 5, 0)], False),
        (["a", "b", "c"], [(20, 5, 2), (7, 5, 0), (5, 5, 4)], True),
        (["c", "a", "d", "b"], [(6, 5, 1), (23, 5, 0), (0, 30, 0), (12, 5, 3)], True),
        (["a"], [(28, 5, 2)], False),
    ]
    for req_ids, segments, sampled in plans:
        qsl, pos = [0], []
        for first, rows, _ in segments:
            qsl.append(qsl[-1] + rows)
            pos.extend(range(first, first + rows))
        num = len(req_ids)
        yield DSparkStepInput(
            req_ids=req_ids,
            query_start_loc_cpu=np.array(qsl),
            num_draft_tokens=np.array([s[2] for s in segments]),
            prefilling=np.zeros(num, bool),
            positions=torch.tensor(pos),
            aux_hidden_states=torch.randn(qsl[-1], width, generator=gen).to(torch.bfloat16),
            num_rejected=torch.tensor([s[2] for s in segments]),
            next_token_ids=torch.randint(0, vocab, (num,), generator=gen),
            temperature=torch.full((num,), 0.8) if sampled else None,
            temperature_cpu=np.full(num, 0.8) if sampled else None,
            request_seeds=[7 + i for i in range(num)] if sampled else None,
        )


@pytest.mark.parametrize("probabilistic", [False, True])
def test_graphed_draft_block_drafts_like_the_eager_one(env, probabilistic):
    draft, vc = env
    eager = make_proposer(draft, vc, probabilistic=probabilistic)
    graphed = make_proposer(draft, vc, probabilistic=probabilistic)
    assert eager.graphs is None  # CPU: never graphed unless asked
    use_graphs(graphed)
    graphed.dummy_run(1, is_graph_capturing=True)
    fake = graphed.graphs.graph
    assert graphed.graphs.captured == set(graphed.draft_sizes) == {1, 2, 4, 8}
    assert len(fake.entries) == len(graphed.draft_sizes)

    shape = draft.shape
    width = shape.hidden_size * len(shape.target_layer_ids)
    gen = torch.Generator().manual_seed(3)
    for step in _steps(width, shape.vocab_size, gen):
        want = eager.propose(step)
        want_probs, want_conf = eager.take_last_draft_probs(), eager.last_confidence
        got = graphed.propose(step)
        assert torch.equal(got, want)
        got_probs = graphed.take_last_draft_probs()
        assert (got_probs is None) == (want_probs is None) == (not probabilistic)
        if probabilistic:
            assert torch.equal(got_probs, want_probs)
        if want_conf is not None:
            assert torch.equal(graphed.last_confidence, want_conf)
    assert fake.replays == 4


def test_replay_needs_the_captured_buffers(env):
    """The stand-in refuses inputs that are not the captured buffers: the check can fail."""
    draft, vc = env
    p = make_proposer(draft, vc)
    use_graphs(p)
    p.dummy_run(1, is_graph_capturing=True)
    graphs = p.graphs

    def run_without_buffers(self, slots, anchors, anchor_pos, temperature, race_noise):
        with self._context(slots.shape[0]):
            return self.graph(slots, anchors, anchor_pos, temperature, race_noise)

    graphs.run = run_without_buffers.__get__(graphs, DraftBlockGraphs)
    shape = draft.shape
    width = shape.hidden_size * len(shape.target_layer_ids)
    step = next(_steps(width, shape.vocab_size, torch.Generator().manual_seed(1)))
    with pytest.raises(RuntimeError, match="not the captured buffers"):
        p.propose(step)


def test_graphs_only_on_cuda_with_graphs_on(env, monkeypatch):
    _, vc = env
    assert not draft_graphs_wanted(vc, torch.device("cpu"))
    # The test config is eager (enforce_eager=True): no graphs on CUDA either.
    assert not draft_graphs_wanted(vc, torch.device("cuda"))
    monkeypatch.setattr(vc.model_config, "enforce_eager", False)
    from vllm.config import CUDAGraphMode

    monkeypatch.setattr(vc.compilation_config, "cudagraph_mode", CUDAGraphMode.FULL_AND_PIECEWISE)
    assert draft_graphs_wanted(vc, torch.device("cuda"))
    monkeypatch.setenv("DSPARK_DRAFT_CUDAGRAPH", "0")
    assert not draft_graphs_wanted(vc, torch.device("cuda"))


def test_failed_capture_leaves_the_block_eager(env, monkeypatch):
    import vllm.v1.spec_decode.dspark.proposer as proposer_module

    draft, vc = env
    warnings = []
    monkeypatch.setattr(
        proposer_module.logger, "warning", lambda msg, *args: warnings.append(msg % args)
    )

    class FailingGraph(FakeCUDAGraph):
        def __call__(self, *args):
            from vllm.forward_context import get_forward_context

            if get_forward_context().batch_descriptor is not None:
                raise RuntimeError("operation not permitted when stream is capturing")
            return super().__call__(*args)

    p = make_proposer(draft, vc)
    use_graphs(p, FailingGraph)
    p.dummy_run(1, is_graph_capturing=True)
    assert p.graphs is None
    assert len(warnings) == 1 and "capture failed (RuntimeError" in warnings[0]
    shape = draft.shape
    step = next(_steps(shape.hidden_size * len(shape.target_layer_ids), shape.vocab_size,
                       torch.Generator().manual_seed(2)))
    assert p.propose(step).shape == (3, p.num_speculative_tokens)
