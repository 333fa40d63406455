"""The adaptive controller of synchronous (in-worker) drafting: each step, which drafters run, for
which requests, and how far each request's draft goes.

An in-worker model drafter computes in the target's step, on the target's threads: its cost is
what it adds to the step, a forward per draft position (the first one also catches the drafter up
with the text it skipped), and its drafts can stop at any position. So every step is planned
afresh, there is nothing to switch on or off, and the draft length is decided while drafting:

1. **Two plans, the better taken** (:meth:`StepPlanner.plan`). *Free*: drafts from the model-free
   voters only (n-gram lookup: microseconds). *Models*: the model drafters draft too, and the vote
   picks one chain per request. Each plan's expected tokens come from its own
   :class:`~vllm_smurfs.acceptance.AcceptanceModel` (per request and position: the n-gram
   chain's acceptance in steps it drafted; the voted chain's in steps the models drafted), its
   time from measured curves: the target's step by tokens verified
   (:class:`~vllm_smurfs.step_costs.StepCostModel`), each drafter's forward by tokens
   computed, the proposer's own time. Per request the lookahead is allocated greedily (the next
   token to the request with the largest expected gain) to the best predicted rate, as in
   `AdaptiveLookahead`. A prompt chunk in the step counts as work done, like output tokens.
   A request the drafter has not followed for a while costs its catch-up in the first forward;
   beyond a normal step's catch-up this is an investment in the request's later steps, charged
   spread over them (at most its remaining token budget).
2. **Drafts stop by confidence** (:meth:`StepPlanner.keep_drafting`). After each forward a
   request's draft goes on while the next token's expected value, the chance that the whole
   draft so far and the next token are accepted (the drafter's probabilities, calibrated against
   what the target accepted: :class:`ConfidenceCalibration`), is worth its time at the plan's
   rate: the verification of one more token, and a share of the next forward. A confident
   drafter drafts long, an unsure one stops after a token or two.

Pure module (stdlib only): runs every step for up to a few hundred requests.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_smurfs.acceptance import AcceptanceModel
from vllm_smurfs.lookahead_types import StepFeedback, StepTiming, room_for_drafts
from vllm_smurfs.step_costs import StepCostModel, isotonic_regression

__all__ = ["ConfidenceCalibration", "DrafterOutcome", "Plan", "PlanRequest", "StepPlanner"]

# Bins of the drafter's probability for its token; each starts from the belief that the
# probability is calibrated (acceptance = the bin's centre) with the weight of this many
# observations, so a few hundred verified tokens set the curve.
_CALIBRATION_BINS = 10
_CALIBRATION_PRIOR_STRENGTH = 4.0
# The calibration forgets with a time constant of this many verified tokens (a workload change).
_CALIBRATION_MEMORY = 2048.0
# Background (prompt) tokens of a step are smoothed with weight 0.5 on the last step: chunked
# prefills come in runs of a few steps (see length_controller._BACKGROUND_SMOOTHING).
_BACKGROUND_SMOOTHING = 0.5
# The proposer's own time per step (model-free drafting, voting, planning) is an exponential
# average with this weight on the last step.
_OVERHEAD_SMOOTHING = 0.2
# A request's catch-up beyond a normal step's (accepted + 1 tokens, for a drafter that followed
# every step) is an investment in its later steps: spread over those the models are expected to
# draft in (its remaining budget over a guess of tokens per step, at most this many, times the
# share of requests the models drafted for in recent steps). Under load, where the models
# seldom draft, a request's catch-up is then charged nearly in full; at batch 1, where they draft
# in about half the steps, over about a quarter of the request. (Spreading it over every
# remaining step, drafted in or not, ran 0.95x no speculation at 16 in flight, where the models
# caught up with requests they then did not draft for.)
_CATCH_UP_SPREAD_STEPS = 32
_TOKENS_PER_STEP_GUESS = 2.0
# Exponential average, per step, of the share of requests the models drafted for (the start:
# an even chance).
_MODEL_SHARE_SMOOTHING = 0.05
_MODEL_SHARE_START = 0.5
# A longer plan must beat the shorter by this relative margin (ties go to less work).
_MIN_RELATIVE_GAIN = 1e-9
# Drafting at all (any draft token, the model drafters' plan over the free one) must promise
# this much more than not: the predictions carry errors of a few percent (acceptance estimated
# from a request's last steps, step costs that drift), and under load, where speculation breaks
# even at best on a 2-core CPU, a plan that only ties pays for them (measured without it: 0.93x
# and 0.95x no speculation at 16 in flight, the n-gram drafts verified in compute-bound steps).
_DRAFT_MARGIN = 0.03
# The model plan's acceptance is learnt only in steps the models draft: until it has this many
# (decayed) observations at position 1 the models draft whenever they can (exploration), and
# after this many steps without them they draft once for the request that costs them the least
# catch-up (a probe), so a change of text or load is noticed; at most 1% of the target's time
# since they last drafted goes to a probe's predicted forwards (a probe at batch 1 costs about
# one step's drafting every 64 steps; under load, a probe that would first catch up with a
# whole prompt waits until the 1% covers it).
_EXPLORE_OBSERVATIONS = 8.0
_PROBE_INTERVAL_STEPS = 64
_PROBE_BUDGET = 0.01
# Exploration drafts for the requests whose catch-up is cheapest, this many catch-up tokens in
# all (at least one request): under load, a first step for every request would prefill every
# prompt in the drafter at once.
_EXPLORE_CATCH_UP_TOKENS = 512


@dataclass(frozen=True)
class PlanRequest:
    """What the planner knows of one request this step."""

    req_id: str
    num_tokens: int  # context length (prompt + output so far)
    max_model_len: int
    free_len: int = 0  # tokens the model-free voters have drafted for it
    catch_up: tuple[int | None, ...] = ()  # per model drafter: tokens its first forward would
    # compute for this request (None: it cannot draft for it, e.g. past its context limit)
    remaining: int | None = None  # output tokens the request may still produce (None: unknown)


@dataclass
class Plan:
    """One step's decision."""

    lookaheads: list[int]  # per request: most draft tokens proposed
    free_lens: list[int]  # per request: n-gram tokens taken (free plan: its whole draft)
    model_rows: list[list[int]]  # per model drafter: the requests it drafts for (empty: sits out)
    rate: float  # predicted tokens per second of the step (drafts stop where they fall below it)
    verify_s: float  # predicted seconds one more verified token adds to the step
    mode: str = "free"
    expected_tokens: float = 0.0
    step_seconds: float = 0.0
    # The step without the model drafters' tokens (for the stop rule's running rate): expected
    # tokens (prompt chunks, one per request, the n-gram drafts of requests the models skip) and
    # tokens the target computes, and the proposer's own time.
    base_expected: float = 0.0
    base_tokens: float = 0.0
    overhead_s: float = 0.0

    @property
    def models(self) -> bool:
        return any(self.model_rows)


@dataclass(frozen=True)
class DrafterOutcome:
    """How one drafter's draft fared against the tokens the target produced."""

    tokens: int  # draft length
    matched: int  # leading draft tokens equal to the produced ones
    observed: int  # produced tokens (positions beyond them are unknown)
    confidences: tuple[float, ...] = ()  # the drafter's probability of each draft token


class ConfidenceCalibration:
    """``P(accepted | the draft before it accepted, the drafter's probability c)``, learnt online.

    Binned by ``c``, each bin a Beta estimate starting at the bin's centre; the bins' estimates
    are made non-decreasing in ``c`` (a more confident drafter is never less right) by isotonic
    regression, and forget with a time constant of ``memory`` observations.
    """

    def __init__(self, bins: int = _CALIBRATION_BINS,
                 prior_strength: float = _CALIBRATION_PRIOR_STRENGTH,
                 memory: float = _CALIBRATION_MEMORY) -> None:
        if bins < 1:
            raise ValueError(f"bins must be >= 1, got {bins}")
        if not (prior_strength > 0 and memory > 0):
            raise ValueError("prior_strength and memory must be > 0")
        self.bins = bins
        self.prior_strength = prior_strength
        self._decay = math.exp(-1.0 / memory)
        self._succ = [0.0] * bins
        self._trials = [0.0] * bins
        self._curve: list[float] | None = None
        self.num_observations = 0

    def _bin(self, conf: float) -> int:
        return min(self.bins - 1, max(0, int(conf * self.bins)))

    def observe(self, conf: float, accepted: bool) -> None:
        d = self._decay
        for i in range(self.bins):
            self._succ[i] *= d
            self._trials[i] *= d
        b = self._bin(conf)
        self._succ[b] += 1.0 if accepted else 0.0
        self._trials[b] += 1.0
        self._curve = None
        self.num_observations += 1

    def curve(self) -> list[float]:
        if self._curve is None:
            c = self.prior_strength
            raw = [(s + c * (i + 0.5) / self.bins) / (n + c)
                   for i, (s, n) in enumerate(zip(self._succ, self._trials, strict=True))]
            weights = [n + c for n in self._trials]
            self._curve = isotonic_regression(raw, weights)
        return self._curve

    def __call__(self, conf: float) -> float:
        return self.curve()[self._bin(conf)]


@dataclass
class _Gain:
    value: float  # expected tokens this draft token adds
    row: int
    position: int  # 1-based


@dataclass
class _DrafterState:
    pass_cost: StepCostModel = field(default_factory=StepCostModel)
    calibration: ConfidenceCalibration = field(default_factory=ConfidenceCalibration)


class StepPlanner:
    """Plans synchronous drafting steps (see the module docstring).

    ``num_model_drafters``: in-worker model drafters (the plan's ``model_rows`` has one list per
    drafter). ``min_lookahead``: every request gets at least this many draft tokens (>= 1 makes
    the model drafters draft every step). ``pause_models``: False keeps the model drafters in
    every step that drafts.
    """

    def __init__(self, max_lookahead: int, num_model_drafters: int, min_lookahead: int = 0,
                 pause_models: bool = True) -> None:
        if max_lookahead < 1:
            raise ValueError(f"max_lookahead must be >= 1, got {max_lookahead}")
        if not 0 <= min_lookahead <= max_lookahead:
            raise ValueError(f"min_lookahead must be in [0, {max_lookahead}], got {min_lookahead}")
        self.max_lookahead = max_lookahead
        self.min_lookahead = min_lookahead
        self.pause_models = pause_models
        self.acceptance_model_free = AcceptanceModel(max_lookahead)
        self.acceptance_models = AcceptanceModel(max_lookahead)
        self.target_cost = StepCostModel()
        self.drafters = [_DrafterState() for _ in range(num_model_drafters)]
        self._background = 0.0
        self._overhead_s = 0.0
        self._planned_tokens: int | None = None
        self._last: dict[str, Any] = {}
        self.steps = 0
        self.steps_with_models = 0
        self.probes = 0
        self._last_models_step = 0
        self._elapsed_s = 0.0  # the target's step time observed so far
        self._last_models_s = 0.0  # _elapsed_s when the models last drafted
        self.model_share = _MODEL_SHARE_START  # recent share of requests the models drafted for

    # -- learning ------------------------------------------------------------------------------
    def observe_step(self, timing: StepTiming) -> None:
        """The target's step (without the proposer's own time, which ``overhead_s`` carries:
        drafting with the model-free voters, voting, planning; not the drafter forwards)."""
        self.target_cost.observe(timing.num_tokens, timing.seconds)
        self._elapsed_s += timing.seconds
        self._overhead_s += _OVERHEAD_SMOOTHING * (timing.overhead_s - self._overhead_s)
        if self._planned_tokens is not None:
            extra = max(0, timing.num_tokens - self._planned_tokens)
            self._background += _BACKGROUND_SMOOTHING * (extra - self._background)
            self._planned_tokens = None

    def observe_pass(self, drafter: int, num_tokens: int, seconds: float) -> None:
        """One forward of model drafter ``drafter`` over ``num_tokens`` tokens."""
        self.drafters[drafter].pass_cost.observe(num_tokens, seconds)

    def observe(self, free: Sequence[tuple[str, DrafterOutcome]],
                voted_with_models: Sequence[StepFeedback],
                models: Sequence[Sequence[DrafterOutcome]] = ()) -> None:
        """Outcomes of the last step: the model-free voters' chain per request (``free``), the
        voted chain of requests the model drafters drafted for, and each model drafter's own
        draft (``models[d]``, with its confidences) for its calibration."""
        self.acceptance_model_free.observe([
            StepFeedback(req_id, *_observed(outcome)) for req_id, outcome in free])
        self.acceptance_models.observe(voted_with_models)
        for state, outcomes in zip(self.drafters, models, strict=False):
            for outcome in outcomes:
                limit = min(outcome.tokens, outcome.observed, len(outcome.confidences))
                for j in range(limit):
                    accepted = j < outcome.matched
                    state.calibration.observe(outcome.confidences[j], accepted)
                    if not accepted:
                        break

    def forget(self, req_ids: Iterable[str]) -> None:
        req_ids = list(req_ids)
        self.acceptance_model_free.forget(req_ids)
        self.acceptance_models.forget(req_ids)

    # -- planning ------------------------------------------------------------------------------
    def plan(self, requests: Sequence[PlanRequest], max_lookahead: int) -> Plan:
        """The better of the free and the model plans for this step."""
        n = len(requests)
        num_drafters = len(self.drafters)
        if n == 0:
            return Plan([], [], [[] for _ in range(num_drafters)], 0.0, 0.0)
        self.steps += 1
        ids = [r.req_id for r in requests]
        self.acceptance_model_free.tick(ids)
        self.acceptance_models.tick(ids)
        top = max(0, min(self.max_lookahead, max_lookahead))
        caps = [min(top, room_for_drafts(r)) for r in requests]  # type: ignore[arg-type]
        lows = [min(self.min_lookahead, c) for c in caps]
        free_caps = [min(c, max(0, r.free_len)) for c, r in zip(caps, requests, strict=True)]

        free_plan = self._model_free_plan(requests, free_caps)
        best = free_plan
        can_model = [r for r in range(n) if caps[r] > 0 and any(
            c is not None for c in requests[r].catch_up[:num_drafters])] if num_drafters else []
        force_models = num_drafters and (not self.pause_models or any(lows))
        exploring = self.acceptance_models.global_trials()[0] < _EXPLORE_OBSERVATIONS
        if can_model:
            if exploring and not force_models:
                # The requests cheapest to catch up with get at least one model token each.
                chosen, budget = set(), _EXPLORE_CATCH_UP_TOKENS
                for r in sorted(can_model, key=lambda r: _catch_up_total(requests[r])):
                    if chosen and _catch_up_total(requests[r]) > budget:
                        break
                    chosen.add(r)
                    budget -= _catch_up_total(requests[r])
                explore_caps = [caps[r] if r in chosen else 0 for r in range(n)]
                model_plan = self._model_plan(requests, explore_caps,
                                              [min(1, c) for c in explore_caps], sorted(chosen),
                                              free_plan)
                model_plan.mode = "explore"
            else:
                model_plan = self._model_plan(requests, caps, lows, can_model, free_plan)
            if (force_models or exploring
                    or model_plan.rate > free_plan.rate * (1.0 + _DRAFT_MARGIN)):
                best = model_plan
            elif (self.steps - self._last_models_step >= _PROBE_INTERVAL_STEPS
                  and self._probe_affordable(
                      cheapest := min(can_model, key=lambda r: _catch_up_total(requests[r])),
                      requests)):
                probe_caps = [caps[r] if r == cheapest else 0 for r in range(n)]
                best = self._model_plan(requests, probe_caps, [min(1, c) for c in probe_caps],
                                        [cheapest], free_plan)
                best.mode = "probe"
                self.probes += 1
        if best.models:
            self.steps_with_models += 1
            self._last_models_step = self.steps
            self._last_models_s = self._elapsed_s
        drafted = len({r for rows in best.model_rows for r in rows})
        self.model_share += _MODEL_SHARE_SMOOTHING * (drafted / n - self.model_share)
        self._planned_tokens = sum(1 + k for k in best.lookaheads)
        self._last = {"mode": best.mode, "rate": best.rate, "free_rate": free_plan.rate,
                      "expected_tokens": best.expected_tokens,
                      "step_seconds": best.step_seconds, "num_reqs": n,
                      "model_rows": [len(rows) for rows in best.model_rows],
                      "background_tokens": self._background}
        return best

    def _probe_affordable(self, row: int, requests: Sequence[PlanRequest]) -> bool:
        """Whether a probe of request ``row``'s predicted forwards (its catch-up, one more token)
        fit in _PROBE_BUDGET of the target's time since the models last drafted."""
        catch_up = _catch_up_total(requests[row])
        cost = sum(state.pass_cost(catch_up) + state.pass_cost(1) for state in self.drafters)
        return cost <= _PROBE_BUDGET * (self._elapsed_s - self._last_models_s)

    def _model_free_plan(self, requests: Sequence[PlanRequest], free_caps: list[int]) -> Plan:
        n = len(requests)
        cum = [_cumulative(self.acceptance_model_free.request_acceptance(r.req_id), c)
               for r, c in zip(requests, free_caps, strict=True)]
        ks, rate, exp_tokens, seconds = self._allocate(cum, [0] * n, lambda *_: 0.0)
        return Plan(lookaheads=list(ks), free_lens=list(ks),
                    model_rows=[[] for _ in self.drafters], rate=rate,
                    verify_s=self._verify_s(sum(1 + k for k in ks)), mode="free",
                    expected_tokens=exp_tokens, step_seconds=seconds)

    def _model_plan(self, requests: Sequence[PlanRequest], caps: list[int], lows: list[int],
                    rows: list[int], free_plan: Plan) -> Plan:
        n = len(requests)
        model_caps = [caps[r] if r in set(rows) else 0 for r in range(n)]
        model_lows = [min(lows[r], model_caps[r]) for r in range(n)]
        cum = [_cumulative(self.acceptance_models.request_acceptance(r.req_id), c)
               for r, c in zip(requests, model_caps, strict=True)]
        # What a request's first forward costs each drafter: its catch-up, spread over its
        # later steps beyond what a drafter that followed every step computes.
        charged = [[_charged_catch_up(r.catch_up[d] if d < len(r.catch_up) else None,
                                      self.max_lookahead, r.remaining, self.model_share)
                    for d in range(len(self.drafters))] for r in requests]

        def drafting_s(num_rows: int, catch_up: list[float], max_k: int) -> float:
            total = 0.0
            for d, state in enumerate(self.drafters):
                if catch_up[d] <= 0:
                    continue
                total += state.pass_cost(catch_up[d])
                if max_k > 1:
                    total += (max_k - 1) * state.pass_cost(num_rows)
            return total

        ks, _, exp_tokens, _ = self._allocate(cum, model_lows, drafting_s, charged)
        model_rows = [[r for r in range(n) if ks[r] > 0 and requests[r].catch_up[d] is not None]
                      for d in range(len(self.drafters))]
        # Requests the models do not draft for keep their n-gram draft, and its worth.
        free_lens = [0 if ks[r] > 0 else free_plan.free_lens[r] for r in range(n)]
        lookaheads = [ks[r] if ks[r] > 0 else free_lens[r] for r in range(n)]
        free_cum = [_cumulative(self.acceptance_model_free.request_acceptance(r.req_id), k)
                    for r, k in zip(requests, free_lens, strict=True)]
        exp_tokens += sum(sum(qs) for qs in free_cum)
        tokens = self._background + sum(1 + k for k in lookaheads)
        drafted = [r for r in range(n) if ks[r] > 0]
        catch_up = [sum(charged[r][d] for r in drafted) for d in range(len(self.drafters))]
        seconds = (self.target_cost(tokens) + self._overhead_s
                   + (drafting_s(len(drafted), catch_up, max(ks)) if drafted else 0.0))
        rate = exp_tokens / max(seconds, 1e-300)
        base_tokens = self._background + sum(1 + k for k in free_lens)
        base_expected = self._background + n + sum(sum(qs) for qs in free_cum)
        return Plan(lookaheads=lookaheads, free_lens=free_lens, model_rows=model_rows, rate=rate,
                    verify_s=self._verify_s(sum(1 + k for k in lookaheads)), mode="models",
                    expected_tokens=exp_tokens, step_seconds=seconds,
                    base_expected=base_expected, base_tokens=base_tokens,
                    overhead_s=self._overhead_s)

    def _verify_s(self, tokens: int) -> float:
        b = self._background
        return max(0.0, self.target_cost(b + tokens + 1) - self.target_cost(b + tokens))

    def _allocate(self, cum: list[list[float]], lows: list[int], drafting_s: Any,
                  charged: list[list[float]] | None = None
                  ) -> tuple[list[int], float, float, float]:
        """Greedy allocation of draft tokens (largest expected gain first) to the best rate.

        Returns (lookaheads, rate, expected tokens, step seconds). ``drafting_s(rows, catch_up
        per drafter, max_k)`` prices the model drafters (zero for the free plan);
        ``charged[r][d]``: request r's catch-up tokens for drafter d, counted once r drafts.
        """
        n = len(cum)
        num_drafters = len(self.drafters)
        gains = sorted((_Gain(qs[j - 1], r, j) for r, qs in enumerate(cum)
                        for j in range(lows[r] + 1, len(qs) + 1)),
                       key=lambda g: -g.value)
        levels = list(lows)
        background = self._background
        exp_tokens = background + sum(1.0 + sum(qs[:lo]) for qs, lo in zip(cum, lows,
                                                                             strict=True))
        tokens = background + sum(1 + lo for lo in lows)
        catch_up = [0.0] * num_drafters
        rows = 0
        for r, lo in enumerate(lows):
            if lo > 0:
                rows += 1
                if charged is not None:
                    for d in range(num_drafters):
                        catch_up[d] += charged[r][d]
        max_k = max(lows, default=0)
        overhead = self._overhead_s

        def seconds() -> float:
            return (self.target_cost(tokens) + overhead
                    + (drafting_s(rows, catch_up, max_k) if rows else 0.0))

        best_s = seconds()
        best_rate = exp_tokens / max(best_s, 1e-300)
        best_exp = exp_tokens
        best_len = 0
        rate0, s0, exp0 = best_rate, best_s, best_exp
        for idx, g in enumerate(gains, 1):
            exp_tokens += g.value
            tokens += 1
            if levels[g.row] == 0:
                rows += 1
                if charged is not None:
                    for d in range(num_drafters):
                        catch_up[d] += charged[g.row][d]
            levels[g.row] = g.position
            max_k = max(max_k, g.position)
            t = seconds()
            rate = exp_tokens / max(t, 1e-300)
            if rate > best_rate * (1.0 + _MIN_RELATIVE_GAIN):
                best_rate, best_len, best_s, best_exp = rate, idx, t, exp_tokens
        if best_len and best_rate < rate0 * (1.0 + _DRAFT_MARGIN):
            best_len, best_rate, best_s, best_exp = 0, rate0, s0, exp0  # not worth the risk
        ks = list(lows)
        for g in gains[:best_len]:
            ks[g.row] = g.position
        return ks, best_rate, best_exp, best_s

    # -- while drafting ------------------------------------------------------------------------
    def keep_drafting(self, plan: Plan, drafter: int, active: Sequence[int],
                      confidences: Sequence[Sequence[float]], drafted_s: float = 0.0) -> list[int]:
        """Which of the ``active`` requests get one more token from model drafter ``drafter``.

        ``confidences[i]``: the drafter's probability of each token it drafted so far for the
        i-th request of its ``plan.model_rows``; ``active`` indexes them; ``drafted_s``: the
        seconds its forwards took so far this step.

        The step so far is worth ``S`` expected tokens in ``T`` seconds: the plan's part without
        these drafts, plus every draft's expected accepted tokens (``q``, the chance a draft's
        first tokens are all accepted, from the calibrated probabilities), in the target's
        predicted time plus the drafting done. For an active request, ``a``, the chance of a
        next token given its predecessors, is its last token's calibrated probability (the
        drafter's certainty runs in streaks); its next ``h`` tokens are worth
        ``q * (a + ... + a^h)``. A request goes on
        while its next token beats ``S / T`` times its verification; the forward runs while,
        for some ``h``, the requests that go on bring more per second over the next ``h``
        forwards than ``S / T`` (a confidently continuing draft pays over several).
        """
        if not active:
            return []
        state = self.drafters[drafter]
        cal = state.calibration
        qs = []
        expected = plan.base_expected
        drafted = 0
        for confs in confidences:
            q = 1.0
            for c in confs:
                q *= cal(c)
                expected += q
            qs.append(q)
            drafted += len(confs)
        seconds = (self.target_cost(plan.base_tokens + drafted) + plan.overhead_s + drafted_s)
        rate = expected / max(seconds, 1e-300)
        keep: list[tuple[int, float, float]] = []  # (request, q, a)
        for r in active:
            confs = confidences[r]
            if not confs:
                continue
            # The drafter's certainty runs in streaks: its last token's calibrated probability
            # stands for the next one's.
            a = cal(confs[-1])
            if qs[r] * a > rate * plan.verify_s:
                keep.append((r, qs[r], a))
        if not keep:
            return []
        if state.pass_cost.is_empty:
            return [r for r, _, _ in keep]
        pass_s = state.pass_cost(len(keep)) + len(keep) * plan.verify_s
        for h in range(1, self.max_lookahead + 1):
            worth = sum(q * sum(a ** i for i in range(1, h + 1)) for _, q, a in keep)
            if worth > rate * h * pass_s:
                return [r for r, _, _ in keep]
        return []

    def snapshot(self) -> dict[str, Any]:
        return {
            "policy": "adaptive-in-worker",
            "steps": self.steps,
            "steps_with_models": self.steps_with_models,
            "probes": self.probes,
            "model_share": round(self.model_share, 4),
            "acceptance_free": [round(p, 4)
                                for p in self.acceptance_model_free.global_acceptance()],
            "acceptance_models": [round(p, 4)
                                  for p in self.acceptance_models.global_acceptance()],
            "target_cost": self.target_cost.snapshot(),
            "drafters": [{"pass_cost": s.pass_cost.snapshot(),
                          "calibration": [round(p, 3) for p in s.calibration.curve()],
                          "calibration_observations": s.calibration.num_observations}
                         for s in self.drafters],
            "overhead_s": round(self._overhead_s, 6),
            "last_plan": {k: (round(v, 6) if isinstance(v, float) else v)
                          for k, v in self._last.items()},
        }


def _catch_up_total(request: PlanRequest) -> int:
    return sum(c for c in request.catch_up if c is not None)


def _observed(outcome: DrafterOutcome) -> tuple[int, int]:
    """(draft tokens, accepted) of a draft as far as the produced tokens tell."""
    seen = min(outcome.tokens, outcome.observed)
    return seen, min(outcome.matched, seen)


def _cumulative(acceptance: list[float], cap: int) -> list[float]:
    out, q = [], 1.0
    for p in acceptance[:cap]:
        q *= p
        out.append(q)
    return out


def _charged_catch_up(tokens: int | None, max_lookahead: int, remaining: int | None,
                      model_share: float = 1.0) -> float:
    """Catch-up tokens charged to this step: all of a normal step's (up to a full accepted
    lookahead and its bonus token), the rest spread over the request's later steps that the
    models are expected to draft in (``model_share`` of them)."""
    if tokens is None:
        return 0.0
    normal = max_lookahead + 1
    if tokens <= normal:
        return float(tokens)
    steps = _CATCH_UP_SPREAD_STEPS
    if remaining is not None:
        steps = min(steps, math.ceil(remaining / _TOKENS_PER_STEP_GUESS))
    steps = max(1.0, steps * model_share)
    return normal + (tokens - normal) / steps
