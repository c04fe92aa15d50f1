"""The DSpark draft's tensor contract at the published size, on the meta device.

    python -m tests.support.draft_contract --config CONFIG.json --tp N --rank R --port P \
        --out REPORT.json [--drop NAME] [--rename OLD=NEW]

Builds the overlay's draft from ``CONFIG`` (no weights: every parameter on the meta
device) as TP rank ``R`` of ``N`` (gloo), then loads the published checkpoint's ``mtp.*``
tensors as meta tensors through the draft's own ``load_weights``: every name must map to
a parameter, every vLLM weight loader checks the shard shapes, and the draft's
completeness check names any parameter left unwritten. The checkpoint's names, shapes and
dtypes come from the config (``make_tiny_model.draft_tensors`` + ``checkpoint_quant``).
The report holds the outcome (or the error), the parameters and the bytes this rank holds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

STAGES = 3  # the published checkpoint has no n_mtp_layers key


def checkpoint_tensors(cfg: dict) -> dict:
    """The published ``mtp.*`` tensors for ``cfg`` as meta tensors (names, shapes, dtypes)."""
    import torch

    from scripts.tiny import checkpoint_quant, make_tiny_model

    class MetaInit(make_tiny_model._Init):
        def __init__(self) -> None:
            self.torch = torch

        def normal(self, shape, std, dtype=None):
            return torch.empty(shape, dtype=dtype or torch.bfloat16, device="meta")

    bf16 = make_tiny_model.draft_tensors(MetaInit(), cfg, STAGES)
    return checkpoint_quant.to_real_format(bf16)[0]


def build_and_load(model_dir: Path, tp: int, rank: int, port: int, cases: dict) -> dict:
    """Each case (name -> checkpoint tensors) into a fresh meta draft; outcome per case."""
    import torch
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.utils.torch_utils import set_default_torch_dtype

    mc = ModelConfig(
        model=str(model_dir),
        dtype="bfloat16",
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=4096,
    )
    vc = VllmConfig(model_config=mc, parallel_config=ParallelConfig(tensor_parallel_size=tp))
    report = {}
    with set_current_vllm_config(vc):
        init_distributed_environment(
            world_size=tp,
            rank=rank,
            local_rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            backend="gloo",
        )
        initialize_model_parallel(tp, 1)
        from vllm.models.deepseek_v4.cpu.dspark import DSparkDeepseekV4ForCausalLM

        for case, weights in cases.items():
            vc.compilation_config.static_forward_context = {}
            with set_default_torch_dtype(torch.bfloat16), torch.device("meta"):
                draft = DSparkDeepseekV4ForCausalLM(vllm_config=vc)
            try:
                loaded = draft.load_weights(weights)
                outcome = {"ok": True, "loaded": sorted(loaded)}
            except (ValueError, AssertionError, RuntimeError, KeyError) as e:
                outcome = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            report[case] = outcome
    report["params"] = {n: [list(p.shape), str(p.dtype)] for n, p in draft.named_parameters()}
    report["bytes"] = sum(p.numel() * p.element_size() for p in draft.parameters())
    report["layers"] = len(draft.layers)
    return report


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, type=Path)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--drop", default=None, help="case 'drop': this checkpoint tensor left out")
    ap.add_argument("--rename", default=None, help="case 'rename': OLD=NEW, one tensor renamed")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = json.loads(args.config.read_text())
    tensors = checkpoint_tensors(cfg)
    cases = {"full": list(tensors.items())}
    if args.drop:
        cases["drop"] = [(n, t) for n, t in tensors.items() if n != args.drop]
    if args.rename:
        old, new = args.rename.split("=", 1)
        cases["rename"] = [(new if n == old else n, t) for n, t in tensors.items()]
    model_dir = Path(tempfile.mkdtemp(prefix="draft-contract-"))
    try:
        shutil.copyfile(args.config, model_dir / "config.json")
        report = build_and_load(model_dir, args.tp, args.rank, args.port, cases)
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    report["checkpoint"] = {n: [list(t.shape), str(t.dtype)] for n, t in tensors.items()}
    args.out.write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
