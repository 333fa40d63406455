"""`SmurfsProposer`: the vLLM-facing proposer (glue only).

vLLM builds it as a ``custom_class`` proposer in the worker and calls `propose` after every target
step. Per step it (1) scores every drafter's previous draft against the tokens the target
produced and updates the vote weights, (2) asks the length policy for each request's lookahead,
(3) gets each drafter's draft from the `DrafterPool`, and (4) returns the weighted
prefix-tree vote per request. The algorithms live in `vote_sampler` and `length_controller`.

Verification is vLLM's own rejection sampler with the draft treated as one-hot: greedy output is
the target's own, sampled output has the target's distribution.
"""

from __future__ import annotations

import json
import logging
import time
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from vllm_smurfs import cores
from vllm_smurfs.config import ModelDrafterConfig, SmurfsConfig
from vllm_smurfs.metrics import DrafterStats, SmurfsStats
from vllm_smurfs.model_drafting import ModelDrafting
from vllm_smurfs.length_controller import (
    AdaptiveLookahead,
    DraftTiming,
    FixedLookahead,
    LookaheadPolicy,
    RequestView,
    StepFeedback,
    StepTiming,
    room_for_drafts,
)
from vllm_smurfs.multi_draft_worker import DraftRequest, DrafterPool
from vllm_smurfs.step_planner import DrafterOutcome, Plan, PlanRequest, StepPlanner
from vllm_smurfs.trace import TraceRequest, TraceStep
from vllm_smurfs.vote_sampler import (
    DrafterWeights,
    WeightUpdateRule,
    matched_prefix_len,
    score_draft,
    weighted_prefix_vote,
)

logger = logging.getLogger(__name__)

#: Token counts whose GEMMs are created with all the target's threads at start-up when it lends
#: cores to model drafters (vLLM keeps 32 per layer): the decode steps of small batches.
_WARM_TOKEN_COUNTS = 32


@dataclass(frozen=True)
class StepContext:
    """What vLLM knows about the batch and does not pass to custom proposers (see patches)."""

    req_ids: list[str]  # [num_reqs] in the row order of propose()'s arrays
    finished_req_ids: frozenset[str]  # finished or aborted since the last step
    restarted_req_ids: frozenset[str]  # preempted or resumed: their old drafts are void
    max_spec_tokens: int  # the scheduler's lookahead cap for this step (0 = none given)
    # The drafts verified in this step, as the scheduler sent them (it may cut a draft short,
    # e.g. near max_tokens); None when unknown: the proposer's own last draft is assumed.
    verified_drafts: Mapping[str, list[int]] | None = None
    num_scheduled_tokens: int = 0  # tokens the target computes in this step (drafts, prefills)
    # The model runner (in-worker drafters address their KV cache through its block tables, and
    # the planner reads each request's remaining token budget); None in unit tests.
    runner: Any = None


@dataclass
class _RequestState:
    weights: DrafterWeights
    drafts: list[list[int]] | None = None  # each drafter's draft of the last step
    voted: list[int] | None = None  # the chain sent to the target last step
    chosen: int = 0  # the lookahead the policy chose for it last step
    # In-worker drafting: each drafter's probability of each of its draft tokens (empty for the
    # others), the model-free voters' chain, and whether the model drafters drafted for it.
    confidences: list[list[float]] | None = None
    free_chain: list[int] | None = None
    models: bool = False


def make_policy(config: SmurfsConfig, drafting: ModelDrafting | None = None) -> LookaheadPolicy:
    """The lookahead policy ``config.lookahead`` asks for (drafting with process drafters);
    ``drafting``: the record of whether the model drafters draft, for the adaptive policy."""
    if config.lookahead.policy == "fixed":
        return FixedLookahead(config.num_speculative_tokens)
    return AdaptiveLookahead(config.num_speculative_tokens,
                             min_lookahead=config.lookahead.min_tokens,
                             pipelined=config.pipeline,
                             # min_tokens >= 1 asks for model drafts in every step.
                             model_free_mode=config.lookahead.pause_drafters
                             and bool(config.model_drafters)
                             and config.lookahead.min_tokens == 0,
                             drafting=drafting)


def in_worker_mode(config: SmurfsConfig) -> bool:
    """Whether steps are planned for synchronous in-worker drafting: every model drafter is in
    the target's worker (with a process drafter, the streaming machinery and its policy lead,
    and in-worker drafters draft each step's chosen lookahead)."""
    return bool(config.worker_drafters) and not config.process_drafters


def make_planner(config: SmurfsConfig) -> StepPlanner | None:
    """The adaptive controller of in-worker drafting (None: a fixed lookahead)."""
    if not in_worker_mode(config) or config.lookahead.policy == "fixed":
        return None
    return StepPlanner(config.num_speculative_tokens, len(config.worker_drafters),
                       min_lookahead=config.lookahead.min_tokens,
                       pause_models=config.lookahead.pause_drafters)


def owns_drafters() -> bool:
    """Whether this worker drafts. Exactly one does under tensor or pipeline parallelism: the
    first tensor-parallel rank of the last pipeline stage, whose drafts the engine takes (the
    scheduler then sends them to every rank to verify); the others start no drafter."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank() == 0 and get_pp_group().is_last_rank
    except (ImportError, AssertionError):  # no distributed state: a single worker
        return True


def _without_model_drafters(config: SmurfsConfig) -> SmurfsConfig:
    return config.model_copy(update={"drafters": [
        d for d in config.drafters if not isinstance(d, ModelDrafterConfig)]})


def _in_worker_drafter(spec: Any, index: int, vllm_config: Any, num_speculative_tokens: int) -> Any:
    # Imported here: it imports vLLM's model machinery (the proposer's own tests run without).
    from vllm_smurfs.in_worker_drafter import InWorkerDrafter

    return InWorkerDrafter(spec, index, vllm_config, num_speculative_tokens)


def _remaining_tokens(runner: Any, req_id: str) -> int | None:
    """Output tokens a request may still produce (its max_tokens left), when the runner says."""
    state = getattr(runner, "requests", {}).get(req_id) if runner is not None else None
    max_tokens = getattr(getattr(state, "sampling_params", None), "max_tokens", None)
    if max_tokens is None:
        return None
    return max(0, int(max_tokens) - len(getattr(state, "output_token_ids", ())))


class SmurfsProposer:
    """Collective drafting with a weighted prefix-tree vote (``method: smurfs``)."""

    def __init__(self, vllm_config: Any) -> None:
        self.config = SmurfsConfig.from_additional_config(vllm_config.additional_config)
        model_config = vllm_config.model_config
        self.num_speculative_tokens = self.config.num_speculative_tokens
        self.max_model_len = model_config.max_model_len
        # Whether the model drafters draft: the one record, which the policy, the drafter pool
        # (and through it the target's lent cores) consult or are told by.
        self.model_drafting = ModelDrafting()
        self.policy = make_policy(self.config, self.model_drafting)
        self.in_worker_mode = in_worker_mode(self.config)
        self.planner = make_planner(self.config)
        self.rule = WeightUpdateRule(**self.config.vote.model_dump())
        self.global_weights = DrafterWeights([d.weight for d in self.config.drafters], self.rule)
        self.owns_drafters = owns_drafters()
        self.worker = DrafterPool(
            self.config if self.owns_drafters else _without_model_drafters(self.config),
            dtype=str(model_config.dtype).removeprefix("torch."),
            max_model_len=self.max_model_len,
            max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
            trust_remote_code=model_config.trust_remote_code,
            in_worker=lambda index, spec: _in_worker_drafter(spec, index, vllm_config,
                                                              self.num_speculative_tokens),
        )
        self.stats = SmurfsStats(drafters=[DrafterStats(n) for n in self.worker.names])
        self._states: dict[str, _RequestState] = {}
        self._step: StepContext | None = None
        self._last_log = time.monotonic()
        self._returned_at: float | None = None  # when propose() last returned
        self._overhead_s = 0.0  # how long the last propose() took
        self._trace: TextIO | None = None
        if self.config.trace_file:
            # Line-buffered: a trace of a run that is killed keeps every step it finished.
            path = self.config.trace_file
            self._trace = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
            weakref.finalize(self, self._trace.close)  # when the engine lets the proposer go
        self.model_drafting.subscribe(self.worker.use_models)
        self._last_req_ids: frozenset[str] = frozenset()
        # Requests that were running when the model drafters (re)started and that they have not
        # delivered a draft for since: they are re-prefilling them (a paused drafter drops its
        # requests), so a lookahead they leave undelivered is the switch's one-off cost, not
        # what a lookahead brings; requests that arrive later count from their start.
        self._catching_up: set[str] = set()
        self._models_ready = True  # the model drafters had caught up with the last step
        self._plan_record: dict[str, Any] | None = None  # the last in-worker plan, for the trace

    # -- vLLM's proposer interface ------------------------------------------------------------
    def load_model(self, target_model: Any = None) -> None:
        for drafter in self.in_worker_drafters:
            try:
                drafter.load(target_model)
            except Exception as exc:  # noqa: BLE001 - a drafter that cannot load costs speculation
                logger.exception("Smurfs in-worker drafter %s could not load", drafter.name)
                drafter.fail(f"could not load: {type(exc).__name__}: {exc}")
        self.worker.start()
        if self.worker.lends_cores and target_model is not None:
            # Before any core is lent: the GEMMs of decode-sized steps, created now with all
            # the target's threads, keep them (see before_forward).
            cores.warm_gemms(target_model, range(1, _WARM_TOKEN_COUNTS + 1))

    def before_forward(self, prompt_tokens: int) -> None:
        """The target is about to compute a step with ``prompt_tokens`` prompt-chunk tokens.

        A CPU GEMM primitive keeps the thread count it was created with and vLLM caches one per
        token count: a step computed while the target lends cores to the model drafters can
        leave its token count on fewer threads for good (a 2048-token prefill step ran at half
        speed for the rest of a served run). Prompt chunks bring new token counts, so such a
        step gets the cores back first: the model drafters pause (their drafts for it are
        taken already) and the step counts as one without them.
        """
        if prompt_tokens > 0 and self.worker.lends_cores and self.model_drafting.take_back():
            self._catching_up = set()
            self.stats.prefill_takebacks += 1

    @property
    def in_worker_drafters(self) -> list[Any]:
        return [self.worker.drafters[i] for i in self.worker.in_worker_indices]

    def initialize_attn_backend(self, kv_cache_config: Any,
                                kernel_block_sizes: list[int] | None = None) -> None:
        """The runner has sized the KV cache (the in-worker drafters' layers included): give
        each in-worker drafter its attention groups (see patches.model_runner_kv_cache)."""
        for drafter in self.in_worker_drafters:
            if drafter.health.alive:
                drafter.initialize_attn_backend(kv_cache_config, kernel_block_sizes)

    @property
    def draft_attn_groups(self) -> list[Any]:
        """The in-worker drafters' attention groups (the runner maps their KV cache blocks)."""
        return [group for drafter in self.in_worker_drafters
                for group in drafter.draft_attn_groups]

    def begin_step(self, step: StepContext) -> None:
        self._step = step

    def propose(
        self,
        sampled_token_ids: list[list[int]],  # [num_reqs][tokens produced this step]
        num_tokens_no_spec: np.ndarray,  # [>= num_reqs] context length per row
        token_ids_cpu: np.ndarray,  # [>= num_reqs, max_model_len] context tokens per row
        slot_mappings: Any = None,  # unused: drafters address their KV caches themselves
    ) -> list[list[int]]:
        called = time.perf_counter()
        step, self._step = self._step, None
        if not self.owns_drafters:
            return [[] for _ in sampled_token_ids]  # the engine takes the drafting rank's drafts
        if step is None or len(step.req_ids) != len(sampled_token_ids):
            raise RuntimeError(
                "SmurfsProposer was called without its step context: the vllm_smurfs patch of "
                "GPUModelRunner.propose_draft_token_ids is not applied (is the plugin loaded?)"
            )
        step_s = None
        if self._returned_at is not None and self._last_req_ids.intersection(step.req_ids):
            # From our last return to this call the target ran a step: schedule, forward, sample.
            # (With no request in common the engine may have been idle in between: not timed.)
            step_s = called - self._returned_at
            self.stats.target_step_s += step_s
            timing = StepTiming(len(step.req_ids), step.num_scheduled_tokens, step_s,
                                drafting=self.model_drafting.on, overhead_s=self._overhead_s)
            if self.planner is not None:
                self.planner.observe_step(timing)
            else:
                self.policy.observe_step(timing)
        self._last_req_ids = frozenset(step.req_ids)
        self.forget(step.finished_req_ids | step.restarted_req_ids)
        feedback = self._learn(step, sampled_token_ids)
        # Streaming drafters report each engine step: one position for every sequence in it.
        draft_timings = [DraftTiming(n, 1, s) for n, s in self.worker.step_timings()]
        for timing in draft_timings:
            self.policy.observe_draft(timing)
        if self._trace is not None and step_s is not None:
            self._write_trace(step, sampled_token_ids, num_tokens_no_spec, feedback, step_s,
                              draft_timings)

        rows = [i for i, sampled in enumerate(sampled_token_ids) if sampled]
        views = [RequestView(step.req_ids[i], int(num_tokens_no_spec[i]), self.max_model_len)
                 for i in rows]
        max_lookahead = min(step.max_spec_tokens or self.num_speculative_tokens,
                            self.num_speculative_tokens)
        contexts = [token_ids_cpu[i, : view.num_tokens].copy() for i, view in zip(rows, views)]
        free = self.worker.model_free_drafts([DraftRequest(view.req_id, context, max_lookahead)
                                        for view, context in zip(views, contexts)])
        for state in (self._states.get(step.req_ids[i]) for i in rows):
            if state is not None:
                state.drafts = state.voted = state.confidences = state.free_chain = None
                state.models = False
        proposals: list[list[int]] = [[] for _ in sampled_token_ids]
        drafting = 0.0
        if self.in_worker_mode:
            drafting = self._propose_in_worker(step, rows, views, contexts, free, max_lookahead,
                                               proposals)
        else:
            drafting = self._propose_streaming(step, rows, views, contexts, free, max_lookahead,
                                               proposals)
        self.stats.steps += 1
        self._maybe_log()
        self._returned_at = time.perf_counter()
        # The proposer's own time, less the in-worker forwards (priced on their own curves).
        self._overhead_s = self._returned_at - called - drafting
        self.stats.proposer_s += self._returned_at - called
        return proposals

    def _propose_streaming(self, step: StepContext, rows: list[int], views: list[RequestView],
                           contexts: list[np.ndarray], free: list[list[list[int]]],
                           max_lookahead: int, proposals: list[list[int]]) -> float:
        """A step with process drafters: the policy chooses the lookaheads and whether the model
        drafters draft; streamed drafts are taken as they are ready (in-worker drafters, if
        any, draft the chosen lookaheads). Returns the seconds in-worker forwards took."""
        lookaheads = self.policy.choose(views, max_lookahead,
                                        [max(map(len, per), default=0) for per in free])
        # Model drafters draft (and borrow the cores they share with the target) only for a
        # step the policy gives to them and that drafts anything.
        models = (self.policy.models_on and any(lookaheads) and self.worker.models_alive)
        # A switch starts (the drafters must catch up with the requests running) or pauses
        # them; the pool is told by `model_drafting` and lends or takes back the shared cores.
        if self.model_drafting.step(models):
            self._catching_up = {view.req_id for view in views} if models else set()
        self.stats.steps_without_models += not models
        chosen = [(i, view, k, context, per) for i, view, k, context, per
                  in zip(rows, views, lookaheads, contexts, free) if k > 0]
        requests = [DraftRequest(view.req_id, context, k) for _, view, k, context, _ in chosen]
        drafts = self._collect(requests, [view for _, view, _, _, _ in chosen], models,
                               [per for *_, per in chosen])
        drafting_s = 0.0
        for d in self.worker.in_worker_indices if models else ():
            drafter = self.worker.drafters[d]
            picked = [n for n, (_, view, *_) in enumerate(chosen)
                      if drafter.can_draft(view.num_tokens)]
            if not picked:
                continue
            result = drafter.draft_safely(
                [requests[n].req_id for n in picked],
                np.asarray([chosen[n][0] for n in picked]),
                [requests[n].context for n in picked], [requests[n].k for n in picked],
                step.runner, None)
            drafting_s += sum(p.seconds for p in result.passes)
            for n, tokens in zip(picked, result.tokens):
                drafts[n][d] = tokens
        voted = []
        for (row, *_), request, per_drafter in zip(chosen, requests, drafts):
            voted.append(self._vote(request.req_id, row, request.k, per_drafter, proposals))
        if self.config.pipeline and models:
            # Drafters go on past the chains while the target verifies them.
            self.worker.track(requests, voted, [self._max_lead(r.k) for r in requests])
        self.stats.drafting_s += drafting_s
        return drafting_s

    def _propose_in_worker(self, step: StepContext, rows: list[int], views: list[RequestView],
                           contexts: list[np.ndarray], free: list[list[list[int]]],
                           max_lookahead: int, proposals: list[list[int]]) -> float:
        """A step with in-worker drafters: plan it, draft in the target's worker, vote.
        Returns the seconds the drafters' forwards took."""
        n = len(views)
        model_free_indices = self.worker.model_free_indices
        in_worker = self.worker.in_worker_indices
        drafters = [self.worker.drafters[d] for d in in_worker]
        # The model-free voters' own chain per request, at the longest lookahead.
        free_chains = []
        for view, per in zip(views, free):
            weights = self._state(view.req_id).weights.weights
            free_chains.append(weighted_prefix_vote(
                [per[d] for d in model_free_indices], [weights[d] for d in model_free_indices],
                max_len=max_lookahead).tokens if model_free_indices else [])
        if self.planner is not None:
            plan = self.planner.plan([
                PlanRequest(view.req_id, view.num_tokens, view.max_model_len, len(chain),
                            tuple(d.catch_up_tokens(view.req_id, view.num_tokens)
                                  if d.can_draft(view.num_tokens) else None for d in drafters),
                            remaining=_remaining_tokens(step.runner, view.req_id))
                for view, chain in zip(views, free_chains)], max_lookahead)
        else:
            ks = self.policy.choose(views, max_lookahead)
            plan = Plan(lookaheads=ks, free_lens=list(ks),
                        model_rows=[[i for i in range(n) if ks[i] > 0
                                     and d.can_draft(views[i].num_tokens)] for d in drafters],
                        rate=0.0, verify_s=0.0, mode="fixed")
        self.stats.steps_without_models += not plan.models
        tokens: list[list[list[int]]] = [[[] for _ in drafters] for _ in range(n)]
        confidences: list[list[list[float]]] = [[[] for _ in drafters] for _ in range(n)]
        drafting_s = 0.0
        for j, drafter in enumerate(drafters):
            selected = plan.model_rows[j]
            if not selected or not drafter.health.alive:
                continue
            # The planner's drafts stop by confidence, up to the longest lookahead allowed.
            caps = [plan.lookaheads[i] if self.planner is None
                    else min(max_lookahead, room_for_drafts(views[i])) for i in selected]
            stop = None
            if self.planner is not None:
                planner, index = self.planner, j

                def stop(active: list[int], confs: list[list[float]], spent_s: float,
                         planner=planner, index=index) -> list[int]:
                    return planner.keep_drafting(plan, index, active, confs, spent_s)
            result = drafter.draft_safely(
                [views[i].req_id for i in selected], np.asarray([rows[i] for i in selected]),
                [contexts[i] for i in selected], caps, step.runner, stop)
            for p in result.passes:
                drafting_s += p.seconds
                self.stats.drafter_forwards += 1
                self.stats.drafter_tokens += p.num_tokens
                if self.planner is not None:
                    self.planner.observe_pass(j, p.num_tokens, p.seconds)
            for local, i in enumerate(selected):
                tokens[i][j] = result.tokens[local]
                confidences[i][j] = result.confidences[local]
        self.stats.drafting_s += drafting_s
        in_model_rows = {i for selected in plan.model_rows for i in selected}
        if self._trace is not None:
            self._plan_record = {
                "mode": plan.mode, "rate": round(plan.rate, 4), "lookaheads": plan.lookaheads,
                "free": [len(c) for c in free_chains],
                "model": [[len(t) for t in per] for per in tokens],
                "drafting_s": round(drafting_s, 5)}
        for i, view in enumerate(views):
            per = [[] for _ in self.worker.drafters]
            free_cap = max_lookahead if i in in_model_rows else plan.free_lens[i]
            for d in model_free_indices:
                per[d] = free[i][d][:free_cap]
            for j, d in enumerate(in_worker):
                per[d] = tokens[i][j]
            k = max(map(len, per), default=0)
            self.stats.requests_drafted += k > 0
            if k == 0:
                continue
            self._vote(view.req_id, rows[i], k, per, proposals)
            state = self._state(view.req_id)
            state.confidences = [[] for _ in self.worker.drafters]
            for j, d in enumerate(in_worker):
                state.confidences[d] = confidences[i][j]
            state.free_chain = free_chains[i]
            state.models = i in in_model_rows
        return drafting_s

    def _vote(self, req_id: str, row: int, k: int, per_drafter: list[list[int]],
              proposals: list[list[int]]) -> list[int]:
        state = self._state(req_id)
        vote = weighted_prefix_vote(per_drafter, state.weights.weights, max_len=k)
        state.drafts, state.voted, state.chosen = per_drafter, vote.tokens, k
        proposals[row] = vote.tokens
        self._count_proposal(vote.tokens, vote.winner)
        return vote.tokens

    def _collect(self, requests: list[DraftRequest], views: list[RequestView], models: bool,
                 free: list[list[list[int]]]) -> list[list[list[int]]]:
        """Every drafter's draft of every request: what is ready, after waiting if worth it
        (only the model-free voters' unless ``models``; theirs are ``free``, taken already)."""
        self.worker.poll()
        if not requests:
            return []
        started = time.perf_counter()
        if models and self.config.pipeline:
            # Drafters stream: wait one drafter step at a time while the policy finds the
            # tokens it brings worth the step's time, within draft_wait_s in all.
            budget = self.config.draft_wait_s
            while (late := self.worker.late(requests)):
                left = budget - (time.perf_counter() - started)
                wait_s = self.policy.wait_bound([views[i] for i, _ in late],
                                                [ready for _, ready in late], max(0.0, left))
                if wait_s <= 0:
                    break
                self.worker.wait([requests[i] for i, _ in late], wait_s)
        elif models:
            # Synchronous: draft exactly what this step verifies, then wait for it.
            self.worker.track(requests, [[] for _ in requests], [r.k for r in requests])
            self.worker.wait(requests, self.config.draft_timeout_s)
        self.stats.wait_s += time.perf_counter() - started
        drafts = self.worker.ready(requests, models, free)
        if models:
            model_rows = self.worker.model_indices
            for request, per in zip(requests, drafts):
                if any(per[d] for d in model_rows):
                    self._catching_up.discard(request.req_id)
            self._models_ready = not any(r.req_id in self._catching_up for r in requests)
        self.stats.requests_drafted += len(requests)
        self.stats.requests_without_draft += sum(1 for per in drafts if not any(per))
        return drafts

    @staticmethod
    def _max_lead(k: int) -> int:
        # Past the chain now verified: its bonus token and a full next draft, twice over, so a
        # fully accepted chain finds the next one ready and the drafter seldom pauses.
        return 2 * (k + 1)

    # -- state ----------------------------------------------------------------------------------
    def forget(self, req_ids: Iterable[str]) -> None:
        req_ids = list(req_ids)
        for req_id in req_ids:
            self._states.pop(req_id, None)
        self._catching_up.difference_update(req_ids)
        self.policy.forget(req_ids)
        if self.planner is not None:
            self.planner.forget(req_ids)
        self.worker.forget(req_ids)

    def _state(self, req_id: str) -> _RequestState:
        state = self._states.get(req_id)
        if state is None:
            # A new request starts from what all requests taught the vote so far.
            state = self._states[req_id] = _RequestState(self.global_weights.copy())
        return state

    def _learn(self, step: StepContext,
               sampled_token_ids: list[list[int]]) -> list[StepFeedback]:
        """Score every drafter's last draft against what the target produced."""
        feedback = []
        in_worker = self.worker.in_worker_indices if self.planner is not None else []
        free_outcomes: list[tuple[str, DrafterOutcome]] = []
        voted_with_models: list[StepFeedback] = []
        model_outcomes: list[list[DrafterOutcome]] = [[] for _ in in_worker]
        for req_id, produced in zip(step.req_ids, sampled_token_ids):
            state = self._states.get(req_id)
            if state is None or state.voted is None or state.drafts is None or not produced:
                continue
            verified = (state.voted if step.verified_drafts is None
                        else step.verified_drafts.get(req_id, []))
            # The policy learns what a lookahead brings: chosen tokens no drafter had ready in
            # time count as rejected (the scheduler's own cuts do not), except while the model
            # drafters catch up after a switch.
            shortfall = (max(0, state.chosen - len(state.voted))
                         if req_id not in self._catching_up else 0)
            accepted = matched_prefix_len(verified, produced)
            if verified or shortfall:
                feedback.append(StepFeedback(req_id, len(verified) + shortfall, accepted))
            if verified:
                self.stats.verified_drafts += 1
                self.stats.verified_draft_tokens += len(verified)
                self.stats.accepted_tokens += accepted
            # Every drafter is judged on what the target produced, verified draft or not.
            scores = [score_draft(draft, produced) for draft in state.drafts]
            state.weights.update(scores)
            self.global_weights.update(scores)
            for drafter_stats, draft in zip(self.stats.drafters, state.drafts):
                drafter_stats.drafted_tokens += len(draft)
                drafter_stats.accepted_tokens += matched_prefix_len(draft, produced)
            if self.planner is not None:
                if state.free_chain:
                    free_outcomes.append((req_id, DrafterOutcome(
                        len(state.free_chain), matched_prefix_len(state.free_chain, produced),
                        len(produced))))
                if state.models and verified:
                    voted_with_models.append(StepFeedback(req_id, len(verified), accepted))
                for j, d in enumerate(in_worker):
                    draft = state.drafts[d]
                    if draft and state.confidences is not None:
                        model_outcomes[j].append(DrafterOutcome(
                            len(draft), matched_prefix_len(draft, produced), len(produced),
                            tuple(state.confidences[d])))
            state.voted = state.drafts = state.confidences = state.free_chain = None
        for drafter_stats, weight in zip(self.stats.drafters, self.global_weights.weights):
            drafter_stats.weight = weight
        if self.planner is not None:
            self.planner.observe(free_outcomes, voted_with_models, model_outcomes)
        else:
            self.policy.observe(feedback, models_ready=self._models_ready)
        self._models_ready = True
        return feedback

    def _write_trace(self, step: StepContext, sampled_token_ids: list[list[int]],
                     num_tokens_no_spec: np.ndarray, feedback: list[StepFeedback],
                     step_s: float, draft_timings: list[DraftTiming]) -> None:
        """One line of the ``trace_file`` (format: `vllm_smurfs.trace_sim`)."""
        assert self._trace is not None
        verified = {f.req_id: f for f in feedback}
        requests = []
        for i, (req_id, produced) in enumerate(zip(step.req_ids, sampled_token_ids)):
            if not produced:
                continue
            fb = verified.get(req_id)
            requests.append(TraceRequest(req_id, int(num_tokens_no_spec[i]) - len(produced),
                                         fb.num_draft_tokens if fb else 0,
                                         fb.num_accepted if fb else 0))
        line = TraceStep(self.stats.steps, time.monotonic(), step_s, step.num_scheduled_tokens,
                         tuple(requests), tuple(draft_timings),
                         drafting=self.model_drafting.on).to_dict()
        if self._plan_record is not None:
            line["plan"] = self._plan_record  # in-worker drafting: what the last step planned
        self._trace.write(json.dumps(line, separators=(",", ":")) + "\n")

    def _count_proposal(self, voted: list[int], winner: int) -> None:
        if voted:
            self.stats.proposed_drafts += 1
            self.stats.drafters[winner].vote_wins += 1

    # -- metrics --------------------------------------------------------------------------------
    def get_stats(self) -> dict[str, Any]:
        out = self.stats.as_dict()
        for entry, health in zip(out["drafters"], self.worker.health()):
            entry["alive"] = health.alive
            entry["steps_late"] = health.steps_late
            entry["engine_steps"] = health.steps_answered
            entry["busy_s"] = round(health.busy_s, 4)
            if "replacements" in health.extra:  # a Ray drafter: actors started after its first
                entry["replacements"] = health.extra["replacements"]
        if self.planner is not None:
            out["controller"] = self.planner.snapshot()
        return out

    def _maybe_log(self) -> None:
        interval = self.config.log_stats_interval_s
        if interval <= 0 or time.monotonic() - self._last_log < interval:
            return
        self._last_log = time.monotonic()
        logger.info("Smurfs drafters: %s", json.dumps(self.get_stats()))

    # -- issue 23 (request lifecycle): called by patches.model_runner_execute and the tests ------
    # Kept apart from the controller: the lead re-applies these two methods to its rewrite.
    def propose_skipped(self) -> None:
        """vLLM ran a target step and did not call `propose` after it (a step with a request
        within num_speculative_tokens of max_model_len, or one that the engine core could not
        draft for). The drafts sent for that step were verified without us seeing the outcome:
        none may be scored later against another step's tokens, and the next step is not timed
        from our last return (two steps apart)."""
        for state in self._states.values():
            state.drafts = state.voted = state.confidences = state.free_chain = None
            state.models = False
        self._returned_at = None

    def live_request_state(self) -> dict[str, int]:
        """Per-request entries held now, by holder: nothing may outlive its request (the tests
        check it after generate() calls). 'pending_drafts': requests holding a draft that awaits
        its verification."""
        return {
            "requests": len(self._states),
            "pending_drafts": sum(s.voted is not None for s in self._states.values()),
            "catching_up": len(self._catching_up),
            "policy": _per_request_entries(self.policy),
            "planner": _per_request_entries(self.planner) if self.planner is not None else 0,
            "drafters": sum(_per_request_entries(d, depth=0)
                            for d in getattr(self.worker, "drafters", ())),
        }


#: Attributes that hold one entry per live request, in the proposer's parts (the policy's and
#: planner's acceptance models and plans, the drafters' paths and catch-up positions).
_PER_REQUEST_ATTRIBUTES = ("_requests", "_last_drafted", "expected", "_synced", "_paths", "_live",
                           "_sent")


def _per_request_entries(holder: Any, depth: int = 2) -> int:
    """Entries of `_PER_REQUEST_ATTRIBUTES` in ``holder`` and its parts, ``depth`` levels down."""
    try:
        attributes = vars(holder)
    except TypeError:
        return 0
    count = 0
    for name, value in attributes.items():
        if name in _PER_REQUEST_ATTRIBUTES and isinstance(value, (dict, set)):
            count += len(value)
        elif depth > 0 and hasattr(value, "__dict__") and not isinstance(value, type):
            count += _per_request_entries(value, depth - 1)
    return count
