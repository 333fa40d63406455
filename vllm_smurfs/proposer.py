"""`SmurfsProposer`: the vLLM-facing proposer (glue only).

vLLM builds it as a ``custom_class`` proposer in the worker and calls `propose` after every target
step. Per step it (1) scores every drafter's previous draft against the tokens the target
produced, updates the vote weights and tells the controller what the step taught (acceptance,
the step's and the drafters' times), (2) describes the running requests to the controller and
takes its plan, (3) drafts by it (model-free voters, streamed drafts, in-worker forwards that
stop by the controller's rule), and (4) returns the weighted prefix-tree vote per request, or, for
a request that samples (temperature > 0), the chain of the mixture rule. The algorithms live in
`vote_sampler` and `length_controller`, the bookkeeping of what a step taught in `step_outcomes`.

Verification is vLLM's own rejection sampler. Greedy requests' chains are verified as one-hot
drafts: greedy output is the target's own. When a request samples, its in-worker drafters sample
too (`drafters.sampling`), and the proposer hands the runner each chain position's mixture q
(`take_last_draft_probs`, read by patches.model_runner_propose): sampled output has the target's
distribution.
"""

from __future__ import annotations

import json
import logging
import time
import weakref
from collections.abc import Iterable
from typing import Any, TextIO

import numpy as np

from vllm_smurfs import cores
from vllm_smurfs.config import ModelDrafterConfig, SmurfsConfig
from vllm_smurfs.control.acceptance import temperature_band
from vllm_smurfs.control.feedback import DraftTiming, StepTiming
from vllm_smurfs.control.fixed import FixedLookahead
from vllm_smurfs.control.model_drafting import ModelDrafting
from vllm_smurfs.control.plan import PlanRequest, RequestOutcome
from vllm_smurfs.drafters.sampling import RowSampling, chain_probs, member_uniforms
from vllm_smurfs.length_controller import LengthController
from vllm_smurfs.metrics import DrafterStats, SmurfsStats
from vllm_smurfs.multi_draft_worker import DrafterPool, DraftRequest, collect_streamed
from vllm_smurfs.runner_hooks import StepContext, remaining_tokens
from vllm_smurfs.step_outcomes import RequestState, learn, per_request_entries, trace_requests
from vllm_smurfs.trace.format import TraceStep
from vllm_smurfs.vote_sampler import (
    DrafterWeights,
    WeightUpdateRule,
    sampled_chain,
    weighted_prefix_vote,
)

logger = logging.getLogger(__name__)

#: Token counts whose GEMMs are created with all the target's threads at start-up (vLLM-CPU keeps
#: one oneDNN primitive per token count, built at its first call): the decode steps of small
#: batches, so that their first steps are neither slow nor, when the target lends cores to
#: model drafters, stuck on fewer threads.
_WARM_TOKEN_COUNTS = 32


Controller = LengthController | FixedLookahead


def make_controller(config: SmurfsConfig) -> Controller:
    """The lookahead controller ``config.lookahead`` asks for, priced by where the drafters run."""
    num_worker = len(config.worker_drafters)
    if config.lookahead.policy == "fixed":
        return FixedLookahead(config.num_speculative_tokens, num_worker)
    external = bool(config.process_drafters)
    return LengthController(config.num_speculative_tokens, num_worker,
                            streaming=external and config.pipeline,
                            sync_drafters=external and not config.pipeline,
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
    from vllm_smurfs.drafters.in_worker import InWorkerDrafter

    return InWorkerDrafter(spec, index, vllm_config, num_speculative_tokens)


class SmurfsProposer:
    """Collective drafting with a weighted prefix-tree vote (``method: smurfs``)."""

    def __init__(self, vllm_config: Any) -> None:
        self.config = SmurfsConfig.from_additional_config(vllm_config.additional_config)
        model_config = vllm_config.model_config
        self.num_speculative_tokens = self.config.num_speculative_tokens
        self.max_model_len = model_config.max_model_len
        # Whether the streaming drafters draft: the one record, which the drafter pool (and
        # through it the target's lent cores) is told by.
        self.model_drafting = ModelDrafting()
        self.controller: Controller = make_controller(self.config)
        self.rule = WeightUpdateRule(**self.config.vote.update_rule_kwargs())
        self.mixture_sharpness = self.config.vote.mixture_sharpness
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
        self._states: dict[str, RequestState] = {}
        self._step: StepContext | None = None
        self._last_log = time.monotonic()
        self._returned_at: float | None = None  # when propose() last returned
        self._overhead_s = 0.0  # the last propose()'s own time (less forwards and waits)
        self._prompt_tokens = 0  # prompt-chunk tokens of the step being computed (exact)
        self._passes: list[tuple[int, int, float]] = []  # (drafter, tokens, s) of the last step
        self._trace: TextIO | None = None
        if self.config.trace_file:
            # Line-buffered: a trace of a run that is killed keeps every step it finished.
            path = self.config.trace_file
            self._trace = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
            weakref.finalize(self, self._trace.close)  # when the engine lets the proposer go
        self.model_drafting.subscribe(self.worker.use_models)
        self._last_req_ids: frozenset[str] = frozenset()
        self._plan_record: dict[str, Any] | None = None  # the last plan, for the trace
        self._warmed = False  # the in-worker drafters' forwards ran their shapes once
        # [num_reqs, max chain, vocab] q of the last step's chains, when a request samples.
        self._draft_probs: Any = None

    # -- vLLM's proposer interface ------------------------------------------------------------
    def load_model(self, target_model: Any = None) -> None:
        for drafter in self.in_worker_drafters:
            try:
                drafter.load(target_model)
            except Exception as exc:  # noqa: BLE001 - a drafter that cannot load costs speculation
                logger.exception("Smurfs in-worker drafter %s could not load", drafter.name)
                drafter.fail(f"could not load: {type(exc).__name__}: {exc}")
        self.worker.start()
        if target_model is not None and self.owns_drafters:
            # The GEMMs of decode-sized steps are created now, with all the target's threads:
            # the first steps are not slowed by it, and a core lent later cannot stick to them.
            cores.warm_gemms(target_model, range(1, _WARM_TOKEN_COUNTS + 1))

    def before_forward(self, prompt_tokens: int) -> None:
        """The target is about to compute a step with ``prompt_tokens`` prompt-chunk tokens
        (exact: the controller learns the step's cost and the next steps' prompt from it).

        A CPU GEMM primitive keeps the thread count it was created with and vLLM caches one per
        token count: a step computed while the target lends cores to the streaming drafters can
        leave its token count on fewer threads for good (a 2048-token prefill step ran at half
        speed for the rest of a served run). Prompt chunks bring new token counts, so such a
        step gets the cores back first: the streaming drafters pause (their drafts for it are
        taken already) and the step counts as one without them.
        """
        self._prompt_tokens = prompt_tokens
        if prompt_tokens > 0 and self.worker.lends_cores and self.model_drafting.take_back():
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

    def _warm_up(self) -> float:
        """Run each in-worker drafter's forward shapes twice (their first calls build kernels;
        the second calls are the controller's first cost measurements); the seconds it took.
        Done at the first `propose`, once the runner has bound the drafters' KV cache."""
        started = time.perf_counter()
        for j, drafter in enumerate(self.in_worker_drafters):
            if drafter.health.alive:
                for p in drafter.warm_up(self.num_speculative_tokens):
                    self.controller.observe_pass(j, p.num_tokens, p.seconds)
        self._warmed = True
        return time.perf_counter() - started

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
        if not self._warmed:
            called += self._warm_up()  # one-off: not the proposer's time per step
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
            prompt = min(self._prompt_tokens, step.num_scheduled_tokens)
            self.controller.observe_step(StepTiming(
                len(step.req_ids), step.num_scheduled_tokens, step_s,
                drafting=self.model_drafting.on, overhead_s=self._overhead_s,
                prompt_tokens=prompt))
        self._last_req_ids = frozenset(step.req_ids)
        self.forget(step.finished_req_ids | step.restarted_req_ids)
        outcomes = self._learn(step, sampled_token_ids)
        # Streaming drafters report each engine step: one position for every sequence in it.
        draft_timings = [DraftTiming(n, 1, s) for n, s in self.worker.step_timings()]
        for timing in draft_timings:
            self.controller.observe_draft(timing)
        if self._trace is not None and step_s is not None:
            self._write_trace(step, sampled_token_ids, num_tokens_no_spec, outcomes, step_s,
                              draft_timings)
        self._passes = []

        rows = [i for i, sampled in enumerate(sampled_token_ids) if sampled]
        # A request without a token this step is part-way through its prompt (vLLM discards
        # the token sampled from a partial prefill): the next step carries more of it.
        prompt_pending = len(rows) < len(sampled_token_ids)
        max_lookahead = min(step.max_spec_tokens or self.num_speculative_tokens,
                            self.num_speculative_tokens)
        prompts = step.num_prompt_tokens
        input_batch = getattr(step.runner, "input_batch", None)  # None in unit tests
        sampling = (RowSampling.from_input_batch(input_batch, rows)
                    if rows and input_batch is not None else None)
        requests = [DraftRequest(step.req_ids[i], token_ids_cpu[i, : int(num_tokens_no_spec[i])]
                                 .copy(), max_lookahead,
                                 None if prompts is None else int(prompts[i])) for i in rows]
        proposals: list[list[int]] = [[] for _ in sampled_token_ids]
        forwards_s = waited_s = 0.0
        if requests:
            forwards_s, waited_s = self._draft_and_vote(step, rows, requests, max_lookahead,
                                                        proposals, sampling, prompt_pending)
        self.stats.steps += 1
        self._maybe_log()
        self._returned_at = time.perf_counter()
        # The proposer's own time, less the drafter forwards and waits (priced on their own).
        self._overhead_s = max(0.0, self._returned_at - called - forwards_s - waited_s)
        self.stats.proposer_s += self._returned_at - called
        return proposals

    # -- one step ---------------------------------------------------------------------------------
    def _draft_and_vote(self, step: StepContext, rows: list[int], requests: list[DraftRequest],
                        max_lookahead: int, proposals: list[list[int]],
                        sampling: RowSampling | None = None,
                        prompt_pending: bool = False) -> tuple[float, float]:
        """Plan the step, draft by the plan, vote (a request that samples: the mixture rule);
        returns (drafter forward seconds, seconds waited for streamed drafts)."""
        worker = self.worker
        n = len(requests)
        free_idx = worker.model_free_indices
        in_worker = worker.in_worker_indices
        external_idx = worker.model_indices  # process and Ray drafters
        pipelined = self.config.pipeline
        drafts = worker.model_free_drafts(requests)  # [request][drafter], free ones filled
        worker.poll()
        # Streaming drafters that draft now have drafts in hand: what they have ready.
        in_hand = bool(external_idx) and pipelined and self.controller.streaming
        if in_hand:
            ready = worker.ready(requests, True, drafts)
            for per, new in zip(drafts, ready, strict=True):
                for d in external_idx:
                    per[d] = new[d]
        free_chains, free_lens, streamed_lens = [], [], []
        for request, per in zip(requests, drafts, strict=True):
            weights = self._state(request.req_id).weights.weights
            chain = weighted_prefix_vote([per[d] for d in free_idx],
                                         [weights[d] for d in free_idx],
                                         max_len=max_lookahead).tokens if free_idx else []
            free_chains.append(chain)
            free_lens.append(len(chain))
            streamed_lens.append(max((len(per[d]) for d in external_idx), default=0))
        drafters = [worker.drafters[d] for d in in_worker]
        bands = ([temperature_band(float(t)) for t in sampling.temperature]
                 if sampling is not None else [0] * n)
        plan = self.controller.plan([
            PlanRequest(r.req_id, len(r.context), self.max_model_len, free_lens[i],
                        streamed_lens[i],
                        tuple(d.catch_up_tokens(r.req_id, len(r.context))
                              if d.can_draft(len(r.context)) else None for d in drafters),
                        remaining=remaining_tokens(step.runner, r.req_id), band=bands[i])
            for i, r in enumerate(requests)], max_lookahead, prompt_pending=prompt_pending)
        model_rows = plan.model_row_set
        # The process drafters work for this step: pipelined, on every request while streaming
        # is on (they draft ahead of the chains now verified, for the next steps); synchronous,
        # for the plan's requests.
        alive = bool(external_idx) and worker.models_alive
        if pipelined:
            external_rows = set(range(n)) if alive and plan.streaming else set()
        else:
            external_rows = set(plan.sync_rows) if alive else set()
        self.model_drafting.step(bool(external_rows))
        self.stats.steps_without_models += not (model_rows or external_rows or (
            in_hand and any(streamed_lens)))

        waited_s = 0.0
        if external_rows:
            waited_s = collect_streamed(
                worker, self.config, requests, drafts, sorted(external_rows), plan.lookaheads,
                in_hand, lambda late, left: self.controller.wait_s(plan, late, left))
            self.stats.wait_s += waited_s
        forwards_s = 0.0
        confidences: list[list[list[float]]] = [[[] for _ in drafters] for _ in range(n)]
        # [request][drafter] q rows of an in-worker drafter's sampled draft (None: point mass).
        dists: list[list[Any]] = [[None] * len(worker.names) for _ in range(n)]
        for j, drafter in enumerate(drafters):
            selected = plan.model_rows[j]
            if not selected or not drafter.health.alive:
                continue
            stop = None
            if isinstance(self.controller, LengthController):
                controller, index = self.controller, j

                def stop(active: list[int], confs: list[list[float]], spent_s: float,
                         controller=controller, index=index) -> list[int]:
                    return controller.keep_drafting(plan, index, active, confs, spent_s)
            result = drafter.draft_safely(
                [requests[i].req_id for i in selected], np.asarray([rows[i] for i in selected]),
                [requests[i].context for i in selected],
                [plan.lookaheads[i] for i in selected], step.runner, stop,
                None if sampling is None else sampling.take(selected))
            for p in result.passes:
                forwards_s += p.seconds
                self.stats.drafter_forwards += 1
                self.stats.drafter_tokens += p.num_tokens
                self.controller.observe_pass(j, p.num_tokens, p.seconds)
                self._passes.append((j, p.num_tokens, p.seconds))
            for local, i in enumerate(selected):
                drafts[i][in_worker[j]] = result.tokens[local]
                confidences[i][j] = result.confidences[local]
                if result.probs:
                    dists[i][in_worker[j]] = result.probs[local]
        self.stats.drafting_s += forwards_s

        voted_chains = []
        for i, request in enumerate(requests):
            per = drafts[i]
            if i not in model_rows:
                for d in in_worker:
                    per[d] = []
            if not (in_hand or i in external_rows):
                for d in external_idx:
                    per[d] = []
            k = plan.lookaheads[i]
            self.stats.requests_drafted += k > 0
            self.stats.requests_without_draft += k > 0 and not any(per)
            state = self._state(request.req_id)
            state.shares, state.band = None, bands[i]
            if k == 0:
                chain = []
            elif sampling is not None and sampling.sampled[i]:
                chain = self._mixture(request.req_id, rows[i], k, per,
                                      [q is not None for q in dists[i]], proposals,
                                      sampling.generators.get(i))
            else:
                chain = self._vote(request.req_id, rows[i], k, per, proposals)
            voted_chains.append(chain)
            state.free_chain = free_chains[i]
            state.models = i in model_rows or any(per[d] for d in external_idx)
            self.stats.request_steps += 1
            if not state.models:
                if free_lens[i]:
                    self.stats.request_steps_without_models_free_chain += 1
                else:
                    self.stats.request_steps_without_models_no_chain += 1
            state.confidences = [[] for _ in worker.names]
            for j, d in enumerate(in_worker):
                state.confidences[d] = confidences[i][j]
        if sampling is not None:
            # What each chain position is verified against (vocab: the target's logits' width).
            self._draft_probs = chain_probs(
                len(step.req_ids), int(step.runner.model_config.get_vocab_size()),
                step.runner.device, [proposals[row] for row in rows], rows,
                [self._state(r.req_id).shares if sampling.sampled[i] else None
                 for i, r in enumerate(requests)], drafts, dists)
        if external_rows and pipelined:
            # Drafters go on past the chains while the target verifies them.
            worker.track(requests, voted_chains, [self._max_lead(max_lookahead)] * n)
        if self._trace is not None:
            self._plan_record = {"mode": plan.mode, "rho": round(plan.rho, 4),
                                 "lookaheads": plan.lookaheads,
                                 "models": sorted(model_rows), "external": len(external_rows),
                                 "free": free_lens, **({"prompt_pending": True}
                                                        if prompt_pending else {})}
        return forwards_s, waited_s

    def _vote(self, req_id: str, row: int, k: int, per_drafter: list[list[int]],
              proposals: list[list[int]]) -> list[int]:
        state = self._state(req_id)
        vote = weighted_prefix_vote(per_drafter, state.weights.weights, max_len=k)
        state.drafts, state.voted = per_drafter, vote.tokens
        proposals[row] = vote.tokens
        self._count_proposal(vote.tokens, vote.winner)
        return vote.tokens

    def _mixture(self, req_id: str, row: int, k: int, per_drafter: list[list[int]],
                 sampled: list[bool], proposals: list[list[int]], generator: Any) -> list[int]:
        """A sampling request's chain (`vote_sampler.sampled_chain`): the mixture rule over the
        drafters that sampled, where one drafted (``sampled[d]``: drafter d kept its
        distribution); else the vote over the point masses."""
        state = self._state(req_id)
        # Shares fixed before the tokens are seen: any function of the weights is lossless.
        shares = [w ** self.mixture_sharpness for w in state.weights.weights]
        picked = sampled_chain(per_drafter, sampled, shares, k,
                               lambda n: member_uniforms(n, generator))
        state.drafts, state.voted, state.shares = per_drafter, picked.tokens, picked.shares
        proposals[row] = picked.tokens
        if picked.tokens:
            self.stats.proposed_drafts += 1
            self.stats.sampled_drafts += 1
        return picked.tokens

    def take_last_draft_probs(self) -> Any:
        """The last step's q per chain position (`drafters.sampling.chain_probs`), once; None
        when no request sampled. vLLM's runner reads this of its own proposers; for
        ``custom_class`` the patches.model_runner_propose patch does."""
        probs, self._draft_probs = self._draft_probs, None
        return probs

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
        self.controller.forget(req_ids)
        self.worker.forget(req_ids)

    def _state(self, req_id: str) -> RequestState:
        state = self._states.get(req_id)
        if state is None:
            # A new request starts from what all requests taught the vote so far.
            state = self._states[req_id] = RequestState(self.global_weights.copy())
        return state

    def _learn(self, step: StepContext,
               sampled_token_ids: list[list[int]]) -> list[RequestOutcome]:
        """Score every drafter's last draft (`step_outcomes.learn`); tell the controller."""
        outcomes = learn(self._states, step.req_ids, sampled_token_ids, step.verified_drafts,
                         self.worker.in_worker_indices, self.stats, self.global_weights)
        self.controller.observe(outcomes)
        return outcomes

    def _write_trace(self, step: StepContext, sampled_token_ids: list[list[int]],
                     num_tokens_no_spec: np.ndarray, outcomes: list[RequestOutcome],
                     step_s: float, draft_timings: list[DraftTiming]) -> None:
        """One line of the ``trace_file`` (format: `vllm_smurfs.trace.format`)."""
        assert self._trace is not None
        requests = trace_requests(step.req_ids, sampled_token_ids, num_tokens_no_spec, outcomes)
        line = TraceStep(self.stats.steps, time.monotonic(), step_s, step.num_scheduled_tokens,
                         requests, tuple(draft_timings),
                         drafting=self.model_drafting.on,
                         prompt_tokens=min(self._prompt_tokens, step.num_scheduled_tokens),
                         passes=tuple(self._passes)).to_dict()
        if self._plan_record is not None:
            line["plan"] = self._plan_record  # what the last step planned
        self._trace.write(json.dumps(line, separators=(",", ":")) + "\n")

    def _count_proposal(self, voted: list[int], winner: int) -> None:
        if voted:
            self.stats.proposed_drafts += 1
            self.stats.drafters[winner].vote_wins += 1

    # -- metrics --------------------------------------------------------------------------------
    def get_stats(self) -> dict[str, Any]:
        out = self.stats.as_dict()
        for entry, health in zip(out["drafters"], self.worker.health(), strict=True):
            entry["alive"] = health.alive
            entry["steps_late"] = health.steps_late
            entry["engine_steps"] = health.steps_answered
            entry["busy_s"] = round(health.busy_s, 4)
            if "replacements" in health.extra:  # a Ray drafter: actors started after its first
                entry["replacements"] = health.extra["replacements"]
        out["controller"] = self.controller.snapshot()
        return out

    def _maybe_log(self) -> None:
        interval = self.config.log_stats_interval_s
        if interval <= 0 or time.monotonic() - self._last_log < interval:
            return
        self._last_log = time.monotonic()
        logger.info("Smurfs drafters: %s", json.dumps(self.get_stats()))

    # -- request lifecycle: called by patches.model_runner_execute and the tests ----------------
    def propose_skipped(self) -> None:
        """vLLM ran a target step and did not call `propose` after it (a step with a request
        within num_speculative_tokens of max_model_len, or one that the engine core could not
        draft for). The drafts sent for that step were verified without us seeing the outcome:
        none may be scored later against another step's tokens, and the next step is not timed
        from our last return (two steps apart)."""
        for state in self._states.values():
            state.drop_pending()
        self.controller.step_lost()
        self._returned_at = None

    def live_request_state(self) -> dict[str, int]:
        """Per-request entries held now, by holder: nothing may outlive its request (the tests
        check it after generate() calls). 'pending_drafts': requests holding a draft that awaits
        its verification."""
        return {
            "requests": len(self._states),
            "pending_drafts": sum(s.voted is not None for s in self._states.values()),
            "controller": per_request_entries(self.controller),
            "drafters": sum(per_request_entries(d, depth=0)
                            for d in getattr(self.worker, "drafters", ())),
        }

