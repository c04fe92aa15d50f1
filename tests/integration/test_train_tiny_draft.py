"""scripts/tiny/train_tiny_draft.py: the held-out acceptance it reports, and its training batches.

The acceptance simulation is checked against drafts whose outcome is known by
construction (every slot right, only the first slot right, nothing right), on sequences
built from a known next-token map; the batches against the positions they must cover.
"""

from __future__ import annotations

import json

import pytest
import torch

from scripts.tiny import train_tiny_draft as ttd
from scripts.tiny.draft_twin import TwinBlock
from scripts.tiny.target_traces import Trace, random_prompts, text_prompts

N, V, W, H = 4, 32, 8, 6


def successor(tokens: torch.Tensor) -> torch.Tensor:
    """The next-token map the fake target follows."""
    return (tokens * 5 + 3) % V


def _traces(count: int = 3, prompt_len: int = 5, length: int = 30) -> list[Trace]:
    out = []
    for i in range(count):
        seq = [i + 1]
        for _ in range(length - 1):
            seq.append(int(successor(torch.tensor(seq[-1]))))
        tokens = torch.tensor(seq[: length - i])  # different lengths
        aux = torch.randn(tokens.numel(), H).to(torch.bfloat16)
        out.append(Trace(tokens, prompt_len, aux, torch.zeros(tokens.numel(), V).bfloat16()))
    return out


class FakeTwin:
    """Drafts through the Markov head only: slot k right iff ``right[k]``."""

    def __init__(self, right: list[bool]):
        self.right = right
        self.block_size, self.window = N, W
        self.slot = 0

    def main_x(self, aux):
        return aux.float()

    def context_kv(self, main_x, positions):
        return main_x[:, None, :]

    def block(self, anchors, anchor_positions, ctx, mask):
        assert ctx.shape == (1, anchors.shape[0], W, H) and mask.shape == (anchors.shape[0], W)
        # Context cells must be the W positions right before each anchor.
        assert bool((mask.sum(1) == anchor_positions.clamp(max=W)).all())
        self.slot = 0
        zeros = torch.zeros(anchors.shape[0], N, V)
        return TwinBlock(head_hidden=torch.zeros(anchors.shape[0], N, 2), base_logits=zeros)

    def markov_embed(self, prev):
        return prev

    def markov_bias(self, prev):
        right = self.right[self.slot]
        self.slot += 1
        tokens = successor(prev) if right else (successor(prev) + 1) % V
        return torch.nn.functional.one_hot(tokens, V).float()

    def confidence(self, hidden, embeds):
        return torch.full((hidden.shape[0],), 0.5)


@pytest.mark.parametrize(
    ("right", "length", "per_position"),
    [
        ([True] * N, N + 1.0, [1.0] * N),
        ([True, False, True, True], 2.0, [1.0, 0.0, 0.0, 0.0]),
        ([False] * N, 1.0, [0.0] * N),
    ],
)
def test_acceptance_counts_the_accepted_prefix_per_step(right, length, per_position):
    corpus = ttd.Corpus(_traces(), N)
    result = ttd.simulate_acceptance(FakeTwin(right), corpus)
    assert result["acceptance_length"] == pytest.approx(length)
    assert result["per_position_acceptance"] == pytest.approx(per_position)
    # Steps: from the first generated token, each advances by accepted + 1 while N labels remain.
    advance = int(length)
    expected = sum(len(range(5, int(n) - N, advance)) for n in corpus.lengths.tolist())
    assert result["steps"] == expected
    assert result["predicted_survival"] == pytest.approx([0.5**k for k in range(1, N + 1)])


def test_anchors_are_generated_positions_with_n_labels():
    traces = _traces()
    corpus = ttd.Corpus(traces, N)
    want = {(i, p) for i, t in enumerate(traces) for p in range(t.prompt_len, t.tokens.numel() - N)}
    got = {tuple(pair) for pair in corpus.anchor_pairs.tolist()}
    assert got == want


def test_context_cells_are_the_window_before_the_anchor():
    kv_all = torch.arange(2 * 20, dtype=torch.float32).view(2, 20, 1, 1).expand(2, 20, 1, 3)
    twin = FakeTwin([True] * N)
    ctx, mask = ttd.context_cells(twin, kv_all, torch.tensor([1, 0]), torch.tensor([12, 3]))
    assert ctx.shape == (1, 2, W, 3)
    assert ctx[0, 0, :, 0].tolist() == [20.0 + p for p in range(4, 12)]
    assert mask[1].tolist() == [False] * 5 + [True] * 3
    assert ctx[0, 1, 5:, 0].tolist() == [0.0, 1.0, 2.0]


def test_recorded_training_is_reused_only_with_the_same_settings(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    args = ttd.parse_args(["--model", str(tmp_path), "--steps", "7"])
    wanted = ttd.settings(args)
    assert ttd.recorded(tmp_path, wanted) is None
    (tmp_path / ttd.RECORD).write_text(json.dumps({"settings": wanted}))
    assert ttd.recorded(tmp_path, wanted) == {"settings": wanted}
    assert ttd.recorded(tmp_path, {**wanted, "steps": 8}) is None


def test_bad_arguments_name_the_option(tmp_path, capsys):
    with pytest.raises(SystemExit):
        ttd.parse_args(["--model", str(tmp_path)])
    assert "no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit):
        ttd.parse_args(["--model", str(tmp_path), "--steps", "0"])
    assert "--steps must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ttd.parse_args(["--model", str(tmp_path), "--text-share", "1.5"])
    assert "--text-share must be in [0, 1], got 1.5" in capsys.readouterr().err


def test_text_prompts_are_seeded_bos_led_cuts_of_the_lines():
    lines = ["ab", "cde", "f"]
    encode = lambda s: [ord(c) for c in s]  # noqa: E731
    first = text_prompts(3, 20, lines, encode, bos=0)
    assert first == text_prompts(3, 20, lines, encode, bos=0)
    assert first != text_prompts(4, 20, lines, encode, bos=0)
    assert all(p[0] == 0 and 1 <= len(p) <= 300 for p in first)
    assert len({len(p) for p in first}) > 10
    words = {ord(c) for c in "abcdef "}
    assert all(set(p[1:]) <= words for p in first)


def test_training_then_held_out_prompts_each_split_by_text_share(tmp_path):
    from tokenizers import Tokenizer

    from scripts.tiny import make_tiny_model

    make_tiny_model.write_tokenizer(tmp_path, 1024, 0, 4096)
    (tmp_path / "config.json").write_text("{}")
    cfg = {"vocab_size": 1024, "bos_token_id": 0}
    args = ttd.parse_args(["--model", str(tmp_path), "--sequences", "8", "--held-out", "4"])
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    rand = random_prompts(0, 6, 1024, ttd.FIRST_ORDINARY_ID, 0)
    encode = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    text = text_prompts(0, 6, make_tiny_model.corpus_lines(0), encode, 0)
    want = rand[:4] + text[:4] + rand[4:] + text[4:]  # training, then held-out
    assert ttd.training_prompts(args, cfg, tmp_path) == want
    none = ttd.parse_args(["--model", str(tmp_path), "--sequences", "8", "--text-share", "0"])
    assert ttd.training_prompts(none, cfg, tmp_path) == random_prompts(0, 40, 1024, 9, 0)


def test_training_again_starts_from_the_generated_draft(tmp_path):
    generated = {"mtp.0.w": torch.arange(6.0).view(2, 3), "layers.0.w": torch.ones(2)}
    first = ttd.initial_draft(tmp_path, generated)
    assert set(first) == {"mtp.0.w"} and torch.equal(first["mtp.0.w"], generated["mtp.0.w"])
    # After a training the checkpoint holds the trained draft; a second training must not
    # start from it.
    trained = {"mtp.0.w": torch.full((2, 3), 9.0), "layers.0.w": torch.ones(2)}
    (tmp_path / ttd.RECORD).write_text("{}")
    again = ttd.initial_draft(tmp_path, trained)
    assert torch.equal(again["mtp.0.w"], torch.arange(6.0).view(2, 3))
    assert not list(tmp_path.glob("*.safetensors")), "vLLM would load it as weights"


def test_a_trained_draft_without_its_generated_draft_is_refused(tmp_path):
    (tmp_path / ttd.RECORD).write_text("{}")
    with pytest.raises(SystemExit, match=ttd.INITIAL_DRAFT):
        ttd.initial_draft(tmp_path, {"mtp.0.w": torch.ones(2)})
    assert not (tmp_path / ttd.INITIAL_DRAFT).exists()
