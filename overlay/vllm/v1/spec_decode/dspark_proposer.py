"""DSpark proposer for vLLM's V1 model runner (CPU and GPU).

One call per engine step, after the target has verified the previous drafts:

1. Release the ring rows of finished / preempted requests; map this step's request ids to
   stable ring rows (``SlotTable``: KV follows the request id, never the batch row).
2. Ingest the step's context rows: ``main_x`` from the target's aux hidden states, then
   every draft layer's latent KV, stored into the request's ring. Only accepted rows are
   written (rejected verify rows never); uniform steps take the flat path, mixed steps
   (prefill chunks + verify rows of different lengths) the ragged path; no step is ever
   skipped. Large chunks go through the packed multi-request prefill (rows split across
   TP ranks, all-gathered). See ``dspark_ragged`` and ``packed_prefill``.
3. Draft one block per request: anchor = the bonus token (or, for a request still in
   chunked prefill, the next prompt token; its drafts are discarded by the scheduler),
   block ``[anchor, noise x (N-1)]`` at positions ``p..p+N-1`` attending the request's
   valid window + the block, then the Markov head left to right. Greedy or
   probabilistic; for probabilistic drafting the draft distributions are kept for the
   rejection sampler (``take_last_draft_probs``).

The runner glue (``propose_from_runner``) turns the V1 runner's step state into the
narrow ``propose`` arguments; the overlay's runner patch calls it.

Why a runner patch and not ``method="custom_class"``: the V1 runner builds a custom proposer
from the VllmConfig alone and calls ``propose(sampled_token_ids, num_tokens_no_spec,
token_ids_cpu, slot_mappings=...)`` after bookkeeping; it never turns on the target's aux
hidden-state outputs for it and passes no positions, ``query_start_loc`` or rejection
counts. DSpark ingests the target's hidden states of every step, so that route cannot
feed it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.models.deepseek_v4.common.dspark_draft import (
    DraftContext,
    draft_block_positions,
    draft_hf_config,
    draft_noise_token_id,
    load_dspark_draft,
)
from vllm.models.deepseek_v4.common.dspark_markov import markov_block_sample
from vllm.models.deepseek_v4.common.dspark_seeded_noise import (
    DRAFT_NOISE_SALT,
    RequestSeeds,
    keyed_uniform,
)
from vllm.models.deepseek_v4.common.packed_prefill import (
    MAX_PACKED_TOKENS,
    ingest_packed_prefill,
    plan_packed_prefill,
)
from vllm.v1.spec_decode.dspark_ragged import (
    SlotTable,
    anchor_rows,
    is_ragged,
    store_context_kv,
    window_mask,
)

if TYPE_CHECKING:
    from vllm.v1.sample.metadata import SamplingMetadata

logger = init_logger(__name__)

__all__ = ["DSparkCounters", "DSparkProposer", "DSparkStepRecord", "propose_from_runner"]


@dataclass
class DSparkCounters:
    """Cumulative step statistics; tests and the demo read these, not logs."""

    steps: int = 0
    flat_steps: int = 0  # every request carried the same number of rows
    ragged_steps: int = 0  # rows per request differed (prefill chunks + verify rows)
    packed_steps: int = 0  # context went through the packed multi-request prefill
    ingested_rows: int = 0  # accepted context rows handed to the ring store
    rejected_rows: int = 0  # verify rows not stored because the target rejected them
    drafted_tokens: int = 0  # draft tokens proposed to requests past their prefill
    sampled_draft_tokens: int = 0  # of all drafts, those sampled at temperature > 0
    discarded_drafts: int = 0  # drafts of requests still in chunked prefill
    verified_tokens: int = 0  # draft tokens the target verified this run
    accepted_tokens: int = 0  # of those, accepted
    released_slots: int = 0  # ring rows freed (finished / preempted requests)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class DSparkStepRecord:
    """What one step did, handed to ``DSparkProposer.step_observer`` (tests)."""

    req_ids: list[str]
    slots: torch.Tensor  # [R] ring rows
    query_start_loc: torch.Tensor  # [R+1]
    positions: torch.Tensor  # [T]
    input_ids: torch.Tensor | None  # [T] target input tokens of the rows, if known
    context_kv: torch.Tensor  # [T, K, D] projected KV of every row (stored or not)
    num_rejected: torch.Tensor  # [R]
    anchor_positions: torch.Tensor  # [R]
    anchor_tokens: torch.Tensor  # [R]
    draft_tokens: torch.Tensor  # [R, num_speculative_tokens]
    ring: torch.Tensor  # [R, W, K, D] the requests' rings after the store
    ring_pos: torch.Tensor  # [R, W]
    window: torch.Tensor  # [R, W] the cells the block attended


@dataclass
class _Step:
    """Per-step inputs of ``propose`` after validation."""

    req_ids: list[str]
    qsl: torch.Tensor
    positions: torch.Tensor
    num_rejected: torch.Tensor
    anchors: torch.Tensor
    prefilling: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class DSparkProposer:
    """Drafts ``[R, N]`` tokens per step for DeepSeek-V4 DSpark on the V1 runner."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        device: torch.device | str,
        runner: Any = None,
    ) -> None:
        spec = vllm_config.speculative_config
        if spec is None or not spec.use_dspark():
            raise ValueError("DSparkProposer needs speculative_config.method == 'dspark'")
        self.vllm_config = vllm_config
        self.device = torch.device(device)
        self.runner = runner
        hf = draft_hf_config(vllm_config)
        self.block_size = int(getattr(hf, "dspark_block_size", 0) or 0)
        self.num_speculative_tokens = int(spec.num_speculative_tokens)
        if self.block_size < 1:
            raise ValueError("the DSpark checkpoint config has no dspark_block_size")
        if not 1 <= self.num_speculative_tokens <= self.block_size:
            raise ValueError(
                f"num_speculative_tokens={self.num_speculative_tokens} must be in "
                f"[1, dspark_block_size={self.block_size}]: one backbone pass drafts one block"
            )
        # Block length N = num_speculative_tokens (as upstream): k below the checkpoint's
        # block size drafts a shorter, cheaper block. Noise token resolved as upstream.
        self.noise_token_id = draft_noise_token_id(hf)
        self.window = int(hf.sliding_window)
        self.max_position = int(hf.max_position_embeddings)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.max_num_seqs = int(vllm_config.scheduler_config.max_num_seqs)
        self.probabilistic = spec.draft_sample_method == "probabilistic"
        self.dtype = vllm_config.model_config.dtype
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.slot_table = SlotTable(self.max_num_seqs, device=self.device)
        self.live_request_ids: set[str] = set()  # ids holding a ring row
        self.counters = DSparkCounters()
        seed = vllm_config.model_config.seed
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(0 if seed is None else int(seed))
        self.request_seeds = RequestSeeds(0 if seed is None else int(seed))
        self.model: nn.Module | None = None
        self.kv_cache: torch.Tensor | None = None  # [S, W, K * D], all draft layers
        self.kv_pos: torch.Tensor | None = None  # [S, W] absolute position per cell
        self.last_confidence: torch.Tensor | None = None
        self._last_probs: torch.Tensor | None = None
        # Test hooks (None in production): replace the sampled drafts, observe steps.
        self.draft_override: Callable[..., torch.Tensor | None] | None = None
        self.step_observer: Callable[[DSparkStepRecord], None] | None = None
        self.supports_mm_inputs = False

    # ------------------------------------------------------------------ model

    def load_model(self, target_model: nn.Module) -> None:
        """Build the draft from the target checkpoint's ``mtp.*`` weights, share heads.

        The overlay's draft class on every platform (``load_dspark_draft``): on CUDA the
        registry would give upstream's V2-only NVIDIA class.
        """
        self.model = load_dspark_draft(self.vllm_config)
        inner = getattr(target_model, "model", target_model)
        embed = getattr(inner, "embed_tokens", None)
        if embed is None:
            embed = target_model.get_input_embeddings()
        self.model.share_target_heads(embed, target_model.lm_head)
        self.attach_model(self.model)

    def attach_model(self, model: nn.Module) -> None:
        """Use ``model`` (a loaded draft) and allocate its per-request rings."""
        self.model = model
        shape = model.shape
        self.num_layers = len(model.layers)
        self.head_dim = shape.head_dim
        self.kv_cache = torch.zeros(
            (self.max_num_seqs, self.window, self.num_layers * self.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        self.kv_pos = torch.full(
            (self.max_num_seqs, self.window), -1, dtype=torch.int64, device=self.device
        )

    def layer_caches(self) -> list[torch.Tensor]:
        """Per-layer views ``[S, W, D]`` of the stacked ring."""
        assert self.kv_cache is not None
        stacked = self.kv_cache.view(
            self.kv_cache.shape[0], self.window, self.num_layers, self.head_dim
        )
        return [stacked[:, :, j] for j in range(self.num_layers)]

    # ------------------------------------------------------- runner protocol

    def initialize_attn_backend(self, *args, **kwargs) -> None:
        """The draft keeps its KV in private rings: no paged-attention group to set up."""

    def initialize_cudagraph_keys(self, *args, **kwargs) -> None:
        """The draft runs eagerly (its steps mix shapes); nothing to capture."""

    def dummy_run(self, num_tokens: int, **kwargs) -> None:
        """Profile/warm-up pass: one block with an empty context, no state touched."""
        if self.model is None or self.kv_cache is None:
            return
        from vllm.forward_context import set_forward_context

        n = self.num_speculative_tokens
        ids = torch.full((1, n), self.noise_token_id, dtype=torch.int64, device=self.device)
        pos = torch.arange(n, device=self.device)[None]
        mask = torch.zeros((1, self.window), dtype=torch.bool, device=self.device)
        slots = torch.zeros(1, dtype=torch.int64, device=self.device)
        with torch.inference_mode(), set_forward_context(None, self.vllm_config):
            h = self.model(ids, pos, DraftContext(self.layer_caches(), slots, mask))
            self.model.compute_logits(h)

    def take_last_draft_probs(self) -> torch.Tensor | None:
        probs, self._last_probs = self._last_probs, None
        return probs

    def release(self, req_ids: Iterable[str]) -> None:
        """Free the ring rows of requests that finished, were aborted or preempted."""
        for req_id in req_ids:
            self.live_request_ids.discard(req_id)
            self.request_seeds.release((req_id,))
            if self.slot_table.release(req_id, self.kv_pos) is not None:
                self.counters.released_slots += 1

    # --------------------------------------------------------------- propose

    def propose(
        self,
        *,
        req_ids: Sequence[str],
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        num_rejected: torch.Tensor,
        next_token_ids: torch.Tensor,
        sampling_metadata: SamplingMetadata | None = None,
        prefilling: torch.Tensor | None = None,
        num_draft_tokens: Sequence[int] | None = None,
        finished_req_ids: Iterable[str] = (),
        input_ids: torch.Tensor | None = None,
        query_start_loc_cpu: torch.Tensor | None = None,
        request_seeds: Sequence[int | None] | None = None,
    ) -> torch.Tensor:
        """Ingest this step's context, draft one block per request.

        Args:
            req_ids: ``[R]`` request ids in batch-row order.
            query_start_loc: ``[R+1]`` packed rows of each request this step.
            positions: ``[T]`` absolute position of every row.
            aux_hidden_states: ``[T, m*H]`` concatenated target aux hidden states.
            num_rejected: ``[R]`` rejected verify rows at the end of each segment.
            next_token_ids: ``[R]`` anchor token (bonus token, or next prompt token).
            sampling_metadata: the target's; temperatures for probabilistic drafting.
            prefilling: ``[R]`` bool, request is still in chunked prefill (its drafts
                are discarded; counted, not drafted differently).
            num_draft_tokens: drafts the target verified per request (counters only).
            finished_req_ids: requests to release before assigning rows.
            input_ids: ``[T]`` target input tokens (only for ``step_observer``).
            query_start_loc_cpu: host copy of ``query_start_loc`` (avoids a sync).
            request_seeds: ``[R]`` each request's ``seed=`` (None: drawn once per request);
                keys the probabilistic draft noise per request and position.

        Returns:
            ``[R, num_speculative_tokens]`` int32 draft tokens.
        """
        if self.model is None or self.kv_cache is None or self.kv_pos is None:
            raise RuntimeError("DSparkProposer.load_model() was not called")
        from vllm.forward_context import set_forward_context

        self.release(finished_req_ids)
        req_ids = list(req_ids)
        num_reqs = len(req_ids)
        qsl = query_start_loc.to(self.device, torch.int64)
        if qsl.numel() != num_reqs + 1:
            raise ValueError(
                f"query_start_loc must have R+1={num_reqs + 1} entries, got {qsl.numel()}"
            )
        num_rows = int(qsl[-1]) if query_start_loc_cpu is None else int(query_start_loc_cpu[-1])
        positions = positions[:num_rows].to(self.device, torch.int64)
        aux = aux_hidden_states[:num_rows]
        rej = num_rejected.to(self.device, torch.int64)
        anchors = next_token_ids.to(self.device, torch.int64)
        slots = self.slot_table.assign(req_ids)
        self.live_request_ids.update(req_ids)

        with torch.inference_mode(), set_forward_context(None, self.vllm_config):
            kv_rows = self._ingest(qsl, query_start_loc_cpu, positions, aux, rej, slots)
            anchor_pos = positions[anchor_rows(qsl, rej)] + 1
            seeds = self.request_seeds.lookup(req_ids, request_seeds or [None] * num_reqs)
            seeds = seeds.to(self.device, non_blocking=True)
            drafts = self._draft(slots, anchors, anchor_pos, sampling_metadata, seeds)

        if self.draft_override is not None:
            replaced = self.draft_override(
                req_ids=req_ids,
                anchor_positions=anchor_pos,
                anchor_tokens=anchors,
                drafts=drafts,
            )
            if replaced is not None:
                drafts = replaced.to(drafts.device, drafts.dtype)
                self._last_probs = None
        self._count(num_reqs, rej, prefilling, num_draft_tokens, qsl)
        if self.step_observer is not None:
            self._observe(
                req_ids, slots, qsl, positions, input_ids, kv_rows, rej, anchor_pos, anchors, drafts
            )
        return drafts.to(torch.int32)

    def _project(self, aux: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``aux [T, m*H]`` -> context KV of all draft layers, ``[T, K, D]``."""
        model = self.model
        main_x = model.combine_hidden_states(aux.to(self.dtype))
        return model.context_kv(main_x, positions)

    def _ingest(self, qsl, qsl_cpu, positions, aux, rej, slots) -> torch.Tensor:
        """Store the step's accepted rows in the rings; returns every row's KV."""
        num_rows, num_reqs = positions.shape[0], qsl.numel() - 1
        self.counters.steps += 1
        if num_rows == 0 or num_reqs == 0:
            return self.kv_cache.new_empty((0, self.num_layers, self.head_dim))
        ragged = is_ragged(qsl_cpu if qsl_cpu is not None else qsl)
        if ragged:
            self.counters.ragged_steps += 1
        else:
            self.counters.flat_steps += 1
        stacked = self.num_layers * self.head_dim
        verify_rows = num_reqs * (self.num_speculative_tokens + 1)
        if verify_rows < num_rows <= MAX_PACKED_TOKENS:
            # A prefill chunk is in this step: packed multi-request prefill.
            self.counters.packed_steps += 1
            rank, group = self._tp_rank_group()
            plan = plan_packed_prefill(
                (qsl_cpu if qsl_cpu is not None else qsl).cpu(), self.tp_size
            )
            full = ingest_packed_prefill(
                plan,
                rank,
                group,
                aux,
                positions,
                lambda x, pos: self._project(x, pos).reshape(x.shape[0], 1, stacked),
                [(self.kv_cache, self.kv_pos)],
                slots,
                max_model_len=max(self.max_model_len, self.max_position),
                num_rejected=rej,
            )
            kv = full[:num_rows].view(num_rows, self.num_layers, self.head_dim)
        else:
            kv = self._project(aux, positions)
            store_context_kv(
                self.kv_cache,
                self.kv_pos,
                kv.reshape(num_rows, stacked),
                positions,
                qsl,
                slots,
                rej,
            )
        return kv

    def _tp_rank_group(self):
        if self.tp_size == 1:
            return 0, None
        from vllm.distributed import get_tensor_model_parallel_rank, get_tp_group

        tp = get_tp_group()
        group = tp.device_group if self.kv_cache.device.type != "cpu" else tp.cpu_group
        return get_tensor_model_parallel_rank(), group

    def _draft(self, slots, anchors, anchor_pos, sampling_metadata, seeds) -> torch.Tensor:
        model, n = self.model, self.num_speculative_tokens
        num_reqs = anchors.shape[0]
        ids = torch.full((num_reqs, n), self.noise_token_id, dtype=torch.int64, device=self.device)
        ids[:, 0] = anchors
        pos = draft_block_positions(anchor_pos, n, self.max_model_len)
        mask = window_mask(self.kv_pos, slots, anchor_pos, self.window)
        head = model(ids, pos, DraftContext(self.layer_caches(), slots, mask))
        base = model.compute_logits(head)
        temperature = None
        if (
            self.probabilistic
            and sampling_metadata is not None
            and not sampling_metadata.all_greedy
        ):
            temperature = sampling_metadata.temperature
            if temperature is not None:
                temperature = temperature[:num_reqs]
                self.counters.sampled_draft_tokens += int((temperature > 0).sum()) * (
                    self.num_speculative_tokens
                )
        out = markov_block_sample(
            base,
            anchors,
            model.markov_embed,
            model.markov_bias,
            temperature=temperature,
            # Slot k predicts position p+k+1; its draw is keyed by p+k (upstream's scheme).
            uniform=lambda k: keyed_uniform(
                seeds, anchor_pos + k + DRAFT_NOISE_SALT, base.shape[-1]
            ),
            return_probs=self.probabilistic,
        )
        self.last_confidence = model.compute_confidence(head, out.embeds)
        self._last_probs = out.probs
        return out.tokens

    def _count(self, num_reqs, rej, prefilling, num_draft_tokens, qsl) -> None:
        c = self.counters
        lengths = qsl[1:] - qsl[:-1]
        rejected = int(rej.sum())
        c.rejected_rows += rejected
        c.ingested_rows += int(lengths.sum()) - rejected
        discarded = 0 if prefilling is None else int(prefilling.sum())
        c.discarded_drafts += discarded * self.num_speculative_tokens
        c.drafted_tokens += (num_reqs - discarded) * self.num_speculative_tokens
        if num_draft_tokens is not None:
            verified = int(sum(num_draft_tokens))
            c.verified_tokens += verified
            c.accepted_tokens += verified - rejected

    def _observe(
        self, req_ids, slots, qsl, positions, input_ids, kv, rej, anchor_pos, anchors, drafts
    ) -> None:
        ring = self.kv_cache[slots].view(len(req_ids), self.window, self.num_layers, self.head_dim)
        self.step_observer(
            DSparkStepRecord(
                req_ids=list(req_ids),
                slots=slots.clone(),
                query_start_loc=qsl.clone(),
                positions=positions.clone(),
                input_ids=None if input_ids is None else input_ids.clone(),
                context_kv=kv.clone(),
                num_rejected=rej.clone(),
                anchor_positions=anchor_pos.clone(),
                anchor_tokens=anchors.clone(),
                draft_tokens=drafts.clone(),
                ring=ring.clone(),
                ring_pos=self.kv_pos[slots].clone(),
                window=window_mask(self.kv_pos, slots, anchor_pos, self.window),
            )
        )


def propose_from_runner(
    runner: Any,
    scheduler_output: Any,
    sampled_token_ids: torch.Tensor | list[list[int]],
    sampling_metadata: SamplingMetadata,
    aux_hidden_states: list[torch.Tensor] | None,
    spec_decode_metadata: Any,
    common_attn_metadata: Any,
) -> torch.Tensor:
    """V1 runner glue: read the step's state off the runner, call ``drafter.propose``.

    Called by the overlay's patch of ``GPUModelRunner.propose_draft_token_ids`` right
    after rejection sampling, with ``sampled_token_ids [R, k+1]`` (-1 = rejected).
    """
    drafter: DSparkProposer = runner.drafter
    if aux_hidden_states is None:
        raise RuntimeError("DSpark needs the target's aux hidden states (runner did not emit them)")
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    req_ids = list(batch.req_ids[:num_reqs])
    num_rows = int(scheduler_output.total_num_scheduled_tokens)
    device = drafter.device

    if isinstance(sampled_token_ids, list):  # host lists (padded drafter batch disabled)
        width = max((len(t) for t in sampled_token_ids), default=1) or 1
        padded = torch.full((num_reqs, width), -1, dtype=torch.int64)
        for i, toks in enumerate(sampled_token_ids[:num_reqs]):
            padded[i, : len(toks)] = torch.tensor(toks, dtype=torch.int64)
        sampled_token_ids = padded.to(drafter.device)
        device = drafter.device
    sampled = sampled_token_ids[:num_reqs]
    valid = ((sampled >= 0) & (sampled < batch.vocab_size)).sum(dim=1)
    discard_np = runner.discard_request_mask.np[:num_reqs]
    discard = torch.from_numpy(discard_np.copy()).to(device)
    valid = torch.where(discard, torch.zeros_like(valid), valid)
    if spec_decode_metadata is not None:
        num_drafts = list(spec_decode_metadata.num_draft_tokens)
    else:
        num_drafts = [0] * num_reqs
    drafts_t = torch.tensor(num_drafts, dtype=torch.int64, device=device)
    # Rows of request r: its new tokens, the last of which is followed by its drafts;
    # of the d verified drafts, valid - 1 were accepted, the rest rejected.
    num_rejected = torch.where(valid > 0, drafts_t + 1 - valid, torch.zeros_like(drafts_t))

    bonus = sampled.gather(1, (valid - 1).clamp(min=0)[:, None]).squeeze(1).long()
    anchors = bonus
    if discard_np.any():
        backup = torch.zeros(num_reqs, dtype=torch.int64)
        for i in discard_np.nonzero()[0].tolist():
            rid = req_ids[i]
            state = runner.requests[rid]
            nxt = state.num_computed_tokens + scheduler_output.num_scheduled_tokens[rid]
            backup[i] = state.get_token_id(nxt)
        anchors = torch.where(discard, backup.to(device), bonus)
    runner._copy_valid_sampled_token_count(anchors.to(torch.int32), valid.to(torch.int32))

    finished = set(scheduler_output.finished_req_ids)
    finished |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
    # Requests that left without being reported here (e.g. a skipped step).
    finished |= {rid for rid in drafter.live_request_ids if rid not in runner.requests}

    seeds = None
    if drafter.probabilistic:
        seeds = [runner.requests[rid].sampling_params.seed for rid in req_ids]
    cm = common_attn_metadata
    aux = torch.cat([h[:num_rows] for h in aux_hidden_states], dim=-1)
    return drafter.propose(
        req_ids=req_ids,
        query_start_loc=cm.query_start_loc[: num_reqs + 1],
        query_start_loc_cpu=cm.query_start_loc_cpu[: num_reqs + 1],
        positions=runner._get_positions(num_rows),
        aux_hidden_states=aux,
        num_rejected=num_rejected,
        next_token_ids=anchors,
        sampling_metadata=sampling_metadata,
        prefilling=discard,
        num_draft_tokens=num_drafts,
        finished_req_ids=finished,
        input_ids=runner.input_ids.gpu[:num_rows] if drafter.step_observer else None,
        request_seeds=seeds,
    )


def dspark_counters(worker: Any) -> dict[str, int]:
    """``LLM.collective_rpc(dspark_counters)``: the drafter's counters on a worker."""
    return worker.model_runner.drafter.counters.as_dict()
