"""Lookahead (draft length) policies: the interface, the fixed policy and the adaptive controller.

Each step the proposer asks a :class:`LookaheadPolicy` how many tokens to draft for every running
request, and afterwards tells it how many of them the target accepted (:class:`StepFeedback`), how
long the target's step took (:class:`StepTiming`) and how long the drafter calls took
(:class:`DraftTiming`). :class:`FixedLookahead` always asks for the configured
``num_speculative_tokens``, clipped to what the engine and the model length allow.
:class:`AdaptiveLookahead` picks every request's lookahead to maximise the batch's expected tokens
per second, from three models learnt online:

* :class:`AcceptanceModel`: per position conditional acceptance, per request with a global prior;
* :class:`StepCostModel`: the target step's seconds as a function of the tokens it verifies;
* :class:`DraftCostModel`: a drafter call's seconds from its batch size and draft length.

With model drafters that can be left out (``model_free_mode``), the two plans' predicted step
times are also checked against the time their steps took (:class:`StepTimeCalibration`, one per
plan), and which plan is taken is decided by a :class:`DrafterModeController`.

The parts live in modules of their own: the interface in `lookahead_types`, acceptance in
`acceptance`, the cost models in `step_costs`, the plan and its greedy allocation in
`lookahead_plan`, the switching of model drafting (dwell, margin, retries) in `lookahead_mode`;
this module keeps the two policies (`AdaptiveLookahead` is the facade that ties the parts
together) and re-exports the rest, as the entry point to the idea.

Pure (stdlib only, no vllm/torch): :meth:`AdaptiveLookahead.choose` runs every step for up to a
few hundred requests, so it is written to cost O(n * max_lookahead * log) plain-Python work.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from vllm_smurfs.acceptance import (
    _DEFAULT_GLOBAL_MEMORY,
    _DEFAULT_PRIOR_STRENGTH,
    _DEFAULT_REQUEST_HALF_LIFE_STEPS,
    AcceptanceModel,
)
from vllm_smurfs.lookahead_mode import QUIET_BACKGROUND, DrafterModeController
from vllm_smurfs.lookahead_plan import (
    LookaheadPlan,
    cumulative_acceptance,
    expected_table,
    greedy_lookaheads,
    step_seconds,
)
from vllm_smurfs.lookahead_types import (
    DraftTiming,
    LookaheadPolicy,
    RequestView,
    StepFeedback,
    StepTiming,
    _check_max_lookahead,
    _check_wait_args,
    room_for_drafts,
)
from vllm_smurfs.model_drafting import ModelDrafting
from vllm_smurfs.step_costs import (
    _DEFAULT_COST_WINDOW,
    _DEFAULT_DRAFT_WINDOW,
    DraftCostModel,
    StepCostModel,
    StepTimeCalibration,
    _PendingSample,
)

__all__ = [
    "AcceptanceModel",
    "AdaptiveLookahead",
    "DraftCostModel",
    "DraftTiming",
    "DrafterModeController",
    "FixedLookahead",
    "LookaheadPlan",
    "LookaheadPolicy",
    "RequestView",
    "StepCostModel",
    "StepFeedback",
    "StepTimeCalibration",
    "StepTiming",
    "room_for_drafts",
]


class FixedLookahead:
    """Always draft ``num_speculative_tokens`` (clipped); implements :class:`LookaheadPolicy`.

    Keeps running totals ``total_drafted`` / ``total_accepted`` for metrics only; they never
    influence the choice. Timings are ignored and it always waits the full ``max_wait_s``.
    """

    def __init__(self, num_speculative_tokens: int) -> None:
        """Raises ValueError when ``num_speculative_tokens < 1``."""
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.num_speculative_tokens = num_speculative_tokens
        self.total_drafted = 0
        self.total_accepted = 0

    def observe(self, feedback: Sequence[StepFeedback], models_ready: bool = True) -> None:
        for fb in feedback:
            self.total_drafted += fb.num_draft_tokens
            self.total_accepted += fb.num_accepted

    def observe_step(self, timing: StepTiming) -> None:
        return None

    def observe_draft(self, timing: DraftTiming) -> None:
        return None

    @property
    def models_on(self) -> bool:
        return True

    def choose(self, requests: Sequence[RequestView], max_lookahead: int,
               free_lens: Sequence[int] | None = None) -> list[int]:
        """``min(num_speculative_tokens, max_lookahead, room_for_drafts(r))`` per request.

        Raises:
            ValueError: when ``max_lookahead < 0``.
        """
        _check_max_lookahead(max_lookahead)
        cap = min(self.num_speculative_tokens, max_lookahead)
        return [min(cap, room_for_drafts(r)) for r in requests]

    def wait_bound(
        self, requests: Sequence[RequestView], ready: Sequence[int], max_wait_s: float
    ) -> float:
        """Always ``max_wait_s``: a fixed lookahead has no model to weigh the wait against."""
        _check_wait_args(requests, ready, max_wait_s)
        return max_wait_s

    def forget(self, req_ids: Iterable[str]) -> None:
        # No per-request state; the totals are global and must survive request turnover.
        return None

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over drafted so far; None before anything was drafted."""
        if self.total_drafted == 0:
            return None
        return self.total_accepted / self.total_drafted

    def snapshot(self) -> dict[str, Any]:
        rate = self.acceptance_rate
        return {
            "policy": "fixed",
            "num_speculative_tokens": self.num_speculative_tokens,
            "total_drafted": self.total_drafted,
            "total_accepted": self.total_accepted,
            "acceptance_rate": None if rate is None else round(rate, 6),
        }


# ------------------------------------------------------------------------------------ controller

# Every 16 steps the request that has gone longest without a draft gets one draft token: the only
# way to notice that a request (or the whole workload, when everything sits at k=0 under heavy
# load) became predictable. It costs at most one token of verification per 16 steps, <0.2% of the
# step at 32 requests.
_DEFAULT_PROBE_INTERVAL = 16
# Prefill chunks share the step with the decodes; their tokens ("background") are tracked as an
# exponential average with weight 0.5 on the last step: chunked prefills come in runs of a few
# steps, so the last step is the best guess of the next one, and the average drops back within a
# few steps after the run.
_BACKGROUND_SMOOTHING = 0.5


class AdaptiveLookahead:
    """Per-request lookaheads maximising the batch's expected tokens per second.

    For a choice ``k_1..k_n`` the batch is predicted to do ``B + sum_r E_r(k_r)`` tokens of work
    (:meth:`AcceptanceModel.expected_tokens`, plus the prefill tokens ``B`` the steps have been
    carrying: a prompt token is work the run must do as much as an output token, so drafts that
    slow a compute-bound prefill step, or take its token budget, count against themselves; the
    alternative measured, leaving the chunk's time out and pricing draft tokens at what they add
    on top of it, drafted more in prefill steps and ran 5-10% slower served, see
    docs/results-history.md) in
    ``T = target(B + sum_r (1 + k_r)) + visible drafting``, where ``target`` is the
    :class:`StepCostModel`, and the drafting time is the :class:`DraftCostModel` of a call of
    ``max k_r`` positions for the requests with ``k_r > 0``: all of it in synchronous mode, only
    ``max(0, draft - target)`` when ``pipelined`` (drafts are computed behind the target's step).
    Drafters run concurrently in their own processes, so one call is modelled, not their sum.

    ``choose`` allocates draft tokens greedily: every request starts at its minimum, and the next
    token always goes to the request with the largest marginal gain ``prod_{i<=k+1} p_i``. Because
    each ``E_r`` is concave (the gains never increase) and the target's time depends only on the
    total, the allocation along this path is the best one for each total token count (the
    drafting time, which depends on the longest draft, is evaluated along the path, not
    optimised). The choice is the point of the path with the highest predicted rate; the whole
    path is scanned, so a cost curve with steps does not stop it early. Cost: one sort of
    ``sum_r (cap_r - min_r)`` gains and one cost evaluation per gain (~1 ms for 64 requests at
    max 8, ~4 ms for 256, in CPython).

    Exploration, instead of hand-entered costs: with no step timing yet every request drafts its
    maximum (sampling the largest token count; without any timing ever, the controller stays a
    fixed maximal lookahead); after the first timing, one step drafts the minimum (sampling the
    smallest). From then on the cost model is optimistic where it has not measured (flat beyond a
    flat region, the lowest convex completion inside gaps, a lower confidence bound on thinly
    measured token counts), so the controller goes and measures what it has not, and settles
    where the measurements say. Every ``probe_interval`` steps the request that has gone longest
    without a draft gets one token, so acceptance is never unobserved for good.

    The price of exploring is paid once per engine: at 32 requests where speculation does not
    pay, the first step at k=max costs ~8 normal steps (1.3% of a 19k-token simulated run).
    """

    def __init__(
        self,
        max_lookahead: int,
        min_lookahead: int = 0,
        pipelined: bool = True,
        *,
        request_half_life_steps: float = _DEFAULT_REQUEST_HALF_LIFE_STEPS,
        prior_strength: float = _DEFAULT_PRIOR_STRENGTH,
        global_memory: float = _DEFAULT_GLOBAL_MEMORY,
        cost_window: int = _DEFAULT_COST_WINDOW,
        draft_window: int = _DEFAULT_DRAFT_WINDOW,
        probe_interval: int = _DEFAULT_PROBE_INTERVAL,
        model_free_mode: bool = False,
        free_mode: bool | None = None,
        drafting: ModelDrafting | None = None,
    ) -> None:
        """See the module constants for the defaults' justification.

        ``model_free_mode`` (``free_mode``: its old name, still accepted): also consider, every
        step, leaving the model drafters out (drafts from the model-free voters only, see
        ``choose``'s ``free_lens``), with its own step-cost curve (`StepTiming.drafting` False:
        e.g. the target then has the cores it lends to drafters) and its own acceptance model;
        the better of the two plans is taken, with a margin and a minimum dwell against
        flapping. Each plan's predicted rate is corrected by how long its steps took, the proposer's own time included, against their predicted
        time (:class:`StepTimeCalibration`; sampled in steps without prompt chunks, and for
        the model plan only once the drafters have caught up after a switch).

        ``drafting``: the proposer's record of whether the model drafters draft (they may be
        switched off for a step the policy gave them: a prompt-heavy one); shown in the snapshot.
        What ran reaches the model through `StepTiming.drafting`; `models_on` stays the plan.

        Raises:
            ValueError: naming the setting, when ``max_lookahead < 1``, ``min_lookahead`` is not
                in ``[0, max_lookahead]``, ``probe_interval < 0`` (0 disables probing), or a
                tunable is out of range.
        """
        if max_lookahead < 1:
            raise ValueError(f"max_lookahead must be >= 1, got {max_lookahead}")
        if not (0 <= min_lookahead <= max_lookahead):
            raise ValueError(
                f"min_lookahead must be in [0, max_lookahead={max_lookahead}], got {min_lookahead}"
            )
        if probe_interval < 0:
            raise ValueError(f"probe_interval must be >= 0 (0 disables), got {probe_interval}")
        if cost_window < 1:
            raise ValueError(f"cost_window must be >= 1, got {cost_window}")
        if draft_window < 1:
            raise ValueError(f"draft_window must be >= 1, got {draft_window}")
        if free_mode is not None:  # the old spelling, kept for one release
            model_free_mode = model_free_mode or free_mode
        self.max_lookahead = max_lookahead
        self.min_lookahead = min_lookahead
        self.pipelined = pipelined
        self.probe_interval = probe_interval
        self.acceptance = AcceptanceModel(
            max_lookahead, request_half_life_steps, prior_strength, global_memory)
        self.step_cost = StepCostModel(cost_window)
        self.draft_cost = DraftCostModel(draft_window)
        self.model_free_mode = model_free_mode
        self.acceptance_model_free = AcceptanceModel(
            max_lookahead, request_half_life_steps, prior_strength, global_memory)
        self.step_cost_model_free = StepCostModel(cost_window)
        self.calibration = StepTimeCalibration()
        self.calibration_model_free = StepTimeCalibration()
        self.mode = DrafterModeController()
        self.drafting = drafting
        self._sample: _PendingSample | None = None
        self._steps = 0  # choose() calls with at least one request
        self._explored_low = False
        self._background = 0.0
        self._planned_tokens: int | None = None  # decode tokens of the last choice
        self._last_drafted: dict[str, int] = {}
        self.plan: LookaheadPlan | None = None  # the last choice's plan (wait_bound reads it)

    # The names before "free" meant model-free everywhere (kept for one release).
    @property
    def free_mode(self) -> bool:
        return self.model_free_mode

    @property
    def step_cost_free(self) -> StepCostModel:
        return self.step_cost_model_free

    @property
    def acceptance_free(self) -> AcceptanceModel:
        return self.acceptance_model_free

    @property
    def calibration_free(self) -> StepTimeCalibration:
        return self.calibration_model_free

    @property
    def switches(self) -> int:
        """Model drafting switched on or off (by the greedy choice or a retry)."""
        return self.mode.switches

    @property
    def retries(self) -> int:
        return self.mode.retries

    # -- learning ---------------------------------------------------------------------------
    @property
    def models_on(self) -> bool:
        return self.mode.models_on

    def observe(self, feedback: Sequence[StepFeedback], models_ready: bool = True) -> None:
        """The last choice's outcome (after its :meth:`observe_step`, as the proposer calls)."""
        # The feedback is about the drafts of the last choice, made in its mode.
        (self.acceptance if self.mode.models_on else self.acceptance_model_free).observe(feedback)
        self.mode.observe_feedback(any(fb.num_draft_tokens for fb in feedback), models_ready)
        sample, self._sample = self._sample, None
        if sample is not None and sample.taken_s is not None and (models_ready
                                                                   or not sample.models):
            (self.calibration if sample.models else self.calibration_model_free).observe(
                sample.predicted_s, sample.taken_s)

    def observe_step(self, timing: StepTiming) -> None:
        without = self.step_cost_model_free
        self.mode.observe_step(timing.seconds, timing.drafting,
                               None if without.is_empty else without(timing.num_tokens))
        cost = self.step_cost if timing.drafting or not self.model_free_mode else without
        cost.observe(timing.num_tokens, timing.seconds)
        extra = 0
        if self._planned_tokens is not None:
            # Verified drafts can be shorter than chosen (the vote, the scheduler), hence the
            # floor: background is then underestimated, never negative.
            extra = max(0, timing.num_tokens - self._planned_tokens)
            self._background += _BACKGROUND_SMOOTHING * (extra - self._background)
            self._planned_tokens = None
        if self._sample is not None:
            # A prompt chunk came (its time is not the plan's), or the model plan drafted
            # nothing and the step ran without the model drafters: not a sample of the plan.
            if extra or timing.drafting != self._sample.models:
                self._sample = None
            else:
                self._sample.taken_s = timing.seconds + timing.overhead_s

    def observe_draft(self, timing: DraftTiming) -> None:
        self.draft_cost.observe(timing.num_positions, timing.num_reqs, timing.seconds)

    def forget(self, req_ids: Iterable[str]) -> None:
        req_ids = list(req_ids)
        self.acceptance.forget(req_ids)
        self.acceptance_model_free.forget(req_ids)
        for req_id in req_ids:
            self._last_drafted.pop(req_id, None)
        if self.plan is not None:
            self.plan.forget(req_ids)

    # -- deciding ---------------------------------------------------------------------------
    def _drafting_cost(self, num_tokens: float) -> float:
        """Predicted seconds of a target step with model drafting: its own curve, never below
        the curve without (drafters take cores from the target or share them, never add any;
        this also prices token counts the drafting curve has not measured, e.g. prefill-heavy
        steps, at least at what they cost without drafting)."""
        t = self.step_cost(num_tokens)
        if self.model_free_mode and not self.step_cost_model_free.is_empty:
            t = max(t, self.step_cost_model_free(num_tokens))
        return t

    def choose(self, requests: Sequence[RequestView], max_lookahead: int,
               free_lens: Sequence[int] | None = None) -> list[int]:
        """One lookahead per request in ``[min(min_lookahead, cap), cap]``, where ``cap =
        min(self.max_lookahead, max_lookahead, room_for_drafts(r))``; with
        ``model_free_mode`` and the model drafters left out (`models_on` False), ``cap`` is
        also at most ``free_lens[i]`` (0 where it is not given). The choice is kept as
        :attr:`plan`.

        Raises:
            ValueError: when ``max_lookahead < 0`` or ``free_lens`` has another length.
        """
        _check_max_lookahead(max_lookahead)
        n = len(requests)
        if free_lens is not None and len(free_lens) != n:
            raise ValueError(f"got {len(free_lens)} free_lens for {n} requests")
        if n == 0:
            return []
        ids = [r.req_id for r in requests]
        self.acceptance.tick(ids)
        self._steps += 1
        top = min(self.max_lookahead, max_lookahead)
        caps = [min(top, room_for_drafts(r)) for r in requests]
        ks, models, mode, caps, cum = self._choose_mode(ids, caps, free_lens)
        self.mode.commit(self._steps, models, greedy=mode.startswith("greedy"))
        expected = expected_table(cum)

        if self.probe_interval and self._steps % self.probe_interval == 0:
            candidates = [i for i in range(n) if ks[i] == 0 and caps[i] >= 1]
            if candidates:
                i = min(candidates, key=lambda j: self._last_drafted.get(ids[j], -1))
                ks[i] = 1
                mode += "+probe"
        for req_id, k in zip(ids, ks, strict=True):
            if k > 0:
                self._last_drafted[req_id] = self._steps
            else:
                self._last_drafted.setdefault(req_id, self._steps)
        self.plan = self._plan(ids, ks, expected, models, mode)
        return ks

    def _choose_mode(self, ids: list[str], caps: list[int], free_lens: Sequence[int] | None
                     ) -> tuple[list[int], bool, str, list[int], list[list[float]]]:
        """(lookaheads, whether the model drafters draft, how it was chosen, the caps and
        cumulative acceptances of the plan taken): exploration first, then a retry of the
        model drafters when due, else the better of the two plans (`DrafterModeController`)."""
        lows = [min(self.min_lookahead, c) for c in caps]
        cum = cumulative_acceptance(self.acceptance, ids, caps)
        model_free = self.model_free_mode
        if model_free:
            self.acceptance_model_free.tick(ids)
            free_caps = [min(c, max(0, int(f))) for c, f in
                         zip(caps, free_lens if free_lens is not None else [0] * len(ids),
                             strict=True)]
            free_lows = [min(self.min_lookahead, c) for c in free_caps]

        if self.step_cost.is_empty:
            return list(caps), True, "explore-max", caps, cum
        if not self._explored_low and len(self.step_cost.knots()) < 2 and lows != caps:
            self._explored_low = True
            return list(lows), True, "explore-min", caps, cum
        if model_free and self.step_cost_model_free.is_empty:
            # One step without model drafting, to measure what it costs.
            return (list(free_caps), False, "explore-free", free_caps,
                    cumulative_acceptance(self.acceptance_model_free, ids, free_caps))
        if model_free and not self.mode.models_on and self.mode.retry_due(self._steps,
                                                                          self._background):
            self.mode.start_retry(self._steps)
            return ([min(max(1, lo), c) for lo, c in zip(lows, caps, strict=True)], True,
                    "retry", caps, cum)
        retrying = model_free and self.mode.retrying(self._steps, self._background)
        if retrying:  # a retry drafts, or it learns nothing
            lows = [min(max(1, lo), c) for lo, c in zip(lows, caps, strict=True)]
        ks, rate = greedy_lookaheads(cum, caps, lows, self._drafting_cost, self._background,
                                     self.draft_cost, self.pipelined)
        mode = "retry" if retrying else "greedy"
        if not model_free:
            return ks, True, mode, caps, cum
        cum_free = cumulative_acceptance(self.acceptance_model_free, ids, free_caps)
        ks_free, rate_free = greedy_lookaheads(cum_free, free_caps, free_lows,
                                               self.step_cost_model_free, self._background,
                                               None, self.pipelined)
        # Each plan's rate corrected by its calibration; the model plan's shrunk towards the
        # other's: until it is measured, it is taken to pay the overhead both plans pay (the
        # proposer's own time), not to have none.
        free_factor = self.calibration_model_free.factor()
        models = self.mode.choose_models(self._steps, rate * self.calibration.factor(free_factor),
                                         rate_free * free_factor, retrying)
        if not models:
            return ks_free, False, "greedy-free", free_caps, cum_free
        return ks, True, mode, caps, cum

    def _plan(self, ids: list[str], ks: list[int], expected: list[list[float]], models: bool,
              mode: str) -> LookaheadPlan:
        """The choice as a plan, with its predicted time (and a calibration sample pending)."""
        tokens = sum(1 + k for k in ks)
        self._planned_tokens = tokens
        quiet = self._background < QUIET_BACKGROUND
        total_tokens = self._background + tokens
        target_s = (self._drafting_cost if models else self.step_cost_model_free)(total_tokens)
        num_drafted = sum(1 for k in ks if k > 0)
        step_s = (step_seconds(target_s, self.draft_cost(max(ks), num_drafted), self.pipelined)
                  if models else target_s)
        # Explore steps are predicted from curves that have not measured them yet.
        self._sample = (_PendingSample(models, step_s) if self.model_free_mode and quiet
                        and not mode.startswith("explore") else None)
        hist: dict[str, int] = {}
        for k in ks:
            hist[str(k)] = hist.get(str(k), 0) + 1
        return LookaheadPlan(
            lookaheads=dict(zip(ids, ks, strict=True)),
            expected=dict(zip(ids, expected, strict=True)), models=models, mode=mode,
            num_drafted=num_drafted, decode_tokens=tokens, background_tokens=self._background,
            expected_tokens=sum(e[k] for e, k in zip(expected, ks, strict=True)),
            target_seconds=target_s, step_seconds=step_s, histogram=hist)

    def wait_bound(
        self, requests: Sequence[RequestView], ready: Sequence[int], max_wait_s: float
    ) -> float:
        """How long the step should wait for the drafters' next step.

        ``requests`` are the requests of the last :meth:`choose` whose drafts are still being
        drafted, ``ready[i]`` the tokens ``requests[i]`` has ready now (fewer than chosen).
        Drafters stream one token per request per engine step of ``t_d`` seconds
        (:class:`DraftCostModel` at one position), so waiting ``t_d`` brings each late request
        one more token, worth ``E_r(ready + 1) - E_r(ready)`` expected tokens. The batch now
        yields ``S`` tokens in ``T`` (the chosen lookaheads, late drafts cut to what is ready);
        waiting pays when ``(S + G) / (T + t_d) > S / T``: then the answer is ``t_d`` (clipped to
        ``max_wait_s``), else 0 (:meth:`LookaheadPlan.wait_bound`, on the last :attr:`plan`).
        The proposer asks again after each drafter step, so a wait stops as soon as the next
        token is not worth its time. In synchronous mode, or before the drafters' speed was
        measured, it is ``max_wait_s``.
        """
        _check_wait_args(requests, ready, max_wait_s)
        if not requests:
            return 0.0
        plan = self.plan
        t_d = self.draft_cost(1, max(1, plan.num_drafted if plan is not None else len(requests)))
        if not self.pipelined or plan is None or t_d <= 0:
            return max_wait_s
        return plan.wait_bound(requests, ready, max_wait_s, t_d)

    def snapshot(self) -> dict[str, Any]:
        glob = self.acceptance.global_acceptance()
        e, q = [1.0], 1.0
        for p in glob:
            q *= p
            e.append(e[-1] + q)
        free = self.acceptance_model_free.global_acceptance()
        free_factor = self.calibration_model_free.factor()
        last = self.plan.summary() if self.plan is not None else {}
        # The keys are a metrics format: "free" keeps meaning model-free there.
        return {
            "policy": "adaptive",
            "pipelined": self.pipelined,
            "free_mode": self.model_free_mode,
            **self.mode.snapshot(),
            "steps": self._steps,
            "step_cost_free": self.step_cost_model_free.snapshot(),
            "calibration": {"models": self.calibration.snapshot(free_factor),
                            "free": self.calibration_model_free.snapshot()},
            "acceptance_free": [round(p, 4) for p in free],
            "step_cost": self.step_cost.snapshot(),
            "draft_cost": self.draft_cost.snapshot(),
            "background_tokens": round(self._background, 3),
            "acceptance": {
                "global": [round(p, 4) for p in glob],
                "observations": [round(n, 2) for n in self.acceptance.global_trials()],
                "expected_tokens": [round(x, 4) for x in e],
                "requests_tracked": len(self.acceptance),
            },
            "last_choice": {k: (round(v, 9) if isinstance(v, float) else v)
                            for k, v in last.items()},
            **({"model_drafting": self.drafting.snapshot()} if self.drafting is not None else {}),
        }
