"""`make ab`'s summary line and per-position acceptance (scripts/bench/ab.py), not timings.

Oracle: decode rates and spec-decode counters written here, so each ratio is known by hand.
"""

from __future__ import annotations

import pytest

from scripts.bench import ab


def _level(content, c, rate, spec=None):
    return {"content": content, "prompt_len": 128, "concurrency": c,
            "server_decode_tok_s": rate, "spec_decode": spec,
            "vllm_bench": {"output_throughput": rate, "p50_ttft_ms": 1, "p99_ttft_ms": 1,
                           "p50_itl_ms": 1, "p99_itl_ms": 1}}


def _ab():
    spec = {"num_drafts": 10, "num_draft_tokens": 50, "num_accepted_tokens": 15,
            "accepted_per_position": [8, 4, 2, 1, 0]}
    dspark = [_level("prose", 1, 20.0, spec), _level("code", 1, 45.0, spec),
              _level("prose", 4, 30.0, spec), _level("code", 4, 30.0, spec)]
    plain = [_level("prose", 1, 10.0), _level("code", 1, 20.0),
             _level("prose", 4, 60.0), _level("code", 4, 60.0)]
    a = {"name": "dspark", "result": {"levels": dspark}}
    b = {"name": "no-spec", "result": {"levels": plain}}
    out = {"a": a, "b": b}
    out["ratios"] = ab.ratio_table(a["result"], b["result"])
    return out


def test_speed_is_the_geometric_mean_of_a_over_b_per_concurrency():
    speed = ab.speed_by_concurrency(_ab())
    assert speed[1] == pytest.approx((2.0 * 2.25) ** 0.5)
    assert speed[4] == pytest.approx(0.5)


def test_summary_line_names_dspark_and_plain():
    assert ab.summary_line(_ab()) == "ab: DSpark/plain c=1 2.12x, c=4 0.50x"


def test_per_position_acceptance_per_concurrency():
    lines = ab.position_lines(_ab())
    assert lines[0] == ("- dspark c=1: acceptance length 2.50, per position "
                        "[0.80, 0.40, 0.20, 0.10, 0.00]")
    assert len(lines) == 2  # c=1 and c=4 of the speculating side only
