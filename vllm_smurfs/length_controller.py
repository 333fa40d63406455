"""The lookahead controller: one planner for every placement of the drafters.

Every step the proposer describes the running requests (`control.plan.PlanRequest`) and the
controller returns a `control.plan.Plan`: which requests the model drafters draft for, how far each
request's draft may go (0 included), and whether the streaming drafters (process and Ray placements)
draft on. Its worth is **expected accepted tokens against the step's seconds**, each drafter priced
by where it runs:

* a model-free voter (n-gram lookup) has drafted already, in microseconds: free;
* a streaming drafter's ready tokens are free too; keeping it drafting may cost the target time
  (the cores it lends), and waiting for its late tokens costs the wait;
* an in-worker drafter computes in the target's step: its first forward catches it up with the
  request's text and yields a token, each further forward extends the drafts still going.

**The objective.** A step is worth ``E - rho * T``: ``E`` the tokens it is expected to produce
(output tokens only: one per request plus its accepted drafts), ``T`` its predicted seconds, and
``rho`` the best rate a step of this batch reaches, found on the step without its prompt chunk
(the best point of the model-free plan, at least the rate without drafting). Maximising
``E - rho * T`` with ``rho`` the best rate is the same as maximising the rate ``E / T`` in a step
without a prompt chunk (Dinkelbach); in a step with one, a draft token must beat the rate a
decode step reaches, not the low rate of a step that spends most of its time on a prompt (nor
the high "rate" of counting prompt tokens as output, which shut the model drafters out of
prompt-heavy steps). A draft token is worth its chance of acceptance; it costs ``rho`` times the
seconds it adds: its verification, its share of a drafter forward.

**Plans.** (1) *In hand*: each request takes a prefix of the chain it has already (the
model-free voters', with the streaming drafters' when they draft), the tokens allocated greedily
by their chance of acceptance along one path, and the best point of the path taken. (2)
*Models*: the in-worker drafters draft too, for the requests where it pays: each request's
model draft is valued from the acceptance of voted chains with model drafts, **conditioned on
what the step offers it** (with a model-free chain beside it, or with none, which is where a
model draft pays most), against the chain in hand; the requests are added in the order of that
benefit and the best prefix is taken, priced with the measured forward costs (the first
forward at the catch-up tokens it will compute; the seconds beyond a normal step's catch-up are
an investment in the request's later steps, charged spread over those in which its voters are
expected to have no chain, where the models draft: `CatchUpCharge`, `ChainlessShare`; a
catch-up that is a prefill in the drafters waits for the request's own evidence of that share,
INVESTMENT_EVIDENCE_STEPS). A plan with drafts is taken only with a margin over the one
without (``DRAFT_MARGIN``).

**What it learns** (`control.acceptance`, `control.step_costs`), clean by construction: output
tokens only; the lookaheads as verified; the prompt tokens of each step from the step itself
(`StepTiming`); cost curves that no single slow call sets (a first call builds oneDNN primitives or
compiles), seeded by the in-worker drafters' warm-up, that forget old observations, move with the
machine's speed as a whole, and are made monotone by lowering a slow point rather than raising the
points after it; acceptance per plan, per context and per request. One step's plans are searched
and priced by `control.planner` (`StepSearch`, given these estimates), with the arithmetic of
`control.plan_search`; this module decides between them (evidence, exploration, probes), learns
and reports. The fixed policy is `control.fixed`.

**Exploration** is optimistic and bounded: the model plan is also valued with an upper
confidence bound of its acceptance (wide where it has seldom been verified, and widening again
as unused evidence ages); when only the optimistic value says it pays, it is taken while the
predicted price of such steps stays within ``EXPLORE_BUDGET`` of the time run so far. At batch
1 a request the models never drafted for is probed the same way even when the population's
bound says no (``PROBE_NEW_REQUESTS``): one request's acceptance says little of the next one's.
At batch 1 no experiment prefills a long prompt in the drafters on such a guess.
So the controller cannot lock the models out for good, and exploring cannot cost more than a few
percent. The same holds for switching streaming drafters on again (`control.streaming_mode`).

**While a prompt is pending** (a request of the last step is part-way through its prompt: the
scheduler cut it to the step's token budget, so the next steps carry prompt chunks whatever is
drafted), nothing is drafted. The prompts set how many such steps run, and the requests still
in their prompts, with all their tokens to go, set how many follow: a draft for a request that
decodes now saves neither, at least when requests ask for similar lengths. It costs its
verification (and a model drafter its forwards and catch-ups), compute taken from the prompts.
(In a cold burst of 64 prompts most of the run is prompt steps: 58 of 66 s.) A configuration
that forces the model drafters (``min_lookahead`` > 0, ``pause_models`` false) drafts there too.

**While drafting** and **while waiting** for streamed drafts, the step's plan is applied by the
rules of `control.drafting_rules` (a draft goes on, one more drafter step is waited for, while what
it brings beats ``rho`` times what it costs).

Pure module (stdlib only): runs every step for up to a few hundred requests.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from vllm_smurfs.control.acceptance import (
    AcceptanceModel,
    BandEstimates,
    ChainlessShare,
    ConfidenceCalibration,
    PlanYield,
)
from vllm_smurfs.control.drafting_rules import keep_drafting, wait_s
from vllm_smurfs.control.feedback import DraftTiming, StepFeedback, StepTiming
from vllm_smurfs.control.plan import (
    DrafterOutcome,
    Plan,
    PlanRequest,
    RequestOutcome,
    cumulative,
)
from vllm_smurfs.control.plan_search import (
    ModelChoice,
    Point,
    catch_ups,
    greedy_path,
    scaled,
    total_catch_up,
)
from vllm_smurfs.control.planner import (
    DRAFT_MARGIN,
    EXPERIMENT_CATCH_UP_TOKENS,
    StepSearch,
)
from vllm_smurfs.control.step_costs import DraftCostModel, StepCostModel
from vllm_smurfs.control.streaming_mode import DWELL_STEPS as DWELL_STEPS_PRICE
from vllm_smurfs.control.streaming_mode import StreamingSwitch

__all__ = ["DRAFT_MARGIN", "EXPERIMENT_CATCH_UP_TOKENS", "EXPLORE_BUDGET",
           "LengthController"]

# Exploration: an experiment with the model drafters (taken when only the optimistic estimate of
# their acceptance says they pay, or when their estimates still rest on fewer than
# EVIDENCE_OBSERVATIONS observations: then their mean is mostly the prior, and catching a drafter
# up with many requests, a prefill of each prompt in the drafter, would be an investment made on
# a guess) drafts EXPLORE_DRAFT_TOKENS tokens for the requests cheapest to catch up with,
# EXPERIMENT_CATCH_UP_TOKENS of catch-up in all (at least one request; at batch 1 none with
# more: an experiment is a guess, and a long prompt's catch-up is a prefill in the drafter,
# 0.75-1.1 s for the 613-919 tokens of Spec-Bench summarization prompts, 6-9 target steps of the
# 2-core CPU, for requests of 64 tokens that their n-gram and suffix chains served as well; in a
# batch the cheapest is taken whatever its catch-up, so that the models are tried under loads
# whose prompts are all long). Its price (what it loses by the mean estimates, its catch-ups
# charged as in any plan) is kept within EXPLORE_BUDGET of the target time run so far plus
# EXPLORE_ALLOWANCE_S; the first experiment is always made. (The experiment's shape and
# DRAFT_MARGIN, the margin every plan with drafts must clear, are `control.planner`'s.)
# (Under a simulated cold burst of 32 requests, a first model step for all of them on the prior
# cost 8% of the run, for drafts that then did not pay. Charging an experiment's catch-ups in
# full spent the budget on the first request's prompt, and that request then went without
# drafts for 9 of its 37 steps on the real models.)
EXPLORE_BUDGET = 0.02
EXPLORE_ALLOWANCE_S = 0.25
EVIDENCE_OBSERVATIONS = 8.0
# A request whose catch-up is a prefill in the drafters (more than EXPERIMENT_CATCH_UP_TOKENS)
# is drafted for by the mean plan only once INVESTMENT_EVIDENCE_STEPS of its own steps say how
# often its voters have no chain (the steps its catch-up is spread over): before, that share is
# the other requests' (chat and translation prompts' voters seldom have one), and Spec-Bench's
# summarization prompts, whose voters have a chain in ~90% of their steps, were caught up (710
# tokens, 0.73 s in the 0.5B drafter) for 64 tokens the voters serve as well: three of their
# four runs in one benchmark (115ebb1, il-draft-vs-smurfs, 2 passes) took 5.6-6.3 s, against
# 4.0-4.6 s in the run beside it where the models sat out.
INVESTMENT_EVIDENCE_STEPS = 4
# Probes: at batch 1, a request the models have never drafted for is an experiment candidate
# even when the population's optimistic estimate says no (the same budget bounds it): requests
# differ far more than steps of one request do (in one Spec-Bench pass, the first chat prompt's
# drafts had 7 of 15 tokens accepted, a math prompt's 45 of 58), and a few early requests
# that the drafter serves badly must not keep it from the next ones. In the simulator, two
# requests at acceptance 0.3 then four at 0.85 ran at 1.02x no speculation without probes (the
# models never drafted for the good ones) and 1.24x with them; a drafter bad everywhere costs 1%
# more. Only requests with PROBE_MIN_REMAINING tokens to go are probed (the experiment pays back
# over the request), and only at batch 1: in a batch a model step is priced on the population's
# estimate (at 2 requests probes cost 1% on a recorded Spec-Bench trace).
PROBE_NEW_REQUESTS = True
PROBE_MIN_REMAINING = 16
PROBE_MAX_BATCH = 1
# Standard errors of the upper confidence bound on the model plan's acceptance (see
# `AcceptanceModel.global_acceptance`): 2 is a one-sided 98% bound. A few unlucky early drafts
# (14 observations at 0.32 where the drafter's true first-position acceptance is 0.7, seen
# replaying a recorded trace at 4 requests) must not settle the question; the budget bounds
# what the optimism costs.
OPTIMISM = 2.0
# Prompt-chunk tokens of the next step are predicted from the last steps' exact counts, weight
# 0.5 on the last: chunked prefills come in runs of a few steps.
_PROMPT_SMOOTHING = 0.5
# The proposer's own time per step (model-free drafting, voting, planning) is an exponential
# average with this weight on the last step.
_OVERHEAD_SMOOTHING = 0.2


def _with_free_context(band: int, with_free: bool) -> bool:
    """The context a model-drafted chain's acceptance is learnt in: with a model-free chain in
    hand or without, for greedy requests (the vote merges the two, and the model's draft pays
    most where there is none). A sampling request's chain where a model sampled is the sampling
    drafters' mixture alone (`vote_sampler.mixture_members`), a free chain in hand or not: one
    context. (Kept apart, an early unlucky estimate in the context with a free chain, 0.17 at
    position 1 from a few steps, held at temperature 0.7 for five requests while the same
    drafts without a free chain were accepted at 0.55.)"""
    return with_free and band == 0


class LengthController:
    """The one adaptive controller (see the module docstring).

    ``num_worker_drafters``: in-worker model drafters (the plan has a row list per drafter).
    ``streaming``: there are streaming drafters (process or Ray, pipelined) that the plan
    switches on and off; ``sync_drafters``: there are process drafters drafting synchronously
    (``pipeline: false``), priced by their measured call time. ``min_lookahead``: every request
    drafts at least this many tokens with the model drafters (>= 1 keeps them in every step);
    ``pause_models``: False keeps the model drafters drafting in every step that drafts.
    """

    def __init__(self, max_lookahead: int, num_worker_drafters: int = 0, *,
                 streaming: bool = False, sync_drafters: bool = False, min_lookahead: int = 0,
                 pause_models: bool = True) -> None:
        if max_lookahead < 1:
            raise ValueError(f"max_lookahead must be >= 1, got {max_lookahead}")
        if not 0 <= min_lookahead <= max_lookahead:
            raise ValueError(f"min_lookahead must be in [0, {max_lookahead}], got {min_lookahead}")
        if num_worker_drafters < 0:
            raise ValueError(f"num_worker_drafters must be >= 0, got {num_worker_drafters}")
        self.max_lookahead = max_lookahead
        self.min_lookahead = min_lookahead
        self.pause_models = pause_models
        self.num_worker_drafters = num_worker_drafters
        self.sync_drafters = sync_drafters
        self.has_models = bool(num_worker_drafters or streaming or sync_drafters)
        self.force_models = self.has_models and (min_lookahead > 0 or not pause_models)
        # What is learnt of acceptance, per temperature band (`acceptance.temperature_band`):
        # created at a band's first request.
        self._bands: dict[int, BandEstimates] = {}
        self.target_cost = StepCostModel()
        # With streaming drafters, steps while they draft have a curve of their own (the target
        # may lend them cores; never priced below the curve without).
        self.target_cost_streaming = StepCostModel()
        self.pass_costs = [StepCostModel() for _ in range(num_worker_drafters)]
        self.draft_cost = DraftCostModel()  # streaming engine steps, synchronous calls
        self.switch = (StreamingSwitch(always_on=self.force_models) if streaming else None)
        self._prompt = 0.0  # predicted prompt-chunk tokens of the next step
        self._overhead_s = 0.0
        self._elapsed_s = 0.0  # target seconds observed so far
        self.explore_spent_s = 0.0
        # Per kind of plan ("hand", "models"): predicted against accepted drafts.
        self._yield = {kind: PlanYield() for kind in ("hand", "models")}
        self._pending: tuple[str, float] | None = None  # the last plan's kind, predicted drafts
        self.steps = 0
        self.counts = {"steps_with_models": 0, "explore_steps": 0, "prompt_pending_steps": 0,
                       "request_steps": 0,
                       "with_models": 0, "in_hand_only": 0, "no_draft": 0,
                       "without_models_free_chain": 0, "without_models_no_chain": 0}
        self._last: dict[str, Any] = {}
        self.chainless = ChainlessShare()  # where the voters have no chain, per request

    def band(self, band: int) -> BandEstimates:
        """The estimates of temperature band ``band`` (0: greedy)."""
        if band not in self._bands:
            self._bands[band] = BandEstimates(self.max_lookahead, self.num_worker_drafters)
        return self._bands[band]

    # The greedy band's estimates (the snapshot's, and the tests').
    @property
    def acceptance_free(self) -> AcceptanceModel:
        return self.band(0).free

    @property
    def acceptance_models(self) -> dict[bool, AcceptanceModel]:
        return self.band(0).models

    @property
    def calibrations(self) -> list[ConfidenceCalibration]:
        return self.band(0).calibrations

    def _free_acceptance(self, r: PlanRequest) -> AcceptanceModel:
        return self.band(r.band).free

    def _models_acceptance(self, r: PlanRequest) -> AcceptanceModel:
        return self.band(r.band).models[_with_free_context(r.band, r.free_len > 0)]

    @property
    def streaming(self) -> bool:
        """Whether the streaming drafters draft now (their drafts in hand join the vote)."""
        return self.switch is not None and self.switch.on

    # -- learning ------------------------------------------------------------------------------
    def observe_step(self, timing: StepTiming) -> None:
        """The target's last step: exact token counts (the prompt chunk's from the step itself)
        and seconds; ``overhead_s`` is the proposer's own time before it, less drafter forwards
        and waits (priced on their own)."""
        curve = (self.target_cost_streaming if timing.drafting and self.switch is not None
                 else self.target_cost)
        curve.observe(timing.num_tokens, timing.seconds)
        self._elapsed_s += timing.seconds
        self._overhead_s += _OVERHEAD_SMOOTHING * (timing.overhead_s - self._overhead_s)
        self._prompt += _PROMPT_SMOOTHING * (timing.prompt_tokens - self._prompt)

    def observe_pass(self, drafter: int, num_tokens: int, seconds: float) -> None:
        """One forward of in-worker drafter ``drafter`` over ``num_tokens`` tokens."""
        self.pass_costs[drafter].observe(num_tokens, seconds)

    def observe_draft(self, timing: DraftTiming) -> None:
        """A streaming drafter's engine step, or a synchronous drafter's call."""
        self.draft_cost.observe(timing.num_positions, timing.num_reqs, timing.seconds)

    def observe(self, outcomes: Sequence[RequestOutcome]) -> None:
        """The last step's outcomes, one per request planned for."""
        free: dict[int, list[StepFeedback]] = {}
        models: dict[tuple[int, bool], list[StepFeedback]] = {}
        for o in outcomes:
            if o.free is not None and o.free.tokens > 0:
                free.setdefault(o.band, []).append(StepFeedback(o.req_id, *o.free.seen))
            if o.models and o.voted is not None and o.voted[0] > 0:
                models.setdefault((o.band, _with_free_context(o.band, o.with_free)),
                                  []).append(StepFeedback(o.req_id, *o.voted))
            for cal, draft in zip(self.band(o.band).calibrations, o.drafters, strict=False):
                if draft is not None:
                    cal.observe_draft(draft.confidences, draft.matched, draft.observed)
        for band, feedback in free.items():
            self.band(band).free.observe(feedback)
        for (band, with_free), feedback in models.items():
            self.band(band).models[with_free].observe(feedback)
        for o in outcomes:
            self.chainless.observe(o.req_id, o.with_free)
        pending, self._pending = self._pending, None
        if pending is not None:
            kind, predicted = pending
            self._yield[kind].observe(
                predicted, sum(o.voted[1] for o in outcomes if o.voted is not None))
        if self.switch is not None and self.switch.on:
            # How many of the step's requests had model drafts in their vote.
            self.switch.observe_delivery(sum(o.models for o in outcomes), len(outcomes))

    def forget(self, req_ids: Iterable[str]) -> None:
        req_ids = list(req_ids)
        self.chainless.forget(req_ids)
        for estimates in self._bands.values():
            for model in estimates.acceptance_models():
                model.forget(req_ids)

    def step_lost(self) -> None:
        """The last plan's step was verified unseen (vLLM skipped propose after it): its outcome
        never comes, and its predicted drafts are not held against the next step's."""
        self._pending = None

    # -- costs ---------------------------------------------------------------------------------
    def _target(self, streaming: bool) -> StepCostModel:
        return self.target_cost_streaming if streaming and self.switch is not None else \
            self.target_cost

    def _target_s(self, tokens: float, streaming: bool) -> float:
        """Predicted target seconds: with streaming drafters drafting, never below the curve
        without them (they take cores from the target or share them, never add any; token
        counts measured only without them are not guessed cheap)."""
        t = self.target_cost(tokens)
        if streaming and self.switch is not None and not self.target_cost_streaming.is_empty:
            t = max(t, self.target_cost_streaming(tokens))
        return t

    # -- planning ------------------------------------------------------------------------------
    def plan(self, requests: Sequence[PlanRequest], max_lookahead: int, *,
             prompt_pending: bool = False) -> Plan:
        """This step's plan (see the module docstring). ``max_lookahead``: the scheduler's cap;
        ``prompt_pending``: a request of the last step is part-way through its prompt."""
        n = len(requests)
        nd = self.num_worker_drafters
        if n == 0:
            return Plan([], [[] for _ in range(nd)])
        self.steps += 1
        if prompt_pending and not self.force_models:
            # Steps that run for the prompts anyway: no draft can save one (module docstring).
            self.counts["prompt_pending_steps"] += 1
            self._last = {"mode": "prompt", "num_reqs": n}
            plan = Plan(lookaheads=[0] * n, model_rows=[[] for _ in range(nd)],
                        streaming=self.streaming, mode="prompt",
                        bands=[r.band for r in requests])
            self._count(requests, plan)
            return plan
        ids = [r.req_id for r in requests]
        for r in requests:
            self.band(r.band)  # a new band's estimates exist before they are read
        for estimates in self._bands.values():
            for model in estimates.acceptance_models():
                model.tick(ids)
        top = max(0, min(self.max_lookahead, max_lookahead))
        caps = [min(top, r.cap) for r in requests]
        streaming = self.switch is not None and self.switch.on
        can_model = [i for i in range(n) if caps[i] > 0 and (
            any(c is not None for c in requests[i].catch_up[:nd]) or self.sync_drafters)]
        if self.target_cost.is_empty and self.target_cost_streaming.is_empty:
            plan = self._warmup_plan(requests, caps, streaming)
        else:
            for plan_yield in self._yield.values():
                plan_yield.tick()
            plan = self._best_plan(requests, caps, can_model, streaming)
            kind = "models" if plan.models or plan.sync_rows else "hand"
            self._pending = (kind, max(0.0, plan.expected_tokens - n))
        plan.bands = [r.band for r in requests]
        self._count(requests, plan)
        return plan

    def _search(self, requests: Sequence[PlanRequest], caps: list[int],
                streaming: bool) -> StepSearch:
        """This step's plan search, on the estimates and curves learnt so far."""
        return StepSearch(
            requests, caps, self._hand_curves(requests, caps, streaming),
            target=lambda tokens: self._target_s(tokens, streaming),
            target_max_tokens=self._target(streaming).max_tokens, prompt=self._prompt,
            overhead_s=self._overhead_s, pass_costs=self.pass_costs,
            sync_cost=self.draft_cost if self.sync_drafters else None, chainless=self.chainless,
            max_lookahead=self.max_lookahead, min_lookahead=self.min_lookahead,
            force_models=self.force_models)

    def _best_plan(self, requests: Sequence[PlanRequest], caps: list[int], can_model: list[int],
                   streaming: bool) -> Plan:
        search = self._search(requests, caps, streaming)
        choice, mode = None, "in-hand" if search.in_hand else "none"
        if self.has_models and can_model and (self.num_worker_drafters or self.sync_drafters):
            mean_curves = self._model_curves(requests, caps, 0.0)
            if self.force_models:
                choice = search.model_choice(can_model, mean_curves)
                mode = "models"
            else:
                # The mean decides only where it rests on observations, and the forwards on
                # measured costs; the rest is an experiment.
                priced = all(not cost.is_empty for cost in self.pass_costs)
                evident = [i for i in can_model if priced and self._models_acceptance(
                    requests[i]).global_trials()[0] >= EVIDENCE_OBSERVATIONS
                    and self._investment_evident(requests[i])]
                mean = search.model_choice(evident, mean_curves)
                if mean is not None and mean.value - search.hand_value > search.margin:
                    choice, mode = mean, "models"
                else:
                    choice = self._explore(search, can_model, mean_curves)
                    mode = mode if choice is None else "explore"
        if self.switch is not None:
            self._decide_streaming(requests, caps, search.rho, search.hand_value, search.margin)
        n = len(requests)
        if choice is None:
            ks = search.hand_ks
            gains = {i: search.hand[i] for i, r in enumerate(requests)
                     if streaming and r.streamed_len > 0 and ks[i] > 0}
            point = search.hand_point
            self._last = {"mode": mode, "rho": search.rho, "value": search.hand_value,
                          "expected_tokens": point.expected, "num_reqs": n,
                          "prompt_tokens": search.prompt}
            return Plan(lookaheads=ks, model_rows=[[] for _ in range(self.num_worker_drafters)],
                        streaming=self.streaming, rho=search.rho, verify_s=search.verify_s,
                        mode=mode, expected_tokens=point.expected,
                        step_seconds=search.seconds(point), gains=gains)
        return self._model_plan(search, choice, mode)

    def _explore(self, search: StepSearch, can_model: list[int],
                 mean_curves: list[list[float]]) -> ModelChoice | None:
        """An experiment with the model drafters, or None.

        When model drafting may pay in this step (its plan, valued with the optimistic
        acceptance, beats the plan in hand by the margin) but the mean estimates do not say so
        (or rest on too few observations to say anything), the models draft their first few
        tokens for the requests cheapest to catch up with (`StepSearch.experiment`; at batch 1
        none with more than EXPERIMENT_CATCH_UP_TOKENS), if its price (what it loses by the
        mean estimates, its catch-ups charged as in any plan) fits the exploration budget; the
        first experiment always does. When the optimistic plan does not beat the plan in hand,
        a batch of one request that the models never drafted for is probed the same way,
        within the same budget (see PROBE_NEW_REQUESTS)."""
        requests = search.requests
        optimistic = search.model_choice(
            can_model, self._model_curves(requests, search.caps, OPTIMISM))
        # At batch 1 an experiment is a guess on one request: its prompt is not prefilled in the
        # drafters on it. In a batch the cheapest request is taken whatever its catch-up, so that
        # loads whose prompts are all long still try the models.
        candidates = [i for i in can_model if len(requests) > PROBE_MAX_BATCH
                      or total_catch_up(requests[i]) <= EXPERIMENT_CATCH_UP_TOKENS]
        if optimistic is None or optimistic.value <= search.hand_value + search.margin:
            # The population's estimate says no; a request the models never drafted for may
            # still differ from it (acceptance varies by request far more than by step).
            candidates = [i for i in candidates if PROBE_NEW_REQUESTS
                          and len(requests) <= PROBE_MAX_BATCH and self._unprobed(requests[i])
                          and (requests[i].remaining is None  # no max_tokens: long
                               or requests[i].remaining >= PROBE_MIN_REMAINING)]
        experiment = search.experiment(candidates, mean_curves)
        if experiment is None:
            return None
        price_s = search.experiment_price_s(experiment)
        if self.counts["explore_steps"] and (self.explore_spent_s + price_s
                                             > self._explore_allowance()):
            return None
        self.explore_spent_s += price_s
        self.counts["explore_steps"] += 1
        return experiment

    def _investment_evident(self, request: PlanRequest) -> bool:
        """Whether the request's catch-up is a normal one, or a prefill in the drafters priced
        on its own evidence (see INVESTMENT_EVIDENCE_STEPS)."""
        return (total_catch_up(request) <= EXPERIMENT_CATCH_UP_TOKENS
                or self.chainless.own_steps(request.req_id) >= INVESTMENT_EVIDENCE_STEPS)

    def _unprobed(self, request: PlanRequest) -> bool:
        """Whether no verified model draft of this request is on record (in either context)."""
        return all(request.req_id not in model
                   for model in self.band(request.band).models.values())

    def yield_factor(self, kind: str) -> float:
        """Accepted over predicted drafts of the recent plans of ``kind`` (`PlanYield`)."""
        return self._yield[kind].factor

    def _hand_curves(self, requests: Sequence[PlanRequest], caps: list[int], streaming: bool,
                     optimism: float = 0.0) -> list[list[float]]:
        """Per request, the cumulative acceptance of the chain in hand, as far as it goes: the
        model-free chain's, or, where streaming drafters have drafted for it, the voted chain's
        with model drafts (up to the cap: the rest may come while the step waits)."""
        out = []
        f = self.yield_factor("hand")
        for r, cap in zip(requests, caps, strict=True):
            if streaming and r.streamed_len > 0:
                model = self._models_acceptance(r)
                qs = cumulative(model.request_acceptance(r.req_id, optimism), cap)
            else:
                qs = cumulative(self._free_acceptance(r).request_acceptance(r.req_id),
                                min(cap, r.free_len))
            out.append(scaled(qs, f))
        return out

    def _model_curves(self, requests: Sequence[PlanRequest], caps: list[int],
                      optimism: float) -> list[list[float]]:
        f = self.yield_factor("models")
        return [scaled(cumulative(self._models_acceptance(r).request_acceptance(
            r.req_id, optimism), cap), f) for r, cap in zip(requests, caps, strict=True)]

    def _model_plan(self, search: StepSearch, choice: ModelChoice, mode: str) -> Plan:
        requests = search.requests
        n = len(requests)
        nd = self.num_worker_drafters
        rows = set(choice.rows)
        model_rows = [sorted(i for i in choice.rows if catch_ups(requests[i], nd)[d] is not None)
                      for d in range(nd)]
        # Model rows draft up to their cap (the stop rule ends each draft); the others keep the
        # chain in hand.
        ks = [(choice.ks[i] if mode == "explore" else search.caps[i]) if i in rows
              else search.hand_ks[i] for i in range(n)]
        point = Point(choice.expected, choice.tokens, choice.extra_s)
        seconds = search.seconds(point)
        # The step's own rate without its prompt chunk, if better than the plan in hand's: the
        # stop rule weighs each further token against it.
        own = search.rate(point)
        rho_plan = max(search.rho, own)
        self._last = {"mode": mode, "rho": rho_plan, "value": choice.value,
                      "expected_tokens": choice.expected, "num_reqs": n,
                      "model_rows": len(rows), "prompt_tokens": search.prompt,
                      "explore_spent_s": self.explore_spent_s}
        return Plan(lookaheads=ks, model_rows=model_rows, streaming=self.streaming,
                    sync_rows=sorted(rows) if self.sync_drafters else [], rho=rho_plan,
                    verify_s=search.verify_s, mode=mode, expected_tokens=choice.expected,
                    step_seconds=seconds, draft_lens=dict(choice.ks))

    def _warmup_plan(self, requests: Sequence[PlanRequest], caps: list[int],
                     streaming: bool) -> Plan:
        """Before the target's step has been timed once (the engine's first decode step): the
        chains in hand in full, no model drafter (nothing can be priced yet, and under a cold
        burst a first model step would prefill every prompt in the drafter at once)."""
        ks = [min(cap, max(r.free_len, r.streamed_len if streaming else 0))
              for r, cap in zip(requests, caps, strict=True)]
        self._last = {"mode": "warmup", "num_reqs": len(requests)}
        return Plan(lookaheads=ks, model_rows=[[] for _ in range(self.num_worker_drafters)],
                    streaming=self.streaming, mode="warmup")

    def _decide_streaming(self, requests: Sequence[PlanRequest], caps: list[int], rho: float,
                          current_value: float, margin: float) -> None:
        """Whether the streaming drafters draft on (`control.streaming_mode.StreamingSwitch`): the
        plan in hand this step against the plan in the other mode, as it would be in steady state
        (with streaming, every request has a streamed chain, its acceptance scaled by how often
        one was ready in time), each on its own target curve."""
        assert self.switch is not None
        on = self.switch.on

        def best_value(curves: list[list[float]], streaming: bool) -> float:
            return max(p.expected - rho * (self._target_s(p.tokens + self._prompt, streaming)
                                           + self._overhead_s)
                       for p in greedy_path(curves, [0] * len(curves)))

        def streamed(optimism: float) -> list[list[float]]:
            delivery = self.switch.delivery
            return [[delivery * q for q in cumulative(self._models_acceptance(
                r).request_acceptance(r.req_id, optimism), c)]
                for r, c in zip(requests, caps, strict=True)]

        if on:
            value_on = optimistic_on = current_value
            value_off = best_value([cumulative(self._free_acceptance(r).request_acceptance(
                r.req_id), min(c, r.free_len)) for r, c in zip(requests, caps, strict=True)],
                False)
        else:
            value_off = current_value
            value_on = best_value(streamed(0.0), True)
            optimistic_on = best_value(streamed(OPTIMISM), True)
        # A retry's price: what the steps of its dwell lose by the mean estimates.
        price_s = DWELL_STEPS_PRICE * max(0.0, value_off - value_on) / max(rho, 1e-9)
        retry_ok = self.explore_spent_s + price_s <= self._explore_allowance()
        if (self.switch.decide(self.steps, value_on, value_off, optimistic_on, margin, retry_ok)
                and self.switch.exploring):
            self.explore_spent_s += price_s

    def _explore_allowance(self) -> float:
        """Seconds exploration may have cost so far (see EXPLORE_BUDGET)."""
        return EXPLORE_BUDGET * self._elapsed_s + EXPLORE_ALLOWANCE_S

    # -- while drafting ------------------------------------------------------------------------
    def keep_drafting(self, plan: Plan, drafter: int, active: Sequence[int],
                      confidences: Sequence[Sequence[float]], drafted_s: float = 0.0
                      ) -> list[int]:
        """`control.drafting_rules.keep_drafting` for in-worker drafter ``drafter``, each request's
        confidences calibrated in its temperature band."""
        rows = plan.model_rows[drafter]
        return keep_drafting(
            plan, active, confidences,
            lambda i: self.band(plan.bands[rows[i]] if plan.bands else 0).calibrations[drafter],
            self.pass_costs[drafter], self.max_lookahead)

    def wait_s(self, plan: Plan, late: Sequence[tuple[int, int]], max_wait_s: float) -> float:
        """`control.drafting_rules.wait_s`, at the streaming drafters' measured step time."""
        return wait_s(plan, self.draft_cost(1, max(1, len(late))), late, max_wait_s)

    # -- reporting -----------------------------------------------------------------------------
    def _count(self, requests: Sequence[PlanRequest], plan: Plan) -> None:
        c = self.counts
        rows = plan.model_row_set
        c["steps_with_models"] += bool(rows)
        for i, r in enumerate(requests):
            c["request_steps"] += 1
            streamed = plan.streaming and r.streamed_len > 0
            if i in rows or streamed:
                c["with_models"] += 1
            elif r.free_len > 0:
                c["without_models_free_chain"] += 1
            else:
                c["without_models_no_chain"] += 1
            if plan.lookaheads[i] == 0:
                c["no_draft"] += 1
            elif i not in rows:
                c["in_hand_only"] += 1

    def snapshot(self) -> dict[str, Any]:
        def rounded(xs: Sequence[float]) -> list[float]:
            return [round(x, 4) for x in xs]

        return {
            "policy": "adaptive",
            "steps": self.steps,
            **self.counts,
            "explore_spent_s": round(self.explore_spent_s, 4),
            "yield": {kind: round(self.yield_factor(kind), 4) for kind in self._yield},
            "elapsed_s": round(self._elapsed_s, 4),
            "acceptance_free": rounded(self.acceptance_free.global_acceptance()),
            "acceptance_models": rounded(self.acceptance_models[False].global_acceptance()),
            "acceptance_models_with_free": rounded(
                self.acceptance_models[True].global_acceptance()),
            "observations_models": rounded(self.acceptance_models[False].global_trials()),
            "prompt_tokens": round(self._prompt, 2),
            "overhead_s": round(self._overhead_s, 6),
            "target_cost": self.target_cost.snapshot(),
            **({"target_cost_streaming": self.target_cost_streaming.snapshot(),
                "streaming": self.switch.snapshot()} if self.switch is not None else {}),
            "drafters": [{"pass_cost": c.snapshot(),
                          "calibration": [round(p, 3) for p in cal.curve()],
                          "calibration_observations": cal.num_observations}
                         for c, cal in zip(self.pass_costs, self.calibrations, strict=True)],
            "draft_cost": self.draft_cost.snapshot(),
            # Sampled requests' estimates, per temperature band that has been seen (model
            # drafts in one context there, see _with_free_context).
            "bands": {band: {"acceptance_free": rounded(e.free.global_acceptance()),
                             "acceptance_models": rounded(e.models[False].global_acceptance())}
                      for band, e in sorted(self._bands.items()) if band > 0},
            "last_plan": {k: (round(v, 6) if isinstance(v, float) else v)
                          for k, v in self._last.items()},
        }


# Re-exported for the proposer and the tests (the parts' own modules define them).
__all__ += ["DrafterOutcome", "Plan", "PlanRequest", "RequestOutcome"]
