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

With model drafters that can be left out (``free_mode``), the two plans' predicted step times are
also checked against the time their steps took (:class:`StepTimeCalibration`, one per plan).

The parts live in modules of their own: the interface in `lookahead_types`, acceptance in
`acceptance`, the cost models in `step_costs`; this module keeps the two policies and re-exports
the rest, as the entry point to the idea.

Pure (stdlib only, no vllm/torch): :meth:`AdaptiveLookahead.choose` runs every step for up to a
few hundred requests, so it is written to cost O(n * max_lookahead * log) plain-Python work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from vllm_smurfs.acceptance import (
    _DEFAULT_GLOBAL_MEMORY,
    _DEFAULT_PRIOR_STRENGTH,
    _DEFAULT_REQUEST_HALF_LIFE_STEPS,
    AcceptanceModel,
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
    "FixedLookahead",
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
# A longer draft must improve the predicted rate by this relative margin to be taken: it breaks
# numerical ties (free verification, zero expected gain) towards fewer tokens.
_MIN_RELATIVE_GAIN = 1e-9
# With ``free_mode``: switching from model-free drafting to model drafting must promise this much
# more (relative rate). A switch restarts the drafters (a prefill per request) and the first
# steps after it find few drafts ready, which the estimates of the mode learnt earlier omit.
_SWITCH_MARGIN = 0.05
# Steps a mode is kept after a switch: each switch costs a restart, and a mode's estimates need a
# few steps to reflect the present.
_MIN_DWELL_STEPS = 8
# Without model drafters, their estimates stop learning: now and then the controller retries them,
# each request drafting at least one token, so a change (a lighter load, more predictable text)
# is noticed. A retry starts only in a quiet step (no prompt chunk in the last steps: lending a
# core slows a prefill-heavy step most, and a chunk spoils the measurement) and ends as soon as
# one arrives. It lasts until the model drafters have caught up (re-prefilled the requests they
# dropped when paused; `observe`'s ``models_ready``) and then one dwell, at most
# ``_RETRY_MAX_STEPS``: a retry that ends before the drafters deliver would learn only the
# catch-up. A retry's price is measured: the time its steps took beyond what the step-cost curve
# without model drafting predicts for their token counts (the lent cores, the catch-up). The next
# retry waits ``_RETRY_INTERVAL_STEPS`` after the last switch, doubled after every retry that
# ended with the models left out again (at most ``_RETRY_MAX_BACKOFF`` doublings: 16384 steps),
# back to 256 once they are kept; and until the last retry's price is at most 1% of the time
# since it began. Where the models never pay (a 2-core CPU) retries thus cost well under 1%.
_RETRY_INTERVAL_STEPS = 256
_RETRY_MAX_BACKOFF = 6
_RETRY_MAX_STEPS = 64
_RETRY_BUDGET = 0.01
# Background (prompt) tokens below which a step counts as quiet for a retry: the smoothed
# background of a step after a chunk is half the chunk, so one prompt token keeps it busy for
# about one step, a 256-token chunk for about nine.
_QUIET_BACKGROUND = 0.5


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
        free_mode: bool = False,
    ) -> None:
        """See the module constants for the defaults' justification.

        ``free_mode``: also consider, every step, leaving the model drafters out (drafts from
        the model-free voters only, see ``choose``'s ``free_lens``), with its own step-cost
        curve (`StepTiming.drafting` False: e.g. the target then has the cores it lends to
        drafters) and its own acceptance model; the better of the two plans is taken, with a
        margin and a minimum dwell against flapping. Each plan's predicted rate is corrected by
        how long its steps took, the proposer's own time included, against their predicted
        time (:class:`StepTimeCalibration`; sampled in steps without prompt chunks, and for
        the model plan only once the drafters have caught up after a switch).

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
        self.max_lookahead = max_lookahead
        self.min_lookahead = min_lookahead
        self.pipelined = pipelined
        self.probe_interval = probe_interval
        self.acceptance = AcceptanceModel(
            max_lookahead, request_half_life_steps, prior_strength, global_memory)
        self.step_cost = StepCostModel(cost_window)
        self.draft_cost = DraftCostModel(draft_window)
        self.free_mode = free_mode
        self.acceptance_free = AcceptanceModel(
            max_lookahead, request_half_life_steps, prior_strength, global_memory)
        self.step_cost_free = StepCostModel(cost_window)
        self.calibration = StepTimeCalibration()
        self.calibration_free = StepTimeCalibration()
        self._sample: _PendingSample | None = None
        self._models_on = True
        self._switched_at = -_MIN_DWELL_STEPS
        self._retry_start: int | None = None  # step the retry going on began at (None: none)
        self._retry_ready_steps = 0  # its steps whose feedback came from caught-up drafters
        self._retry_backoff = 0  # doublings of the retry interval (failed retries in a row)
        self._judge_retry = False  # the next greedy choice tells whether the last retry paid
        self.retries = 0
        self._elapsed_s = 0.0  # target step seconds observed so far
        self._retry_started_s = 0.0  # _elapsed_s when the last retry began
        self._retry_cost_s = 0.0  # its measured price (see _RETRY_BUDGET)
        self._planned_retry = False  # whether the last choice was part of a retry
        self.switches = 0  # model drafting switched on or off by the greedy choice
        self._steps = 0  # choose() calls with at least one request
        self._explored_low = False
        self._background = 0.0
        self._planned_tokens: int | None = None  # decode tokens of the last choice
        self._last_drafted: dict[str, int] = {}
        self._expected: dict[str, list[float]] = {}  # req_id -> E(0..cap) at the last choice
        self._chosen: dict[str, int] = {}  # req_id -> lookahead at the last choice
        self._last: dict[str, Any] = {}

    # -- learning ---------------------------------------------------------------------------
    @property
    def models_on(self) -> bool:
        return self._models_on

    def observe(self, feedback: Sequence[StepFeedback], models_ready: bool = True) -> None:
        """The last choice's outcome (after its :meth:`observe_step`, as the proposer calls)."""
        # The feedback is about the drafts of the last choice, made in its mode.
        (self.acceptance if self._models_on else self.acceptance_free).observe(feedback)
        if (self._retry_start is not None and self._models_on and models_ready
                and any(fb.num_draft_tokens for fb in feedback)):
            self._retry_ready_steps += 1
        sample, self._sample = self._sample, None
        if sample is not None and sample.taken_s is not None and (models_ready
                                                                   or not sample.models):
            (self.calibration if sample.models else self.calibration_free).observe(
                sample.predicted_s, sample.taken_s)

    def observe_step(self, timing: StepTiming) -> None:
        self._elapsed_s += timing.seconds
        if self._planned_retry and timing.drafting and not self.step_cost_free.is_empty:
            self._retry_cost_s += max(0.0, timing.seconds - self.step_cost_free(timing.num_tokens))
        cost = self.step_cost if timing.drafting or not self.free_mode else self.step_cost_free
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
        self.acceptance_free.forget(req_ids)
        for req_id in req_ids:
            self._last_drafted.pop(req_id, None)
            self._expected.pop(req_id, None)

    # -- deciding ---------------------------------------------------------------------------
    def _drafting_cost(self, num_tokens: float) -> float:
        """Predicted seconds of a target step with model drafting: its own curve, never below
        the curve without (drafters take cores from the target or share them, never add any;
        this also prices token counts the drafting curve has not measured, e.g. prefill-heavy
        steps, at least at what they cost without drafting)."""
        t = self.step_cost(num_tokens)
        if self.free_mode and not self.step_cost_free.is_empty:
            t = max(t, self.step_cost_free(num_tokens))
        return t

    def _retry_due(self) -> bool:
        return (self._steps - self._switched_at >= _RETRY_INTERVAL_STEPS << self._retry_backoff
                and self._background < _QUIET_BACKGROUND
                and self._retry_cost_s <= _RETRY_BUDGET
                * (self._elapsed_s - self._retry_started_s))

    def _retrying(self) -> bool:
        """Whether the retry going on (if any) goes on this step; ends it when it is over: the
        drafters delivered for a dwell, or never within ``_RETRY_MAX_STEPS``, or a prompt
        chunk came. The step that ends it is decided afresh (no dwell)."""
        if self._retry_start is None:
            return False
        if (self._retry_ready_steps < _MIN_DWELL_STEPS
                and self._steps - self._retry_start < _RETRY_MAX_STEPS
                and self._background < _QUIET_BACKGROUND):
            return True
        self._retry_start = None
        self._switched_at = self._steps - _MIN_DWELL_STEPS
        self._judge_retry = True
        return False

    def _step_seconds(self, target_s: float, max_k: int, num_drafted: int) -> float:
        draft_s = self.draft_cost(max_k, num_drafted)
        return target_s + (max(0.0, draft_s - target_s) if self.pipelined else draft_s)

    def choose(self, requests: Sequence[RequestView], max_lookahead: int,
               free_lens: Sequence[int] | None = None) -> list[int]:
        """One lookahead per request in ``[min(min_lookahead, cap), cap]``, where ``cap =
        min(self.max_lookahead, max_lookahead, room_for_drafts(r))``; with ``free_mode`` and
        the model drafters left out (`models_on` False), ``cap`` is also at most
        ``free_lens[i]`` (0 where it is not given).

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
        lows = [min(self.min_lookahead, c) for c in caps]
        cum = self._cumulative(self.acceptance, ids, caps)
        models = True
        if self.free_mode:
            self.acceptance_free.tick(ids)
            free_caps = [min(c, max(0, int(f))) for c, f in
                         zip(caps, free_lens if free_lens is not None else [0] * n, strict=True)]
            free_lows = [min(self.min_lookahead, c) for c in free_caps]

        if self.step_cost.is_empty:
            ks, mode = list(caps), "explore-max"
        elif not self._explored_low and len(self.step_cost.knots()) < 2 and lows != caps:
            ks, mode = list(lows), "explore-min"
            self._explored_low = True
        elif self.free_mode and self.step_cost_free.is_empty:
            # One step without model drafting, to measure what it costs.
            models, ks, mode = False, list(free_caps), "explore-free"
            caps, cum = free_caps, self._cumulative(self.acceptance_free, ids, free_caps)
        elif self.free_mode and not self._models_on and self._retry_due():
            ks, mode = [min(max(1, lo), c) for lo, c in zip(lows, caps, strict=True)], "retry"
            self._switched_at, self._retry_start, self._retry_ready_steps = self._steps, \
                self._steps, 0
            self._retry_started_s, self._retry_cost_s = self._elapsed_s, 0.0
            self.switches += 1
            self.retries += 1
        else:
            retrying = self.free_mode and self._retrying()
            if retrying:  # a retry drafts, or it learns nothing
                lows = [min(max(1, lo), c) for lo, c in zip(lows, caps, strict=True)]
            ks, rate = self._greedy(cum, caps, lows, self._drafting_cost, drafting=True)
            mode = "retry" if retrying else "greedy"
            if self.free_mode:
                cum_free = self._cumulative(self.acceptance_free, ids, free_caps)
                ks_free, rate_free = self._greedy(cum_free, free_caps, free_lows,
                                                  self.step_cost_free, drafting=False)
                models = retrying or self._decide(rate, rate_free)
                if self._judge_retry and not retrying:
                    # Left out again right after a retry: it did not pay, wait longer.
                    self._retry_backoff = (min(self._retry_backoff + 1, _RETRY_MAX_BACKOFF)
                                           if not models else 0)
                    self._judge_retry = False
                if not models:
                    ks, mode, caps, cum = ks_free, "greedy-free", free_caps, cum_free
        self._planned_retry = models and self._retry_start is not None
        if models != self._models_on:
            if mode.startswith("greedy"):
                self._switched_at = self._steps
                self.switches += 1
            self._models_on = models

        expected = []
        for qs in cum:
            e = [1.0]
            for q in qs:
                e.append(e[-1] + q)
            expected.append(e)
        self._expected = dict(zip(ids, expected, strict=True))

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

        self._chosen = dict(zip(ids, ks, strict=True))
        tokens = sum(1 + k for k in ks)
        self._planned_tokens = tokens
        quiet = self._background < _QUIET_BACKGROUND
        total_tokens = self._background + tokens
        target_s = (self._drafting_cost if models else self.step_cost_free)(total_tokens)
        num_drafted = sum(1 for k in ks if k > 0)
        max_k = max(ks)
        exp_tokens = sum(e[k] for e, k in zip(expected, ks, strict=True))
        step_s = self._step_seconds(target_s, max_k, num_drafted) if models else target_s
        # Explore steps are predicted from curves that have not measured them yet.
        self._sample = (_PendingSample(models, step_s)
                        if self.free_mode and quiet and not mode.startswith("explore") else None)
        hist: dict[str, int] = {}
        for k in ks:
            hist[str(k)] = hist.get(str(k), 0) + 1
        self._last = {
            "mode": mode, "models_on": models, "num_reqs": n, "num_drafted": num_drafted,
            "decode_tokens": tokens, "total_tokens": total_tokens,
            "background_tokens": self._background,
            "expected_tokens": exp_tokens, "target_seconds": target_s, "step_seconds": step_s,
            "mean_lookahead": sum(ks) / n, "histogram": hist,
        }
        return ks

    @staticmethod
    def _cumulative(model: AcceptanceModel, ids: list[str], caps: list[int]) -> list[list[float]]:
        """Per request, ``q[j] = prod_{i<=j} p_i`` for ``j = 1..cap``."""
        cum: list[list[float]] = []
        for req_id, cap in zip(ids, caps, strict=True):
            qs, q = [], 1.0
            for p in model.request_acceptance(req_id)[:cap]:
                q *= p
                qs.append(q)
            cum.append(qs)
        return cum

    def _decide(self, rate_models: float, rate_free: float) -> bool:
        """Whether to draft with the model drafters, given both plans' predicted rates (each
        corrected by its calibration)."""
        if self._steps - self._switched_at < _MIN_DWELL_STEPS:
            return self._models_on
        rate_models *= self._calibration_models()
        rate_free *= self.calibration_free.factor()
        if self._models_on:
            return rate_models >= rate_free
        return rate_models > rate_free * (1.0 + _SWITCH_MARGIN)

    def _calibration_models(self) -> float:
        """The model plan's time factor, shrunk towards the other plan's: until the model plan
        is measured, it is taken to pay the overhead both plans pay (the proposer's own
        time), not to have none."""
        return self.calibration.factor(self.calibration_free.factor())

    def _greedy(self, cum: list[list[float]], caps: list[int], lows: list[int],
                target: Callable[[float], float], drafting: bool) -> tuple[list[int], float]:
        """The allocation with the best predicted rate along the greedy path, and that rate;
        ``drafting``: the model drafters' time counts (see the class docstring)."""
        ks = list(lows)
        gains = [
            (qs[j - 1], r, j)
            for r, (qs, lo, cap) in enumerate(zip(cum, lows, caps, strict=True))
            for j in range(lo + 1, cap + 1)
        ]
        # Stable sort by gain only: within a request gains never increase, so equal gains keep
        # their (request, position) order and every prefix of the list is a valid allocation.
        gains.sort(key=lambda g: -g[0])
        # The rate counts the step's prefill tokens as work done, like its output tokens: where
        # the target is compute-bound (prefill-heavy steps, a full token budget) a draft token
        # costs as much as a prompt token, and only one likely to be accepted is worth it.
        exp_tokens = self._background + sum(
            1.0 + sum(qs[:lo]) for qs, lo in zip(cum, lows, strict=True))
        tokens = self._background + sum(1 + lo for lo in lows)
        num_drafted = sum(1 for lo in lows if lo > 0)
        max_k = max(lows)
        t0 = target(tokens)
        if drafting:
            t0 = self._step_seconds(t0, max_k, num_drafted)
        best_rate = exp_tokens / max(t0, 1e-300)
        best_len = 0
        levels = list(lows)
        # The loop below is _step_seconds inlined (it runs for every draft token of the batch).
        c0, c1, c2 = self.draft_cost.coefficients
        measured = drafting and self.draft_cost.num_observations > 0
        pipelined = self.pipelined
        threshold = best_rate * (1.0 + _MIN_RELATIVE_GAIN)
        for idx, (g, r, j) in enumerate(gains, 1):
            exp_tokens += g
            tokens += 1
            if levels[r] == 0:
                num_drafted += 1
            levels[r] = j
            max_k = max(max_k, j)
            t = target(tokens)
            if measured:
                d = c0 + max_k * (c1 + c2 * num_drafted)
                t += (d - t if d > t else 0.0) if pipelined else d
            rate = exp_tokens / max(t, 1e-300)
            if rate > threshold:
                best_rate, best_len = rate, idx
                threshold = best_rate * (1.0 + _MIN_RELATIVE_GAIN)
        for _, r, j in gains[:best_len]:
            ks[r] = j
        return ks, best_rate

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
        ``max_wait_s``), else 0. The proposer asks again after each drafter step, so a wait
        stops as soon as the next token is not worth its time. In synchronous mode, or before
        the drafters' speed was measured, it is ``max_wait_s``.
        """
        _check_wait_args(requests, ready, max_wait_s)
        if not requests:
            return 0.0
        t_d = self.draft_cost(1, max(1, self._last.get("num_drafted", len(requests))))
        if not self.pipelined or not self._last or t_d <= 0:
            return max_wait_s
        s = float(self._last["expected_tokens"]) + float(self._last["background_tokens"])
        gain = 0.0
        for r, m in zip(requests, ready, strict=True):
            e = self._expected.get(r.req_id)
            k = self._chosen.get(r.req_id, 0)
            if e is None or m >= k:
                continue
            s -= e[k] - e[m]  # what the late draft does not deliver now
            gain += e[m + 1] - e[m]
        t = float(self._last["step_seconds"])
        if gain <= 0 or t <= 0 or (s + gain) / (t + t_d) <= s / t:
            return 0.0
        return min(t_d, max_wait_s)

    def snapshot(self) -> dict[str, Any]:
        glob = self.acceptance.global_acceptance()
        e, q = [1.0], 1.0
        for p in glob:
            q *= p
            e.append(e[-1] + q)
        free = self.acceptance_free.global_acceptance()
        return {
            "policy": "adaptive",
            "pipelined": self.pipelined,
            "free_mode": self.free_mode,
            "models_on": self._models_on,
            "switches": self.switches,
            "retries": self.retries,
            "retry_interval_steps": _RETRY_INTERVAL_STEPS << self._retry_backoff,
            "retry_cost_s": round(self._retry_cost_s, 6),
            "steps": self._steps,
            "step_cost_free": self.step_cost_free.snapshot(),
            "calibration": {"models": self.calibration.snapshot(self.calibration_free.factor()),
                            "free": self.calibration_free.snapshot()},
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
                            for k, v in self._last.items()},
        }
