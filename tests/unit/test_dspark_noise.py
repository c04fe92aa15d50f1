"""Tests for keyed draft noise (overlay/.../common/dspark/noise.py).

Oracle: the keyed formula written out here in int64 lanes, one elementwise op at a time, as
the module computed it before it became one fused pass (a 32-bit MurmurHash3-style mix of seed
low, seed high, position + salt + slot, token; ``-log((h + 0.5) / 2**32)`` in float64, then
float32). Equal means bit for bit: a seeded request must draft what it drafted before.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.overlay import load_overlay_module
from tests.support.paths import REPO

noise = load_overlay_module("vllm/models/deepseek_v4/common/dspark/noise.py")

U32 = 0xFFFFFFFF
SALT = 1 << 30  # written out, not read from the module


def _rotl(x, r):
    return ((x << r) | (x >> (32 - r))) & U32


def _mix(h, key):
    key = (key * 0xCC9E2D51) & U32
    key = _rotl(key, 15)
    key = (key * 0x1B873593) & U32
    h = _rotl(h ^ key, 13)
    return (h * 5 + 0xE6546B64) & U32


def _finalise(h):
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & U32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & U32
    return h ^ (h >> 16)


def _uniform(seeds, positions, vocab):
    h = _mix(torch.zeros_like(seeds), seeds & U32)
    h = _mix(h, (seeds >> 32) & U32)
    h = _mix(h, positions & U32)
    tokens = torch.arange(vocab, dtype=torch.int64)
    h = _finalise(_mix(h[:, None], tokens[None, :]) ^ 16)
    return (h.to(torch.float64) + 0.5) * 2.0**-32


def oracle_race_noise(seeds, anchor_pos, n, vocab):
    keys = anchor_pos.to(torch.int64) + SALT
    u = torch.stack([_uniform(seeds.to(torch.int64), keys + k, vocab) for k in range(n)], 1)
    return (-torch.log(u)).to(torch.float32)


EDGE_SEEDS = [0, 1, -1, 2**63 - 1, -(2**63), 2**32 - 1, 2**32, -(2**32), 0x5DEECE66D]
EDGE_POSITIONS = [0, 1, 2**31 - 1, 2**32 - SALT - 1, 2**32 - SALT, 2**40 + 3, 131071]


@pytest.mark.parametrize("vocab", [1, 7, 1000, 129280])
def test_edge_keys_equal_the_formula(vocab):
    """Seed 0 and the int64 extremes, position 0 and positions whose key wraps 2**32 (salt
    and slot added), every token up to the last id."""
    seeds = torch.tensor([s for s in EDGE_SEEDS for _ in EDGE_POSITIONS])
    pos = torch.tensor(EDGE_POSITIONS * len(EDGE_SEEDS))
    rows = slice(None) if vocab < 129280 else slice(0, 9)  # big vocab: fewer rows
    got = noise.keyed_race_noise(seeds[rows], pos[rows], 5, vocab)
    assert got.shape == (pos[rows].shape[0], 5, vocab) and got.dtype == torch.float32
    assert torch.equal(got, oracle_race_noise(seeds[rows], pos[rows], 5, vocab))


@pytest.mark.parametrize("trial", range(3))
def test_random_keys_equal_the_formula(trial):
    g = torch.Generator().manual_seed(trial)
    rows = int(torch.randint(1, 12, (), generator=g))
    n = int(torch.randint(1, 8, (), generator=g))
    vocab = int(torch.randint(1, 40000, (), generator=g))
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=g)
    pos = torch.randint(0, 2**20, (rows,), generator=g)
    got = noise.keyed_race_noise(seeds, pos, n, vocab)
    assert torch.equal(got, oracle_race_noise(seeds, pos, n, vocab))


def test_spark_shape_equals_the_formula():
    """The Spark's draft shapes: 10 requests, 5 slots, V=129,280."""
    g = torch.Generator().manual_seed(7)
    seeds = torch.randint(-(2**63), 2**63 - 1, (10,), generator=g)
    pos = torch.randint(0, 2**17, (10,), generator=g)
    got = noise.keyed_race_noise(seeds, pos, 5, 129280)
    assert torch.equal(got, oracle_race_noise(seeds, pos, 5, 129280))


def test_a_row_draws_the_same_alone_or_in_any_batch_row():
    seeds = torch.tensor([5, 9, 5, -3])
    pos = torch.tensor([10, 10, 11, 0])
    full = noise.keyed_race_noise(seeds, pos, 3, 500)
    alone = noise.keyed_race_noise(seeds[2:3], pos[2:3], 3, 500)
    assert torch.equal(alone[0], full[2])
    flipped = noise.keyed_race_noise(seeds.flip(0), pos.flip(0), 3, 500)
    assert torch.equal(flipped.flip(0), full)
    # Slot k of anchor p is slot k-1 of anchor p+1: the key is the position, not the slot.
    assert torch.equal(full[2, 0], full[0, 1])
    assert not torch.equal(full[0], full[1])  # another seed, another stream


def test_draws_are_exponential():
    """Mean 1 and variance 1 of Exp(1) over 40,000 draws (5 sigma bounds)."""
    e = noise.keyed_race_noise(torch.arange(8) * 7919, torch.arange(8), 5, 1000).double()
    assert (e > 0).all()
    n = e.numel()
    assert abs(e.mean().item() - 1.0) < 5 * math.sqrt(1.0 / n)
    assert abs(e.var().item() - 1.0) < 5 * math.sqrt(8.0 / n)


def test_no_rows_give_an_empty_block():
    got = noise.keyed_race_noise(torch.zeros(0, dtype=torch.int64),
                                 torch.zeros(0, dtype=torch.int64), 4, 10)
    assert got.shape == (0, 4, 10)


@pytest.mark.parametrize(
    "args,message",
    [
        ((torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), 4, 10),
         "seeds and anchor_positions must both be"),
        ((torch.zeros(2, 1, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.int64), 4, 10),
         "seeds and anchor_positions must both be"),
        ((torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), 0, 10),
         "block_len and vocab_size must be >= 1"),
        ((torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), 4, 0),
         "block_len and vocab_size must be >= 1"),
    ],
)
def test_bad_input_is_named(args, message):
    with pytest.raises(ValueError, match=message):
        noise.keyed_race_noise(*args)


# ------------------------------------------------- the CUDA kernel, run by Triton's interpreter

ORACLE_DIR = Path(os.environ.get("TRITON_ORACLE_DIR", REPO / ".cache/triton-oracle"))
TRITON_CHILD = """
import json, sys, torch
from tests.support.overlay import load_overlay_module
noise = load_overlay_module("vllm/models/deepseek_v4/common/dspark/noise.py")
seeds, pos, n, vocab = json.loads(sys.argv[1])
seeds, pos = torch.tensor(seeds), torch.tensor(pos)
out = torch.empty(len(seeds), n, vocab)
noise._race_noise_triton(seeds, pos + noise.DRAFT_NOISE_SALT, out)
torch.save(out, sys.argv[2])
"""


def test_triton_kernel_equals_the_formula_under_the_interpreter(tmp_path):
    """The CUDA path's kernel, run by stock Triton's interpreter on the host (no GPU here):
    32-bit lanes, the row / slot / vocabulary-block grid, the mask of the last block."""
    if not (ORACLE_DIR / "triton").is_dir():
        pytest.skip(f"stock Triton not installed in {ORACLE_DIR} (make test installs it)")
    seeds = [0, -1, 2**63 - 1, -(2**63), 12345]
    pos = [0, 2**32 - SALT - 1, 7, 2**40 + 3, 131071]
    n, vocab = 3, 2500  # not a multiple of the 1024-token block
    out = tmp_path / "out.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ORACLE_DIR), str(REPO)])}
    subprocess.run([sys.executable, "-c", TRITON_CHILD, json.dumps([seeds, pos, n, vocab]),
                    str(out)], cwd=REPO, env=env, check=True, timeout=600)
    want = oracle_race_noise(torch.tensor(seeds), torch.tensor(pos), n, vocab)
    assert torch.equal(torch.load(out), want)
