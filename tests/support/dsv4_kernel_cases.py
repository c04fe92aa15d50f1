"""DeepSeek-V4 metadata-kernel scenarios, run through vLLM's own launchers.

Used by tests/integration/test_dsv4_cpu_kernels.py in subprocesses (one vLLM import each),
from the repo root:

  PYTHONPATH=ORACLE_DIR python -m tests.support.dsv4_kernel_cases oracle --out R.json
      Triton interpreter (TRITON_INTERPRET=1, the stock triton in ORACLE_DIR, which the
      product venv never holds) runs every scenario, then the
      torch implementations (module at PATH) are registered through vLLM's dispatcher and
      the same scenarios run again; every output buffer is compared.
  python -m tests.support.dsv4_kernel_cases overlay --out R.json
      No Triton: the (overlay-patched) CpuPlatform registers its kernel overrides and the
      scenarios run through them.

Each scenario calls the launchers the way the DeepSeek-V4 metadata builders do
(sparse_swa.py, indexer.py, compressor_utils.py, ops/metadata.py) on randomized batches:
empty, single-token, decode-only, mixed prefill/decode with padding, SWA-window (128) and
compression (4 / 128) boundaries, SWA replay starts, image visibility, DCP and query slices.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from scripts.dev.triton_interpreter import use_triton_interpreter
from tests.support.overlay import load_overlay_module

IMPL_REL = "vllm/v1/attention/ops/torch_metadata_kernels.py"

# Family of each scenario output (the kernel whose launch writes it).
KERNELS = (
    "token_request_mapping",
    "swa_indices_and_lens",
    "dspark_noncausal_swa_indices",
    "prefill_metadata",
    "compressed_slot_mapping",
    "prepare_uniform_decode",
    "build_prefill_chunk_metadata",
)

WINDOW = 128


@dataclass
class Batch:
    name: str
    reqs: list[tuple[int, int]]  # (prefix_len, query_len), decodes first
    num_decodes: int
    pad_tokens: int = 0
    block_size: int = 64
    replay: bool = False
    drop_slots: bool = False
    image: bool = False
    seed: int = 0
    extra: dict = field(default_factory=dict)


def batches() -> list[Batch]:
    rng = random.Random(1234)
    out = [
        Batch("empty", [], 0),
        Batch("padding_only", [], 0, pad_tokens=3),
        Batch("single_first_token", [(0, 1)], 1),
        Batch("single_decode_at_window", [(128, 1)], 1),
        Batch("single_prefill_token", [(0, 1)], 0),
        Batch(
            "window_boundaries",
            [(126, 1), (127, 1), (128, 1), (255, 1), (0, 127), (1, 128), (127, 2), (0, 129)],
            4,
            block_size=32,
        ),
        Batch(
            "compress_boundaries",
            [(3, 1), (127, 1), (4, 4), (124, 8), (0, 300), (252, 260)],
            2,
            block_size=128,
        ),
        Batch("chunked_prefill_mix", [(7, 1), (129, 1), (64, 64), (256, 64)], 2, pad_tokens=5),
        Batch(
            "replay_and_dropped_slots",
            [(200, 1), (300, 40), (150, 90)],
            1,
            replay=True,
            drop_slots=True,
            block_size=16,
        ),
        Batch("image_visibility", [(10, 1), (40, 70), (0, 130)], 1, image=True),
    ]
    for i in range(4):
        n_dec = rng.randint(0, 4)
        n_pre = rng.randint(0 if n_dec else 1, 3)
        reqs = [(rng.randint(0, 400), rng.randint(1, 2)) for _ in range(n_dec)]
        reqs += [(rng.randint(0, 300), rng.randint(1, 160)) for _ in range(n_pre)]
        out.append(
            Batch(
                f"random_{i}",
                reqs,
                n_dec,
                pad_tokens=rng.randint(0, 6),
                block_size=rng.choice([16, 64, 256]),
                replay=rng.random() < 0.5,
                drop_slots=rng.random() < 0.5,
                image=rng.random() < 0.5,
                seed=i,
            )
        )
    return out


def _make_inputs(b: Batch):
    import torch

    g = torch.Generator().manual_seed(b.seed * 7919 + len(b.reqs))
    R = len(b.reqs)
    q = [ql for _, ql in b.reqs]
    seq = [p + ql for p, ql in b.reqs]
    qsl = torch.zeros(R + 1, dtype=torch.int32)
    if R:
        qsl[1:] = torch.cumsum(torch.tensor(q, dtype=torch.int32), 0)
    T = int(qsl[-1])
    Tp = T + b.pad_tokens
    bs = b.block_size
    max_blocks = max([(s + bs - 1) // bs for s in seq] + [1]) + 2
    # Runner-style block table: a wider persistent buffer, rows sliced to the batch.
    table = torch.full((R + 3, max_blocks + 3), -7, dtype=torch.int32)
    perm = torch.randperm(R * max_blocks + 8, generator=g).to(torch.int32)
    if R:
        table[:R, :max_blocks] = perm[: R * max_blocks].view(R, max_blocks)
    block_table = table[:R]
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    slot = torch.full((Tp,), -1, dtype=torch.int64)
    for r, (p, ql) in enumerate(b.reqs):  # test-input construction only
        pos = torch.arange(p, p + ql)
        rows = torch.arange(int(qsl[r]), int(qsl[r + 1]))
        slot[rows] = block_table[r, pos // bs].to(torch.int64) * bs + pos % bs
    if b.drop_slots and T:
        drop = torch.randperm(T, generator=g)[: max(1, T // 7)]
        slot[drop] = -1
    replay = torch.zeros(R, dtype=torch.int32)
    if b.replay and R:
        replay = (torch.rand(R, generator=g) * torch.tensor([p for p, _ in b.reqs])).to(torch.int32)
    left = torch.randint(0, 200, (max(Tp, 1) + 8,), generator=g, dtype=torch.int32)
    right = torch.randint(0, 40, (max(Tp, 1) + 8,), generator=g, dtype=torch.int32)
    return dict(
        R=R,
        T=T,
        Tp=Tp,
        qsl=qsl,
        seq_lens=seq_lens,
        block_table=block_table,
        slot=slot,
        replay=replay,
        left=left,
        right=right,
        bs=bs,
    )


def run_batch(b: Batch) -> dict:
    """Run every launcher on one batch; return {output name: tensor}."""
    import torch
    from vllm.v1.attention.backends.mla import indexer as idx
    from vllm.v1.attention.backends.mla import sparse_swa as swa
    from vllm.v1.attention.backends.mla.compressor_utils import (
        get_compressed_slot_mapping,
        get_dspark_swa_index_width,
    )
    from vllm.v1.attention.ops.metadata import compute_token_to_req_indices

    x = _make_inputs(b)
    R, T, Tp, bs = x["R"], x["T"], x["Tp"], x["bs"]
    qsl, seq, bt, slot, replay = x["qsl"], x["seq_lens"], x["block_table"], x["slot"], x["replay"]
    max_tokens = Tp + 16
    out: dict[str, torch.Tensor] = {}
    nd = b.num_decodes
    ndt = int(qsl[nd]) if R else 0
    npf = R - nd
    npt = T - ndt

    # ops/metadata.py: token -> request
    t2r_buf = torch.full((max_tokens,), 99, dtype=torch.int32)
    t2r = compute_token_to_req_indices(qsl, t2r_buf, T, Tp)
    out["token_request_mapping/t2r"] = t2r_buf.clone()
    is_valid = slot >= 0

    # sparse_swa.py build(): decode rows into the persistent buffers, prefill rows sliced.
    dec_idx = torch.full((max_tokens, 1, WINDOW), 55, dtype=torch.int32)
    dec_lens = torch.full((max_tokens,), 55, dtype=torch.int32)
    if ndt > 0:
        dec_lens[ndt:] = 0
        swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL(
            dec_idx, dec_lens, WINDOW, dec_idx.shape[-1], dec_lens, dec_lens,
            qsl, seq, t2r, is_valid, bt, bs, replay, num_tokens=ndt, token_offset=0,
        )  # fmt: skip
    out["swa_indices_and_lens/decode_indices"] = dec_idx
    out["swa_indices_and_lens/decode_lens"] = dec_lens
    width = WINDOW + (64 if b.image else 0)
    pre_idx = torch.full((max_tokens, width), 44, dtype=torch.int32)
    pre_lens = torch.full((max_tokens,), 44, dtype=torch.int32)
    if npt > 0 or (b.pad_tokens and not R):
        n = max(npt, Tp - ndt)
        left, right = x["left"], x["right"]
        swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL(
            pre_idx[:n], pre_lens[:n], WINDOW, width,
            left if b.image else pre_lens[:n], right if b.image else pre_lens[:n],
            qsl, seq, t2r if R else torch.zeros(Tp, dtype=torch.int32), is_valid, bt, bs,
            replay, num_tokens=n, token_offset=ndt, has_image=b.image,
        )  # fmt: skip
    out["swa_indices_and_lens/prefill_indices"] = pre_idx
    out["swa_indices_and_lens/prefill_lens"] = pre_lens

    # DSpark non-causal draft rows (decode split, block of up to 5 tokens per request).
    nc_width = get_dspark_swa_index_width(WINDOW, 4)
    nc_idx = torch.full((max_tokens, 1, nc_width), 33, dtype=torch.int32)
    nc_lens = torch.full((max_tokens,), 33, dtype=torch.int32)
    if T > 0:
        swa._COMPUTE_DSPARK_NONCAUSAL_SWA_INDICES_KERNEL(
            nc_idx, nc_lens, WINDOW, nc_width, qsl, seq, t2r, is_valid, bt, bs,
            num_tokens=T, token_offset=0,
        )  # fmt: skip
    out["dspark_noncausal_swa_indices/indices"] = nc_idx
    out["dspark_noncausal_swa_indices/lens"] = nc_lens

    gather = torch.full((max(npf, 1) + 4,), 22, dtype=torch.int32)
    if npf > 0:
        swa._COMPUTE_PREFILL_METADATA_KERNEL(gather, seq, qsl, replay, npf, nd, WINDOW)
    out["prefill_metadata/gather_lens"] = gather

    # compressor_utils.py: compressed-state slots for C4A and C128A caches.
    for ratio, states_per_block in ((4, max(bs // 4, 1)), (128, 2)):
        buf = torch.full((max_tokens,), 11, dtype=torch.int64)
        if R:
            get_compressed_slot_mapping(T, slot, qsl, seq, bt, states_per_block, ratio, out=buf)
        out[f"compressed_slot_mapping/c{ratio}"] = buf

    # indexer.py prefill chunks (C4A), whole batch and a query slice, and one DCP launch.
    if npf > 0:
        cseq = seq // 4
        qsl_cpu = qsl.clone()
        for tag, qslice in (("full", None), ("slice", slice(3, max(4, npt - 2)))):
            meta = idx.build_prefill_chunk_metadata(
                nd,
                R,
                qsl,
                qsl_cpu,
                seq,
                cseq,
                cseq.clone(),
                bt,
                4,
                query_slice=qslice,
            )
            if meta is not None:
                out[f"build_prefill_chunk_metadata/{tag}_ks"] = meta.cu_seqlen_ks
                out[f"build_prefill_chunk_metadata/{tag}_ke"] = meta.cu_seqlen_ke
                out[f"build_prefill_chunk_metadata/{tag}_t2s"] = meta.token_to_seq
        sub_qsl = qsl[nd:] - qsl[nd]
        cu = torch.zeros(npf + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(cseq[nd:], 0)
        local_cu = torch.zeros(npf + 1, dtype=torch.int32)
        local_cu[1:] = torch.cumsum((cseq[nd:] + 1) // 2, 0)
        total = int(cu[-1])
        t2s = torch.full((total + 3,), -5, dtype=torch.int32)
        ks = torch.full((npt + 3,), -5, dtype=torch.int32)
        ke = torch.full((npt + 3,), -5, dtype=torch.int32)
        idx._BUILD_PREFILL_CHUNK_METADATA_KERNEL(
            sub_qsl,
            seq[nd:],
            cu,
            local_cu,
            t2s,
            ks,
            ke,
            0,
            npt,
            1,
            2,
            2,
            num_reqs=npf,
            COMPRESS_RATIO=4,
        )
        out["build_prefill_chunk_metadata/dcp_ks"] = ks
        out["build_prefill_chunk_metadata/dcp_ke"] = ke
        out["build_prefill_chunk_metadata/dcp_t2s"] = t2s

    # indexer.py decode: uniform expansion of spec-decode rows (one row per token).
    if R:
        mdl = 1 + (b.seed % 4)
        dseq = seq.clone()
        dseq[-1:] = 0  # a padding request
        n_tok = R * mdl
        dsl = torch.full((n_tok + 8,), 66, dtype=torch.int32)
        exp = torch.full((n_tok + 2, bt.shape[1] - 2), 66, dtype=torch.int32)
        dl = torch.full((n_tok + 8,), 66, dtype=torch.int32)
        idx._PREPARE_UNIFORM_DECODE_KERNEL(dseq, dsl, bt, exp, dl, n_tok, mdl)
        out["prepare_uniform_decode/seq_lens"] = dsl
        out["prepare_uniform_decode/block_table"] = exp
        out["prepare_uniform_decode/decode_lens"] = dl

    return out


def _digest(t) -> str:
    import torch

    t = t.contiguous()
    h = hashlib.sha256(str((tuple(t.shape), str(t.dtype))).encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def run_all() -> dict[str, dict[str, str]]:
    """{batch: {output: digest}} plus the tensors, for comparison in-process."""
    return {b.name: run_batch(b) for b in batches()}


def load_impl():
    """The overlay's torch metadata kernels, from this checkout."""
    return load_overlay_module(IMPL_REL)


def _overridden(names) -> dict[str, str]:
    from vllm.triton_utils.dispatcher import _resolve_kernel

    res = {}
    for name in names:
        host, attr = _resolve_kernel(name)
        res[name] = type(getattr(host, attr)).__name__
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["oracle", "overlay"])
    p.add_argument("--out", required=True, type=Path)
    a = p.parse_args(argv)
    report: dict = {"mode": a.mode}
    if a.mode == "oracle":
        use_triton_interpreter()
        from vllm.triton_utils import HAS_TRITON

        assert HAS_TRITON, "the Triton interpreter was not accepted by vLLM"
        t0 = time.perf_counter()
        reference = run_all()
        t1 = time.perf_counter()
        impl = load_impl()
        impl.register_torch_metadata_kernels()
        report["overridden"] = _overridden(impl.KERNEL_IMPLS)
        t2 = time.perf_counter()
        ours = run_all()
        t3 = time.perf_counter()
        report["seconds"] = {"triton_interpreter": t1 - t0, "torch": t3 - t2}
        cases = {}
        for name, ref in reference.items():
            got = ours[name]
            res = {}
            for key in sorted(set(ref) | set(got)):
                if key not in got or key not in ref:
                    res[key] = "missing on one side"
                elif ref[key].shape != got[key].shape or not bool((ref[key] == got[key]).all()):
                    bad = (ref[key] != got[key]).nonzero()[:3].tolist()
                    res[key] = f"mismatch at {bad}"
                else:
                    res[key] = "ok"
            cases[name] = res
        report["cases"] = cases
        report["digests"] = {n: {k: _digest(v) for k, v in o.items()} for n, o in ours.items()}
    else:
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON

        report["has_triton"] = HAS_TRITON
        current_platform.register_triton_kernel_overrides()
        impl_mod = sys.modules.get("vllm.v1.attention.ops.torch_metadata_kernels")
        report["impl_module"] = getattr(impl_mod, "__file__", None)
        names = list(getattr(impl_mod, "KERNEL_IMPLS", {}))
        report["overridden"] = _overridden(names)
        try:
            ours = run_all()
            report["digests"] = {n: {k: _digest(v) for k, v in o.items()} for n, o in ours.items()}
        except Exception as e:  # reported to the test, which asserts on it
            report["error"] = f"{type(e).__name__}: {e}"
    a.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
