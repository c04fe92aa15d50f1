"""DSpark proposer for vLLM's V1 model runner (CPU and GPU; design in overlay/README.md).

``propose`` plans each step on the host (``step_plan``), ingests its context rows into the
rings and drafts one block per request, reading no device data back after the plan.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
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
from vllm.v1.spec_decode.dspark.calibration import SlotCalibration
from vllm.v1.spec_decode.dspark.context_store import last_accepted, store_context_kv, window_mask
from vllm.v1.spec_decode.dspark.counters import DSparkCounters, StepCounters
from vllm.v1.spec_decode.dspark.engine_timing import table_settings, time_verify_step
from vllm.v1.spec_decode.dspark.graphs import DraftBlockGraphs, draft_graphs_wanted, full_cuda_graph
from vllm.v1.spec_decode.dspark.packed_prefill import ingest_packed_prefill
from vllm.v1.spec_decode.dspark.rings import SlotTable, allocate_rings, clear_slots
from vllm.v1.spec_decode.dspark.rule_rest import RuleRest
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
REFIT_UNFITTED = 16  # more often before the first fit: the exploration until then costs tokens

__all__ = ["DSparkCounters", "DSparkProposer"]


def _first_rows(num_rows: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The first ``num_rows`` rows of each tensor (sliced only where it has more)."""
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
        # Block length N = num_speculative_tokens (as upstream): a smaller k drafts a cheaper block.
        self.noise_token_id = draft_noise_token_id(hf)
        self.window = int(hf.sliding_window)
        self.max_position = int(hf.max_position_embeddings)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        sched = vllm_config.scheduler_config
        self.max_num_seqs = int(sched.max_num_seqs)
        self.draft_sizes = capture_sizes(self.max_num_seqs)
        self._max_rows = self.max_num_seqs * (self.num_speculative_tokens + 1)  # full width
        self.probabilistic = spec.draft_sample_method == "probabilistic"
        self.adaptive = bool(getattr(spec, "enable_adaptive_verification", False))
        self.async_scheduling = bool(getattr(sched, "async_scheduling", False))
        self._draft_budgets: torch.Tensor | None = None
        # Nothing is cut until a step-time table (cost_table) is in place.
        self.adaptive_mode = cost_table.env_mode() if self.adaptive else "off"
        self.row_budget = cost_table.env_row_budget() if self.adaptive else None
        if self.row_budget is not None and self.row_budget < self.max_num_seqs:
            raise ValueError(
                f"{cost_table.BUDGET_ENV}={self.row_budget} is below max_num_seqs="
                f"{self.max_num_seqs}: every request needs one verify row"
            )
        self.min_gain = cost_table.DEFAULT_MIN_GAIN
        self.cost_table: cost_table.StepCostTable | None = None
        self.rule_on = False  # the cut runs each step (decided from the table, or resting)
        self._rule_pays = self._can_rest = self._ruled_last = False
        self.rest = RuleRest()  # auto: the rule rests while it admits every draft
        self._step_ms: torch.Tensor | None = None  # [S+1, rows+1] table on the device
        self._cutting: torch.Tensor | None = None  # hysteresis state (device bool scalar)
        self.calibration: SlotCalibration | None = None  # the head's per-slot scale (device)
        self._table_tried = self._measuring = False
        # Served steps correct the table (served_steps); _base_ms is it as measured, on the host.
        self.served = ServedStepFit()
        self._base_ms: np.ndarray | None = None
        self.dtype = vllm_config.model_config.dtype
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.slot_table = SlotTable(self.max_num_seqs)
        self._counters = StepCounters(self.max_num_seqs + 1, self.device)
        seed = vllm_config.model_config.seed
        self.request_seeds = RequestSeeds(0 if seed is None else int(seed))
        self.model: nn.Module | None = None
        self.kv_cache: torch.Tensor | None = None  # [S+1, W, K * D], all draft layers
        self.kv_pos: torch.Tensor | None = None  # [S+1, W] absolute position per cell
        self._layer_caches: list[torch.Tensor] = []  # per-layer views of kv_cache
        # (head hidden, Markov embeds) of the last block and how many rows are requests: the
        # confidence is computed only when read (fixed-length verify does not use it).
        self._confidence_inputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self._confidence_rows = 0
        self._confidence: torch.Tensor | None = None
        self._last_probs: torch.Tensor | None = None
        self._block_offsets: torch.Tensor | None = None  # arange(N) on the device, made once
        self.graphs: DraftBlockGraphs | None = None  # CUDA graphs of the draft block
        self.supports_mm_inputs = False

    @property
    def last_confidence(self) -> torch.Tensor | None:
        """``[R, N]`` confidence of the last block's drafts (None without a confidence head)."""
        if self._confidence_inputs is None or self.model is None:
            return None
        if self._confidence is None:  # one head pass per block, however often it is read
            (head, embeds), rows = self._confidence_inputs, self._confidence_rows
            with torch.inference_mode():
                self._confidence = self.model.compute_confidence(head[:rows], embeds[:rows])
        return self._confidence

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

    def load_model(self, target_model: nn.Module) -> None:
        """Build the overlay's draft class from the target's ``mtp.*`` weights, share heads
        (never the registry's: on CUDA that is upstream's V2-only class)."""
        self.model = load_dspark_draft(self.vllm_config)
        embed = getattr(getattr(target_model, "model", target_model), "embed_tokens", None)
        if embed is None:
            embed = target_model.get_input_embeddings()
        self.model.share_target_heads(embed, target_model.lm_head)
        self.attach_model(self.model)

    def attach_model(self, model: nn.Module) -> None:
        """Use ``model`` (a loaded draft) and allocate its per-request rings."""
        self.model = model
        self.num_layers = len(model.layers)
        self.head_dim = model.shape.head_dim
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
        """Run the draft block as CUDA graphs, captured in ``dummy_run`` (``DraftBlockGraphs``)."""
        self.graphs = DraftBlockGraphs(
            self.draft_block, self.vllm_config, self.draft_sizes,
            num_spec_tokens=self.num_speculative_tokens, vocab_size=self.model.shape.vocab_size,
            sampled=self.probabilistic, device=self.device, wrap=wrap,
        )

    def layer_caches(self) -> list[torch.Tensor]:
        """Per-layer views ``[S+1, W, D]`` of the stacked ring (made once, when allocated)."""
        return self._layer_caches

    def initialize_attn_backend(self, *args, **kwargs) -> None:
        """The draft keeps its KV in private rings: no paged-attention group to set up."""

    def initialize_cudagraph_keys(self, *args, **kwargs) -> None:
        """Nothing to key: the draft block's graphs are one per size in ``draft_sizes``."""

    def dummy_run(self, num_tokens: int, *, is_graph_capturing: bool = False, **kwargs) -> None:
        """Warm-up: one block of the smallest draft size on the scratch row and one noise
        draw; in vLLM's capture phase, captures the draft block's graphs instead."""
        if self.model is None or self.kv_cache is None or self._measuring:
            return
        if is_graph_capturing and self.graphs is not None:
            try:
                self.graphs.capture()
            except Exception as exc:  # noqa: BLE001 - any capture failure: serve eagerly
                logger.warning(
                    "DSpark draft block: CUDA graph capture failed (%s: %s); it runs eagerly "
                    "(DSPARK_DRAFT_CUDAGRAPH=0 skips the attempt)", type(exc).__name__, exc,
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
        where the rule had no say; async scheduling with adaptive only, else None."""
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

    def propose(self, step: DSparkStepInput) -> torch.Tensor:
        """Ingest this step's context, draft one block per request: ``[R, k]`` int32 drafts.
        The host half of ``step`` is planned and checked once; the device half is never read."""
        if self.model is None or self.kv_cache is None or self.kv_pos is None:
            raise RuntimeError("DSparkProposer.load_model() was not called")
        from vllm.forward_context import set_forward_context

        req_ids = list(step.req_ids)
        plan = self.plan(req_ids, step)
        explore = self._serve_step(req_ids, step) if self._base_ms is not None else None
        num_reqs = plan.num_requests
        positions, aux = _first_rows(plan.num_rows, step.positions, step.aux_hidden_states)
        with torch.inference_mode(), set_forward_context(None, self.vllm_config):
            accepted = last_accepted(plan.store, positions, step.num_rejected)
            calibrating = self.calibration is not None and self.rule_on
            if calibrating:
                self.calibration.observe(plan.store.slots, plan.verified, step.num_rejected)
            self._ingest(plan, positions, aux, accepted)
            anchor_pos = draft_anchor_positions(plan, accepted)
            pad = (0, plan.draft_rows - num_reqs)
            anchors = F.pad(step.next_token_ids.long(), pad, value=self.noise_token_id)
            temperature = noise = None
            if step.temperature is not None and self.probabilistic:
                temperature = F.pad(step.temperature, pad)
                seeds = self.request_seeds.lookup(req_ids, step.request_seeds or [None] * num_reqs)
                noise = self.draw_race_noise(seeds, anchor_pos)
            drafts = self._draft(plan, anchors, anchor_pos, temperature, noise)
            if calibrating:
                self.calibration.remember(plan.store.slots, self.last_confidence)
            self._ruled_last = self.rule_on and explore is None
            if explore == ServedStepFit.NARROW or self._ruled_last:
                drafts = self._cut(plan, drafts, narrow=explore is not None)
        self._count(plan, step.num_rejected)
        return drafts.to(torch.int32)

    def _draft(self, plan: StepPlan, anchors, anchor_pos, temperature, noise):
        """``[R, k]`` drafts of the step's requests, pad rows dropped; keeps the block's draft
        probabilities (for the rejection sampler) and the confidence head's inputs."""
        tokens, head, embeds, *probs = self._run_block(
            plan.draft_slots, anchors, anchor_pos, temperature, noise
        )
        num_reqs = plan.num_requests
        self._last_probs = probs[0][:num_reqs] if probs else None
        self._confidence_inputs, self._confidence_rows = (head, embeds), num_reqs
        self._confidence = None
        return tokens if plan.draft_rows == num_reqs else tokens[:num_reqs]

    def _never_cut(self, temperature_cpu, request_seeds) -> np.ndarray | None:
        """Host ``[R]``: the seeded sampled requests. The cut decides how many random draws a
        request makes and is batch-wide: it would make their output depend on their neighbours."""
        if not self.adaptive or temperature_cpu is None or request_seeds is None:
            return None
        seeded = np.fromiter((s is not None for s in request_seeds), bool, len(request_seeds))
        return (np.asarray(temperature_cpu) > 0) & seeded

    def _cut(self, plan: StepPlan, drafts: torch.Tensor, narrow=False) -> torch.Tensor:
        """Drafts past each request's budget by the calibrated confidence replaced by ``CUT``
        (device); ``narrow`` (exploring) admits one per request (seeded sampled ones keep k),
        hysteresis untouched. Async scheduling keeps drafts whole (slots already reserved) and
        hands back the budgets."""
        num_reqs, k = plan.num_requests, self.num_speculative_tokens
        confidence = self.last_confidence
        if self.calibration is not None:
            confidence = self.calibration.apply(confidence)
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
                confidence, eligible, num_ranked=num_ranked,
                num_whole_drafts=plan.num_never_cut * k, max_drafts=max_drafts,
                step_ms=self._step_ms[num_reqs, num_reqs : num_reqs + max_drafts + 1],
                min_gain=self.min_gain, whole=whole, cutting=None if narrow else self._cutting,
            )
            if not self.async_scheduling:
                return apply_cut(drafts, keep)
            self._draft_budgets = draft_budgets(keep, drafting)
            return drafts

    def use_cost_table(
        self, table: cost_table.StepCostTable, min_gain: float = cost_table.DEFAULT_MIN_GAIN
    ) -> None:
        """Cut by ``table`` from now on (adaptive only) and decide whether the rule runs."""
        if not self.adaptive:
            raise ValueError("use_cost_table needs enable_adaptive_verification")
        self.cost_table, self.min_gain = table, float(min_gain)
        self._base_ms = table.matrix(self.max_num_seqs, self._max_rows)
        self._step_ms = torch.from_numpy(self._base_ms.copy()).to(self.device)
        self._cutting = torch.zeros((), dtype=torch.bool, device=self.device)
        self.served = ServedStepFit(clock=self.served.clock)
        self.calibration = SlotCalibration(self.max_num_seqs, self.num_speculative_tokens, self.device)
        self.rest = RuleRest()
        gain = self._decide_rule(table)
        logger.info(
            "DSpark adaptive verification (%s): step time in ms by requests and drafts per "
            "request (measured in %.1f s, %d passes)\n%s\nmost a cut could gain: %.1f%% "
            "(min %.0f%%), row budget %s: the cut %s",
            self.adaptive_mode, table.measure_seconds, table.passes, table.describe(), 100 * gain,
            100 * self.min_gain, self.row_budget,
            self._rule_state(),
        )

    def _decide_rule(self, table: cost_table.StepCostTable) -> float:
        """Set ``rule_on`` from ``table`` (measured or corrected): ``auto`` runs the rule where
        some cut gains ``min_gain`` or the row budget binds. Returns the most a cut could gain."""
        budget_binds = self.row_budget is not None and self._max_rows > self.row_budget
        gain = table.max_gain(self.max_num_seqs)
        self._rule_pays = self.adaptive_mode == "on" or budget_binds or gain >= self.min_gain
        self._can_rest = self.adaptive_mode == "auto" and not budget_binds
        self._set_rule(self._rule_pays and not self.rest.resting)
        return gain

    def _rule_state(self) -> str:
        if self.rule_on:
            return "runs every step"
        return "rests (it cut nothing lately)" if self.rest.resting else "is off (no gain to make)"

    def _set_rule(self, on: bool) -> None:
        if on and not self.rule_on and self.calibration is not None:
            self.calibration.forget()  # no block was remembered while the rule was off
        self.rule_on = on

    def _rest_or_wake(self, drafts: np.ndarray, decode_only: bool) -> None:
        """``auto``: rest the rule after a run of steps it cut nothing from (``rule_rest``),
        host only: this step's scheduled ``drafts`` per request are what the last cut admitted."""
        judged = self._can_rest and self._ruled_last and decode_only
        admitted_all = judged and bool((drafts == self.num_speculative_tokens).all())
        change = self.rest.step(judged, admitted_all)
        if change == RuleRest.REST:
            self._set_rule(False)
            logger.debug("DSpark adaptive verification: %d steps cut nothing, the rule rests "
                         "for %d", self.rest.rest_after, self.rest.rest_for)
        elif change == RuleRest.WAKE:
            self._set_rule(self._rule_pays)

    def _serve_step(self, req_ids: list[str], step: DSparkStepInput) -> str | None:
        """Observe this step's served time and what the last cut admitted, refit now and then
        (proposals count alike on every TP rank). Returns how this step explores
        (``ServedStepFit.explore``) or None."""
        num_reqs = len(req_ids)
        rows = int(step.query_start_loc_cpu[num_reqs])
        drafts = np.asarray(step.num_draft_tokens[:num_reqs])  # scheduled, per request
        decode_only = num_reqs > 0 and rows <= self._base_ms.shape[1] - 1 and np.array_equal(
            np.diff(step.query_start_loc_cpu[: num_reqs + 1]), drafts + 1,
        )
        table_ms = float(self._base_ms[num_reqs, rows]) if decode_only else 0.0
        self.served.step(req_ids, decode_only, table_ms)
        self._rest_or_wake(drafts, decode_only)
        every = REFIT_UNFITTED if self.served.fitted is None else REFIT_EVERY
        if self.served.proposals % every == every - 1:
            self._refit()
        return self.served.explore()

    def _refit(self) -> None:
        """Rank 0's fit of served steps becomes every rank's table: ``a + b * measured``."""
        rank, _ = self._tp_rank_group()
        before = self.served.fitted
        fitted, pinned = self._broadcast(
            (self.served.fit(), self.served.pinned) if rank == 0 else None)
        self.served.fitted = fitted or self.served.fitted  # fit() keeps its own on rank 0
        self.served.pinned = pinned  # every rank explores as rank 0's fit says
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
            self._rule_state(),
        )

    def prepare_cost_table(self, runner) -> None:
        """Once per engine, before its first step: read the table from the cache or measure
        it with ``runner``'s dummy forwards (collective: every TP rank), rank 0's for all."""
        if not self.adaptive or self._table_tried or self.cost_table is not None:
            return
        self._table_tried = True
        rank, _ = self._tp_rank_group()
        path = cost_table.cache_path(cost_table.table_key(table_settings(self)))
        table = cost_table.read_cached(path) if rank == 0 else None
        need = self._broadcast(table is None)
        if need:
            max_rows = min(self._max_rows, int(runner.max_num_tokens))
            self._measuring = True
            try:
                table = cost_table.measure(
                    lambda r, w: time_verify_step(self, runner, r, w), self.draft_sizes,
                    self.num_speculative_tokens, row_budget=self.row_budget, max_rows=max_rows,
                    agree=lambda stop: self._broadcast(stop if rank == 0 else None),
                )
            finally:
                self._measuring = False
            if rank == 0 and table.spread <= cost_table.MAX_CACHED_SPREAD:
                cost_table.write_cached(path, table)
            elif rank == 0:
                logger.warning(
                    "DSpark cost table: its timing passes were %.0f%% above their fastest "
                    "(median; a busy machine); used now, not cached, measured again at the "
                    "next start",
                    100 * table.spread,
                )
        if self.tp_size > 1:
            text = self._broadcast(table.to_json() if rank == 0 else None)
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
        """Ring rows for ``req_ids`` and the step plan; a refused step gives new ids' rows back."""
        rank, group = self._tp_rank_group()
        new_ids = [rid for rid in req_ids if rid not in self.slot_table.held_ids]
        slots = self.slot_table.assign(req_ids)
        try:
            return plan_step(
                step.query_start_loc_cpu, slots, num_draft_tokens=step.num_draft_tokens,
                prefilling=step.prefilling, temperature_cpu=step.temperature_cpu,
                never_cut=self._never_cut(step.temperature_cpu, step.request_seeds),
                window=self.window, num_slots=self.max_num_seqs,
                num_spec_tokens=self.num_speculative_tokens, draft_sizes=self.draft_sizes,
                tp_size=self.tp_size, rank=rank, group=group, device=self.device,
            )
        except ValueError:
            self.slot_table.release(new_ids)
            raise

    def _project(self, aux: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``aux [T, m*H]`` -> context KV of all draft layers stacked, ``[T, K * D]``."""
        main_x = self.model.combine_hidden_states(aux.to(self.dtype))
        kv = self.model.context_kv(main_x, positions)
        return kv.reshape(kv.shape[0], -1)

    def _ingest(self, plan: StepPlan, positions, aux, accepted) -> None:
        """Store the step's accepted rows in the rings (packed prefill for big chunks)."""
        if plan.num_rows == 0:
            return
        ring = (self.kv_cache, self.kv_pos)
        if plan.packed is not None:
            ingest_packed_prefill(
                plan.packed, plan.store, aux, positions, self._project, ring,
                max_model_len=max(self.max_model_len, self.max_position), accepted=accepted,
            )
        else:
            store_context_kv(*ring, self._project(aux, positions), positions, plan.store, accepted)

    def _tp_rank_group(self):
        if self.tp_size == 1:
            return 0, None
        from vllm.distributed import get_tensor_model_parallel_rank, get_tp_group

        tp = get_tp_group()
        group = tp.device_group if self.device.type != "cpu" else tp.cpu_group
        return get_tensor_model_parallel_rank(), group

    def _broadcast(self, obj):
        """TP rank 0's ``obj`` on every rank (all ranks must cut alike)."""
        if self.tp_size == 1:
            return obj
        from vllm.distributed import get_tp_group

        return get_tp_group().broadcast_object(obj, src=0)

    def draft_block(
        self, slots: torch.Tensor, anchors: torch.Tensor, anchor_pos: torch.Tensor,
        temperature: torch.Tensor | None, race_noise: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Backbone + Markov head for ``[B]`` draft rows (B a draft size): ``(tokens [B, N],
        head hidden [B, N, H], Markov embeds [B, N, r])`` (+ ``probs [B, N, V]`` when sampling),
        nothing kept on ``self``, so a CUDA graph replay returns the same. Static shapes, no
        host read, no RNG state; reads the rings only; a pad row (scratch slot) attends nothing.
        """
        model, n = self.model, self.num_speculative_tokens
        ids = F.pad(anchors[:, None], (0, n - 1), value=self.noise_token_id)
        pos = draft_block_positions(anchor_pos, n, self.max_model_len, self._block_offsets)
        mask = window_mask(self.kv_pos, slots, anchor_pos, self.window)
        head = model(ids, pos, DraftContext(self.layer_caches(), slots, mask))
        out = markov_block_sample(
            model.compute_logits(head), anchors, model.markov_embed, model.markov_bias,
            temperature=temperature, race_noise=race_noise, return_probs=self.probabilistic,
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
        """``Exp(1)`` race noise ``[B, N, V]`` for ``seeds [R]`` (host; pad rows get 0) at
        ``anchor_pos [B]``: slot k is keyed by (seed, p+k) as upstream, so a seeded request
        drafts the same tokens whatever batch, row or chunking it gets."""
        seeds = F.pad(seeds, (0, anchor_pos.shape[0] - seeds.shape[0]))
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
