"""DSpark proposer for vLLM's V1 model runner (CPU and GPU).

One call per engine step, after the target has verified the previous drafts:

1. Release the ring rows of finished / preempted requests; map this step's request ids to
   stable ring rows (``SlotTable``: KV follows the request id, never the batch row).
2. Plan the step on the host (``step_plan.plan_step``): layout, checks, counters, one
   copy of the plan's index tensors to the device. Nothing below reads device data back.
3. Ingest the step's context rows: ``main_x`` from the target's aux hidden states, then
   every draft layer's latent KV, stored into the request's ring. Only accepted rows are
   written (rejected verify rows never); uniform steps take the flat path, mixed steps
   (prefill chunks + verify rows of different lengths) the ragged path; no step is ever
   skipped. Large chunks go through the packed multi-request prefill (rows split across
   TP ranks, all-gathered). See ``context_store``, ``rings`` and ``packed_prefill``.
4. Draft one block per request (batch padded to a capture size, static shapes): anchor =
   the bonus token (or, for a request still in chunked prefill, the next prompt token;
   its drafts are discarded by the scheduler), block ``[anchor, noise x (N-1)]`` at
   positions ``p..p+N-1`` attending the request's valid window + the block, then the
   Markov head left to right. Greedy or probabilistic; for probabilistic drafting the
   draft distributions are kept for the rejection sampler (``take_last_draft_probs``).

The runner glue (``runner_glue.propose_from_runner``) turns the V1 runner's step state
into one ``DSparkStepInput`` for ``propose``; the overlay's runner patch calls it.

Why a runner patch and not ``method="custom_class"``: the V1 runner builds a custom proposer
from the VllmConfig alone and calls ``propose(sampled_token_ids, num_tokens_no_spec,
token_ids_cpu, slot_mappings=...)`` after bookkeeping; it never turns on the target's aux
hidden-state outputs for it and passes no positions, ``query_start_loc`` or rejection
counts. DSpark ingests the target's hidden states of every step, so that route cannot
feed it.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
import torch.nn as nn
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.models.deepseek_v4.common.dspark.markov import markov_block_sample
from vllm.models.deepseek_v4.common.dspark.model import (
    DraftContext,
    draft_block_positions,
    draft_hf_config,
    draft_noise_token_id,
    load_dspark_draft,
)
from vllm.models.deepseek_v4.common.dspark.noise import RequestSeeds, keyed_race_noise
from vllm.v1.spec_decode.dspark import cost_table
from vllm.v1.spec_decode.dspark.adaptive import apply_cut, draft_budget_mask, draft_budgets
from vllm.v1.spec_decode.dspark.context_store import last_accepted, store_context_kv, window_mask
from vllm.v1.spec_decode.dspark.counters import DSparkCounters, StepCounters
from vllm.v1.spec_decode.dspark.engine_timing import table_settings, time_verify_step
from vllm.v1.spec_decode.dspark.graphs import (
    DraftBlockGraphs,
    draft_graphs_wanted,
    full_cuda_graph,
)
from vllm.v1.spec_decode.dspark.packed_prefill import ingest_packed_prefill
from vllm.v1.spec_decode.dspark.rings import SlotTable, allocate_rings, clear_slots
from vllm.v1.spec_decode.dspark.served_steps import ServedStepFit
from vllm.v1.spec_decode.dspark.step_plan import (
    DSparkStepInput,
    StepPlan,
    capture_sizes,
    draft_anchor_positions,
    plan_step,
)

logger = init_logger(__name__)
REFIT_EVERY = 64  # proposals between refits of the served-step correction
# Until the first fit, a refit is tried this often: the dense exploration before it costs
# tokens (a narrow step on a draft that is nearly always right emits one or two of ~k).
REFIT_UNFITTED = 16

__all__ = ["DSparkCounters", "DSparkProposer"]


def _first_rows(num_rows: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The first ``num_rows`` rows of each tensor (a slice only where it has more)."""
    return tuple(t if t.shape[0] == num_rows else t[:num_rows] for t in tensors)


class DSparkProposer:
    """Drafts ``[R, N]`` tokens per step for DeepSeek-V4 DSpark on the V1 runner."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device | str) -> None:
        spec = vllm_config.speculative_config
        if spec is None or not spec.use_dspark():
            raise ValueError("DSparkProposer needs speculative_config.method == 'dspark'")
        self.vllm_config = vllm_config
        self.device = torch.device(device)
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
        self.draft_sizes = capture_sizes(self.max_num_seqs)
        self.probabilistic = spec.draft_sample_method == "probabilistic"
        # Confidence-scheduled verification. With synchronous scheduling, the drafts not
        # worth verifying come back as CUT; with async scheduling (the scheduler reserves
        # the next step's draft slots before the drafts exist), each request's budget goes
        # back with the step's output and shapes the step after next (take_draft_budgets).
        self.adaptive = bool(getattr(spec, "enable_adaptive_verification", False))
        self.async_scheduling = bool(
            getattr(vllm_config.scheduler_config, "async_scheduling", False)
        )
        self._draft_budgets: torch.Tensor | None = None
        # The rule reads a step-time table measured on this engine (cost_table): until one
        # is in place nothing is cut. "auto" runs the rule only where the table says a cut
        # can pay (or a row budget binds); "on" whenever there is a table.
        self.adaptive_mode = cost_table.env_mode() if self.adaptive else "off"
        self.row_budget = cost_table.env_row_budget() if self.adaptive else None
        if self.row_budget is not None and self.row_budget < self.max_num_seqs:
            raise ValueError(
                f"{cost_table.BUDGET_ENV}={self.row_budget} is below max_num_seqs="
                f"{self.max_num_seqs}: every request needs one verify row"
            )
        self.min_gain = cost_table.DEFAULT_MIN_GAIN
        self.cost_table: cost_table.StepCostTable | None = None
        self.rule_on = False  # the cut runs each step (decided once the table is in place)
        self._step_ms: torch.Tensor | None = None  # [S+1, rows+1] table on the device
        self._cutting: torch.Tensor | None = None  # hysteresis state (device bool scalar)
        self._table_tried = False
        self._measuring = False
        # Served steps correct the table's offset and scale (served_steps), refitted every
        # REFIT_EVERY proposals; _base_ms is the table as measured, on the host.
        self.served = ServedStepFit()
        self._base_ms: np.ndarray | None = None
        self.dtype = vllm_config.model_config.dtype
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.slot_table = SlotTable(self.max_num_seqs)
        # Host bookkeeping plus rejected rows summed per ring row on the device.
        self._counters = StepCounters(self.max_num_seqs + 1, self.device)
        seed = vllm_config.model_config.seed
        self.request_seeds = RequestSeeds(0 if seed is None else int(seed))
        self.model: nn.Module | None = None
        self.kv_cache: torch.Tensor | None = None  # [S+1, W, K * D], all draft layers
        self.kv_pos: torch.Tensor | None = None  # [S+1, W] absolute position per cell
        self._layer_caches: list[torch.Tensor] = []  # per-layer views of kv_cache
        # (head hidden, Markov embeds) of the last block and how many of its rows are
        # requests (the rest pad it to a draft size): its confidence is computed only when
        # read (fixed-length verify does not use it).
        self._confidence_inputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self._confidence_rows = 0
        self._last_probs: torch.Tensor | None = None
        self._block_offsets: torch.Tensor | None = None  # arange(N) on the device, made once
        self.graphs: DraftBlockGraphs | None = None  # CUDA graphs of the draft block
        self.supports_mm_inputs = False

    @property
    def last_confidence(self) -> torch.Tensor | None:
        """``[R, N]`` confidence of the last block's drafts (None without a confidence head)."""
        if self._confidence_inputs is None or self.model is None:
            return None
        head, embeds = self._confidence_inputs
        rows = self._confidence_rows
        with torch.inference_mode():
            return self.model.compute_confidence(head[:rows], embeds[:rows])

    @property
    def live_request_ids(self):
        """Ids of the requests holding a ring row (a live view of the slot table)."""
        return self.slot_table.held_ids

    @property
    def counters(self) -> DSparkCounters:
        """Cumulative counters, exact (one device read: end-of-run reports only)."""
        return self._counters.exact()

    def metrics_counters(self) -> DSparkCounters:
        """Counters as of a recent step, without a device read (the per-step metrics)."""
        return self._counters.lagged()

    def reset_counters(self) -> None:
        """Start counting from zero (a new measurement phase)."""
        self._counters.reset()

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
        self.kv_cache, self.kv_pos = allocate_rings(
            self.max_num_seqs, self.window, self.num_layers * self.head_dim, self.dtype, self.device
        )
        stacked = self.kv_cache.view(-1, self.window, self.num_layers, self.head_dim)
        self._layer_caches = list(stacked.unbind(2))
        self._block_offsets = torch.arange(self.num_speculative_tokens, device=self.device)
        if self.adaptive and getattr(model, "confidence_head", None) is None:
            raise ValueError(
                "enable_adaptive_verification needs the draft's confidence head "
                "(mtp.*.confidence_head.proj), which this checkpoint does not have"
            )
        if draft_graphs_wanted(self.vllm_config, self.device):
            self.use_draft_graphs()

    def use_draft_graphs(self, wrap=full_cuda_graph) -> None:
        """Run the draft block as one CUDA graph per draft size (captured in ``dummy_run``);
        ``wrap(block, vllm_config)`` makes the capturing callable (vLLM's wrapper)."""
        self.graphs = DraftBlockGraphs(
            self.draft_block,
            self.vllm_config,
            self.draft_sizes,
            num_spec_tokens=self.num_speculative_tokens,
            vocab_size=self.model.shape.vocab_size,
            sampled=self.probabilistic,
            device=self.device,
            wrap=wrap,
        )

    def layer_caches(self) -> list[torch.Tensor]:
        """Per-layer views ``[S+1, W, D]`` of the stacked ring (made once, when allocated)."""
        return self._layer_caches

    # ------------------------------------------------------- runner protocol

    def initialize_attn_backend(self, *args, **kwargs) -> None:
        """The draft keeps its KV in private rings: no paged-attention group to set up."""

    def initialize_cudagraph_keys(self, *args, **kwargs) -> None:
        """Nothing to key: the draft block's graphs are one per size in ``draft_sizes``."""

    def dummy_run(self, num_tokens: int, *, is_graph_capturing: bool = False, **kwargs) -> None:
        """Profile/warm-up pass (one block of the smallest draft size, reading only the
        scratch row, and one draw of sampling noise); in vLLM's capture phase, captures the
        draft block's graphs."""
        if self.model is None or self.kv_cache is None or self._measuring:
            return
        if is_graph_capturing and self.graphs is not None:
            try:
                self.graphs.capture()
            except Exception as exc:  # noqa: BLE001 - any capture failure: serve eagerly
                logger.warning(
                    "DSpark draft block: CUDA graph capture failed (%s: %s); it runs eagerly "
                    "(DSPARK_DRAFT_CUDAGRAPH=0 skips the attempt)",
                    type(exc).__name__,
                    exc,
                )
                self.graphs = None
            return
        from vllm.forward_context import set_forward_context

        rows = self.draft_sizes[0]
        slots = torch.full((rows,), self.max_num_seqs, dtype=torch.int64, device=self.device)
        anchors = torch.full((rows,), self.noise_token_id, dtype=torch.int64, device=self.device)
        zero = torch.zeros(rows, dtype=torch.int64, device=self.device)
        with torch.inference_mode(), set_forward_context(None, self.vllm_config):
            self.draft_block(slots, anchors, zero, None)
            if self.probabilistic:  # compiles the noise kernel now, not in a served step
                self.draw_race_noise(torch.zeros(rows, dtype=torch.int64), zero)

    def take_draft_budgets(self) -> torch.Tensor | None:
        """``[R]`` int32 (device) drafts worth verifying per request of the last step, -1
        where the rule had no say (prefill); async scheduling with adaptive only, else None."""
        budgets, self._draft_budgets = self._draft_budgets, None
        return budgets

    def take_last_draft_probs(self) -> torch.Tensor | None:
        probs, self._last_probs = self._last_probs, None
        return probs

    def release(self, req_ids: Iterable[str]) -> None:
        """Free the ring rows of requests that finished, were aborted or preempted."""
        req_ids = list(req_ids)
        self.request_seeds.release(req_ids)
        freed = self.slot_table.release(req_ids)
        clear_slots(self.kv_pos, freed)
        self._counters.host.released_slots += len(freed)

    # --------------------------------------------------------------- propose

    def propose(self, step: DSparkStepInput) -> torch.Tensor:
        """Ingest this step's context, draft one block per request.

        ``step`` is built by the runner glue (``runner_glue.propose_from_runner``): its host
        half is planned and checked once (``plan_step``), its device half is never read
        back. Returns ``[R, num_speculative_tokens]`` int32 draft tokens.
        """
        if self.model is None or self.kv_cache is None or self.kv_pos is None:
            raise RuntimeError("DSparkProposer.load_model() was not called")
        from vllm.forward_context import set_forward_context

        req_ids = list(step.req_ids)
        plan = self.plan(req_ids, step)
        explore = self._serve_step(req_ids, step) if self._base_ms is not None else None
        num_rows, num_reqs = plan.num_rows, plan.num_requests
        positions, aux = _first_rows(num_rows, step.positions, step.aux_hidden_states)
        num_rejected = step.num_rejected
        with torch.inference_mode(), set_forward_context(None, self.vllm_config):
            accepted = last_accepted(plan.store, positions, num_rejected)
            self._ingest(plan, positions, aux, accepted)
            anchor_pos = draft_anchor_positions(plan, accepted)
            anchors = torch.nn.functional.pad(
                step.next_token_ids.long(), (0, plan.draft_rows - num_reqs),
                value=self.noise_token_id,
            )
            temperature = noise = None
            if step.temperature is not None and self.probabilistic:
                temperature = torch.nn.functional.pad(
                    step.temperature, (0, plan.draft_rows - num_reqs)
                )
                seeds = self.request_seeds.lookup(
                    req_ids, step.request_seeds or [None] * num_reqs
                )
                noise = self.draw_race_noise(seeds, anchor_pos)
            drafts = self._draft(plan, anchors, anchor_pos, temperature, noise)
            if explore == ServedStepFit.NARROW or (self.rule_on and explore is None):
                drafts = self._cut(plan, drafts, narrow=explore is not None)
        self._count(plan, num_rejected)
        return drafts.to(torch.int32)

    def _draft(self, plan: StepPlan, anchors, anchor_pos, temperature, noise):
        """``[R, k]`` drafts of the step's requests from the draft block, padded rows dropped.

        Keeps the block's draft probabilities (the rejection sampler's, when sampling) and
        the confidence head's inputs for this step.
        """
        tokens, head, embeds, *probs = self._run_block(
            plan.draft_slots, anchors, anchor_pos, temperature, noise
        )
        num_reqs = plan.num_requests
        self._last_probs = probs[0][:num_reqs] if probs else None
        self._confidence_inputs, self._confidence_rows = (head, embeds), num_reqs
        return tokens if plan.draft_rows == num_reqs else tokens[:num_reqs]

    def _never_cut(self, temperature_cpu, request_seeds) -> np.ndarray | None:
        """Host ``[R]``: requests adaptive verification must not cut, the seeded sampled ones.

        A cut decides how many random draws a request's verification makes, and the cut is
        batch-wide, so cutting a seeded request would make its output depend on whichever
        requests share its steps; greedy and unseeded requests lose nothing by it.
        """
        if not self.adaptive or temperature_cpu is None or request_seeds is None:
            return None
        seeded = np.fromiter((s is not None for s in request_seeds), bool, len(request_seeds))
        return (np.asarray(temperature_cpu) > 0) & seeded

    def _cut(self, plan: StepPlan, drafts: torch.Tensor, narrow=False) -> torch.Tensor:
        """Drafts past each request's verification budget replaced by ``CUT`` (device);
        ``narrow`` (an exploring step) admits as many drafts as there are requests (seeded
        sampled requests keep their k), leaving the rule's hysteresis as it was.

        The next step has one row per request of this one plus the admitted drafts; the
        table's times for this request count are sliced on the device by host ints. Under
        async scheduling the drafts stay whole (the scheduler already reserved the next
        step's slots) and the per-request budgets wait for the step's output.
        """
        num_reqs, k = plan.num_requests, self.num_speculative_tokens
        num_ranked = num_reqs - plan.num_discarded
        max_drafts = num_ranked * k
        if self.row_budget is not None:
            max_drafts = max(0, min(max_drafts, self.row_budget - num_reqs))
        if narrow:
            max_drafts = min(max_drafts, num_ranked + plan.num_never_cut * (k - 1))
        with torch.inference_mode():
            whole = plan.never_cut[:num_reqs].bool() if plan.num_never_cut else None
            drafting = plan.drafting[:num_reqs].bool()
            eligible = drafting if whole is None else drafting & ~whole
            keep = draft_budget_mask(
                self.last_confidence,
                eligible,
                num_ranked=num_ranked,
                num_whole_drafts=plan.num_never_cut * k,
                max_drafts=max_drafts,
                step_ms=self._step_ms[num_reqs, num_reqs : num_reqs + max_drafts + 1],
                min_gain=self.min_gain,
                whole=whole,
                cutting=None if narrow else self._cutting,
            )
            if not self.async_scheduling:
                return apply_cut(drafts, keep)
            self._draft_budgets = draft_budgets(keep, drafting)
            return drafts

    # ------------------------------------------------------------ cost table

    def use_cost_table(
        self, table: cost_table.StepCostTable, min_gain: float = cost_table.DEFAULT_MIN_GAIN
    ) -> None:
        """Cut by ``table`` from now on (adaptive only) and decide whether the rule runs.

        ``auto`` runs it when some request count's verify rows cost at least ``min_gain``
        of its step (below that no cut can pay) or when full width can pass the row budget.
        """
        if not self.adaptive:
            raise ValueError("use_cost_table needs enable_adaptive_verification")
        k = self.num_speculative_tokens
        self.cost_table, self.min_gain = table, float(min_gain)
        max_rows = self.max_num_seqs * (k + 1)
        self._base_ms = table.matrix(self.max_num_seqs, max_rows)
        self._step_ms = torch.from_numpy(self._base_ms.copy()).to(self.device)
        self._cutting = torch.zeros((), dtype=torch.bool, device=self.device)
        self.served = ServedStepFit(clock=self.served.clock)
        gain = self._decide_rule(table)
        logger.info(
            "DSpark adaptive verification (%s): step time in ms by requests and drafts per "
            "request (measured in %.1f s)\n%s\nmost a cut could gain: %.1f%% (min %.0f%%), "
            "row budget %s: the cut %s",
            self.adaptive_mode, table.measure_seconds, table.describe(), 100 * gain,
            100 * self.min_gain, self.row_budget,
            "runs every step" if self.rule_on else "is off (no gain to make)",
        )

    def _decide_rule(self, table: cost_table.StepCostTable) -> float:
        """Set ``rule_on`` from ``table`` (measured or corrected); returns the most a cut
        could gain by it."""
        max_rows = self.max_num_seqs * (self.num_speculative_tokens + 1)
        budget_binds = self.row_budget is not None and max_rows > self.row_budget
        gain = table.max_gain(self.max_num_seqs)
        self.rule_on = self.adaptive_mode == "on" or budget_binds or gain >= self.min_gain
        return gain

    def _serve_step(self, req_ids: list[str], step: DSparkStepInput) -> str | None:
        """Host bookkeeping of served step times (``served_steps``): observe this step,
        refit the table's correction every ``REFIT_EVERY`` proposals (``REFIT_UNFITTED``
        before the first fit; proposals count alike on every TP rank, and a refit
        broadcasts). Returns how this step explores (``ServedStepFit.explore``), None when
        it does not."""
        num_reqs = len(req_ids)
        rows = int(step.query_start_loc_cpu[num_reqs])
        decode_only = num_reqs > 0 and rows <= self._base_ms.shape[1] - 1 and np.array_equal(
            np.diff(step.query_start_loc_cpu[: num_reqs + 1]),
            np.asarray(step.num_draft_tokens[:num_reqs]) + 1,
        )
        table_ms = float(self._base_ms[num_reqs, rows]) if decode_only else 0.0
        self.served.step(req_ids, decode_only, table_ms)
        every = REFIT_UNFITTED if self.served.fitted is None else REFIT_EVERY
        if self.served.proposals % every == every - 1:
            self._refit()
        return self.served.explore()

    def _refit(self) -> None:
        """Rank 0's fit of served steps (broadcast: every rank must cut alike) becomes the
        rule's table: ``a + b * measured``."""
        rank, _ = self._tp_rank_group()
        before = self.served.fitted
        fitted = self.served.fit() if rank == 0 else None
        if self.tp_size > 1:
            from vllm.distributed import get_tp_group

            fitted = get_tp_group().broadcast_object(fitted, src=0)
            self.served.fitted = fitted or self.served.fitted
        if fitted is None:
            return
        a, b = fitted
        corrected = np.maximum(a + b * self._base_ms, 1e-3).astype(np.float32)
        # A new tensor, not an in-place copy: the table may be an inference tensor.
        self._step_ms = torch.from_numpy(corrected).to(self.device)
        was_on = self.rule_on
        gain = self._decide_rule(self.cost_table.affine(a, b))
        log = logger.info if before is None or was_on != self.rule_on else logger.debug
        log(
            "DSpark adaptive verification: served steps take %.2f ms + %.2f x the table's "
            "time; most a cut could gain: %.1f%%, the cut %s", a, b, 100 * gain,
            "runs every step" if self.rule_on else "is off (no gain to make)",
        )

    def prepare_cost_table(self, runner) -> None:
        """Once per engine, before its first step: read this engine's table from the cache
        or measure it with ``runner``'s dummy forwards, then ``use_cost_table``.

        Every TP rank runs the measurement (the forwards are collective); rank 0 decides
        whether to measure and its table is the one all ranks use.
        """
        if not self.adaptive or self._table_tried or self.cost_table is not None:
            return
        self._table_tried = True
        rank, _ = self._tp_rank_group()
        path = cost_table.cache_path(cost_table.table_key(table_settings(self)))
        table = cost_table.read_cached(path) if rank == 0 else None
        need = table is None
        if self.tp_size > 1:
            from vllm.distributed import get_tp_group

            need = get_tp_group().broadcast_object(need, src=0)
        if need:
            max_rows = min(self.max_num_seqs * (self.num_speculative_tokens + 1),
                           int(runner.max_num_tokens))
            self._measuring = True
            try:
                table = cost_table.measure(
                    lambda r, w: time_verify_step(self, runner, r, w),
                    self.draft_sizes,
                    self.num_speculative_tokens,
                    row_budget=self.row_budget,
                    max_rows=max_rows,
                )
            finally:
                self._measuring = False
            if rank == 0 and table.spread <= cost_table.MAX_CACHED_SPREAD:
                cost_table.write_cached(path, table)
            elif rank == 0:
                logger.warning(
                    "DSpark cost table: the two timing passes differ by %.0f%% (a busy "
                    "machine); used now, not cached, measured again at the next start",
                    100 * table.spread,
                )
        if self.tp_size > 1:
            from vllm.distributed import get_tp_group

            text = get_tp_group().broadcast_object(table.to_json() if rank == 0 else None, src=0)
            table = cost_table.StepCostTable.from_json(text)
        logger.info("DSpark cost table %s: %s", "measured" if need else "read", path)
        self.use_cost_table(table)

    def dummy_block(self, rows: int) -> None:
        """One draft block of ``rows`` rows reading only the scratch ring row."""
        from vllm.forward_context import set_forward_context

        slots = torch.full((rows,), self.max_num_seqs, dtype=torch.int64, device=self.device)
        anchors = torch.full((rows,), self.noise_token_id, dtype=torch.int64, device=self.device)
        zero = torch.zeros(rows, dtype=torch.int64, device=self.device)
        with torch.inference_mode(), set_forward_context(None, self.vllm_config):
            self._run_block(slots, anchors, zero, None, None)

    def plan(self, req_ids: list[str], step: DSparkStepInput) -> StepPlan:
        """Ring rows for ``req_ids`` (host table) and the step plan; checks, then one copy.

        A step the plan refuses leaves the table as it was: rows given to new ids go back.
        """
        rank, group = self._tp_rank_group()
        new_ids = [rid for rid in req_ids if rid not in self.slot_table.held_ids]
        slots = self.slot_table.assign(req_ids)
        try:
            return plan_step(
                step.query_start_loc_cpu,
                slots,
                num_draft_tokens=step.num_draft_tokens,
                prefilling=step.prefilling,
                temperature_cpu=step.temperature_cpu,
                never_cut=self._never_cut(step.temperature_cpu, step.request_seeds),
                window=self.window,
                num_slots=self.max_num_seqs,
                num_spec_tokens=self.num_speculative_tokens,
                draft_sizes=self.draft_sizes,
                tp_size=self.tp_size,
                rank=rank,
                group=group,
                device=self.device,
            )
        except ValueError:
            self.slot_table.release(new_ids)
            raise

    def _project(self, aux: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``aux [T, m*H]`` -> context KV of all draft layers stacked, ``[T, K * D]``."""
        model = self.model
        main_x = model.combine_hidden_states(aux if aux.dtype == self.dtype else aux.to(self.dtype))
        kv = model.context_kv(main_x, positions)
        return kv.reshape(kv.shape[0], -1)

    def _ingest(self, plan: StepPlan, positions, aux, accepted) -> None:
        """Store the step's accepted rows in the rings (packed prefill for big chunks)."""
        if plan.num_rows == 0:
            return
        ring = (self.kv_cache, self.kv_pos)
        if plan.packed is not None:
            ingest_packed_prefill(
                plan.packed,
                plan.store,
                aux,
                positions,
                self._project,
                ring,
                max_model_len=max(self.max_model_len, self.max_position),
                accepted=accepted,
            )
        else:
            kv = self._project(aux, positions)
            store_context_kv(*ring, kv, positions, plan.store, accepted)

    def _tp_rank_group(self):
        if self.tp_size == 1:
            return 0, None
        from vllm.distributed import get_tensor_model_parallel_rank, get_tp_group

        tp = get_tp_group()
        group = tp.device_group if self.device.type != "cpu" else tp.cpu_group
        return get_tensor_model_parallel_rank(), group

    def draft_block(
        self,
        slots: torch.Tensor,
        anchors: torch.Tensor,
        anchor_pos: torch.Tensor,
        temperature: torch.Tensor | None,
        race_noise: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Backbone + Markov head for ``[B]`` draft rows (B a draft size).

        Returns ``(tokens [B, N], head hidden [B, N, H], Markov embeds [B, N, r])`` and,
        when drafting is probabilistic, ``draft probs [B, N, V]``: a flat tuple of
        tensors, nothing kept on ``self``, so a CUDA graph replay (``graphs``),
        which runs none of this Python, hands back the same outputs. Static shapes (B, N,
        W, V fixed), no host read, no RNG state (sampled rows use ``race_noise [B, N,
        V]``, see ``draw_race_noise``). Reads the rings, never writes them; a pad row
        (slot = scratch row, anchor position 0) attends nothing.
        """
        model, n = self.model, self.num_speculative_tokens
        ids = torch.nn.functional.pad(anchors[:, None], (0, n - 1), value=self.noise_token_id)
        pos = draft_block_positions(anchor_pos, n, self.max_model_len, self._block_offsets)
        mask = window_mask(self.kv_pos, slots, anchor_pos, self.window)
        head = model(ids, pos, DraftContext(self.layer_caches(), slots, mask))
        out = markov_block_sample(
            model.compute_logits(head),
            anchors,
            model.markov_embed,
            model.markov_bias,
            temperature=temperature,
            race_noise=race_noise,
            return_probs=self.probabilistic,
        )
        block = (out.tokens, head, out.embeds)
        return block if out.probs is None else (*block, out.probs)

    def _run_block(self, slots, anchors, anchor_pos, temperature, race_noise):
        """The draft block as a replayed CUDA graph when one is captured for this size."""
        graphs = self.graphs
        if graphs is not None and slots.shape[0] in graphs.captured:
            return graphs.run(slots, anchors, anchor_pos, temperature, race_noise)
        return self.draft_block(slots, anchors, anchor_pos, temperature, race_noise)

    def draw_race_noise(self, seeds: torch.Tensor, anchor_pos: torch.Tensor) -> torch.Tensor:
        """``Exp(1)`` race noise ``[B, N, V]`` for sampled drafting, keyed, never stateful.

        ``seeds [R]`` (host) are the requests' seeds, ``anchor_pos [B]`` (device, B >= R
        draft rows) their anchor positions. Slot k predicts position p+k+1 and its draw is
        keyed by (seed, p+k) as upstream does, so a request with ``seed=`` drafts the same
        tokens whatever batch, row or chunking it gets. Pad rows get seed 0.
        """
        seeds = torch.nn.functional.pad(seeds, (0, anchor_pos.shape[0] - seeds.shape[0]))
        seeds = seeds.to(self.device, non_blocking=True)
        return keyed_race_noise(
            seeds, anchor_pos, self.num_speculative_tokens, self.model.shape.vocab_size
        )

    def _count(self, plan: StepPlan, num_rejected: torch.Tensor) -> None:
        """Host numbers from the plan; the rejected total accumulates on the device."""
        c, k = self._counters.host, self.num_speculative_tokens
        c.steps += 1
        if plan.num_rows and plan.num_requests:
            c.flat_steps += plan.store.uniform
            c.ragged_steps += not plan.store.uniform
            c.packed_steps += plan.packed is not None
        c.ingested_rows += plan.num_rows
        c.discarded_drafts += plan.num_discarded * k
        c.drafted_tokens += (plan.num_requests - plan.num_discarded) * k
        c.sampled_draft_tokens += plan.num_sampled * k if self.probabilistic else 0
        c.verified_tokens += plan.num_verified
        c.accepted_tokens += plan.num_verified
        self._counters.add_rejected(plan.store.slots, num_rejected)
