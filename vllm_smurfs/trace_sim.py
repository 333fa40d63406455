"""Offline trace simulator: compare lookahead policies on a recorded trace in seconds.

The trace format: `vllm_smurfs.trace`.

Reconstruction (:func:`reconstruct`). With greedy decoding the text, hence the drafter's
agreement with the target at every position, does not depend on the policy. A step at position
``p`` with ``k`` drafted and ``a`` accepted says the drafter agrees at ``p .. p+a-1`` and, when
``a < k``, disagrees at ``p+a``; so a draft starting at ``p + j`` (``j <= a``) has ``a - j``
tokens accepted, which is exactly the run of agreements from there. When ``a == k`` the
agreement at ``p + k`` (the bonus position) is unknown and the run is censored (``>= k - j``).
Unknown positions take the nearest known agreement (ties: the later one, the first position of
the next draft, which unlike the earlier one was not selected for having been accepted); this
approximation is what lets a trace recorded at lookahead K replay drafts longer than K. The
number of accepted tokens of a draft of ``k`` at ``x`` is then ``min(k, acc[x])`` with ``acc[x]``
the run of agreements starting at ``x``. Record traces with a long lookahead (the censoring is
rarer) and greedy sampling (with sampling, ``conflicts`` counts contradicting observations).
A pipelined replay also uses the agreement at positions no draft covered (the bonus position of
a fully accepted draft, and the position of the token a step without a draft produces after a
rejection, which decides whether the restarted path is stale again): these are imputed too.

Replay (:func:`simulate`, :func:`replay`). Requests enter in trace order when one of
``concurrency`` slots is free and run to their recorded output length; prefill is not modelled
(a request's first step is a decode step). A step's target time comes from a cost curve fitted
on the trace's ``(num_tokens, seconds)`` pairs (:class:`StepCostCurve`, extrapolated linearly
outside the recorded token counts: record at several loads to compare several loads), the
drafter's from a :class:`~vllm_smurfs.length_controller.DraftCostModel` fitted on its draft
records. The policy sees only what it would see live: feedback from the simulated acceptance,
timings from the simulated costs (one ``DraftTiming(num_reqs, 1, t_d)`` per drafter engine step).

Drafters stream: one engine step of ``t_d = draft_cost(1, R)`` seconds (``R`` the requests drafted
for in the step, those with ``k > 0``) extends every one of their paths by one token.

* Synchronous (``pipelined=False``): the step drafts its ``max k`` tokens first, ``max k * t_d``
  seconds added to the step; every draft is complete.
* Pipelined: the drafters went on while the target verified. Each request keeps its *path*:
  the tokens drafted past its text. During the previous target step (``prev_target`` seconds)
  the path of every drafted request grew by ``floor(prev_target / t_d)`` tokens, on top of what
  was left of it. A path survives a step when the drafter's token after the accepted prefix is
  the one the target produced there (the bonus token); what is left is the path minus the
  accepted tokens and that one. A new request's path starts with the first token it drafts
  only standing in for the last one the target produced (it is not checked): at its first step
  it has ``max(0, floor(prev_target / t_d) - 1)`` tokens. A request whose draft token was
  rejected at step ``n``, or whose drafter's token at the bonus position is not the target's,
  has a *stale* path: it no longer extends the text. As with the live proposer, which learns
  of it only when step ``n`` ends, step ``n + 1`` has no draft for it (its ``k`` is chosen,
  then cut to 0 and counted as cut; it is not waited for), and the drafter restarts from the
  text at the start of step ``n + 1`` while the target runs that step, which produces one
  token for the request. The restart
  costs one drafter engine step (the re-prefill of the last partial KV block), so at step
  ``n + 2`` the drafter has ``G = floor(target step n + 1 / t_d) - 1`` tokens past the restart
  point, the first of them standing in for the token of step ``n + 1``: when the drafter agrees
  with the target there (the reconstructed agreement), ``max(0, G - 1)`` are ready; when not,
  the path is stale again and step ``n + 2`` restarts it the same way. A stale request not
  drafted for (``k = 0``) is not restarted, and a path still short of the text at the end of a
  step (negative) is not set back further. Ready tokens are capped at the chosen ``k``. While
  some drafted requests with a path that is not stale have fewer than ``k`` ready, the replay
  asks ``policy.wait_bound(late requests, their ready counts, what is left of max_wait_s)``; a
  positive answer adds that wait to the step, every drafter step completed by then
  (``floor(total wait / t_d)``) adds a token to every such path, and it asks again, until the
  answer is 0, the drafts are complete (a wait never runs past that moment) or ``max_wait_s``
  is spent. The verified draft is what is ready, ``min(k, ready)``. (Approximations kept: the
  growth during the previous target step is priced at the drafter batch of the current step,
  the requests with ``k > 0`` now, and only their paths grow.)

Without a draft cost (or at ``t_d = 0``) drafting is free and every draft complete.

CLI: ``python -m vllm_smurfs.trace_sim TRACE.jsonl ...`` runs `trace_report`'s (tables of
policies compared, ``--summary`` of a recorded run); the runtime never imports either module.

Pure module (stdlib + numpy, no vllm/torch).
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_smurfs.length_controller import (
    AdaptiveLookahead,
    DraftCostModel,
    DraftTiming,
    FixedLookahead,
    LookaheadPolicy,
    RequestView,
    StepFeedback,
    StepTiming,
    room_for_drafts,
)
from vllm_smurfs.step_costs import isotonic_regression
from vllm_smurfs.trace import TraceFormatError, TraceRequest, TraceStep, read_trace, write_trace
from vllm_smurfs.trace_reconstruct import ReplayRequest, acc_from_agreement, reconstruct

__all__ = [
    "MAX_DRAFT_RECORDS",
    "NoSpeculation",
    "ReplayRequest",
    "SimResult",
    "StepCostCurve",
    "TraceFormatError",
    "TraceRequest",
    "TraceStep",
    "acc_from_agreement",
    "default_policies",
    "fit_draft_cost",
    "fit_model_free_cost",
    "has_model_free_steps",
    "read_trace",
    "reconstruct",
    "replay",
    "simulate",
    "synthetic_trace",
    "write_trace",
]

PolicyFactory = Callable[[], LookaheadPolicy]

#: Drafter engine steps recorded (and shown to the policy) per replayed step, at most: all of them
#: cost the same, and the draft cost model keeps 64 calls anyway.
MAX_DRAFT_RECORDS = 64
# Questions to wait_bound per step, at most: a policy answering ever smaller waits cannot hang it.
_MAX_WAIT_QUESTIONS = 1000
# floor(seconds / t_d) with a margin for the rounding of sums of t_d.
_STEP_EPS = 1e-9


# ---------------------------------------------------------------------------------------- costs


class StepCostCurve:
    """Target step seconds vs token count, fitted on all of a trace's steps (the replay's truth).

    The median seconds at each distinct token count, made non-decreasing by weighted isotonic
    regression and interpolated linearly; beyond the recorded range it is extended by a least
    squares line over the outer quarter of the points (at least 2), slope floored at 0, and never
    below 0 or the proportional ``T(lo) * N / lo`` under the range.
    """

    def __init__(self, num_tokens: Sequence[int], seconds: Sequence[float]) -> None:
        """Raises ValueError when there is no step with num_tokens >= 1."""
        n = np.asarray(num_tokens, dtype=float)
        s = np.asarray(seconds, dtype=float)
        keep = n >= 1
        n, s = n[keep], s[keep]
        if len(n) == 0:
            raise ValueError("the trace has no step with num_tokens >= 1 to fit a cost curve on")
        xs = np.unique(n)
        med = np.array([np.median(s[n == x]) for x in xs])
        w = np.array([np.sum(n == x) for x in xs], dtype=float)
        self.xs = xs
        self.ys = np.array(isotonic_regression(med.tolist(), w.tolist()))
        self.lo, self.hi = float(xs[0]), float(xs[-1])
        m = max(2, len(xs) // 4)
        self._slope_lo = self._slope(xs[:m], self.ys[:m])
        self._slope_hi = self._slope(xs[-m:], self.ys[-m:])

    @staticmethod
    def _slope(x: np.ndarray, y: np.ndarray) -> float:
        if len(x) < 2:
            return 0.0
        return max(0.0, float(np.polyfit(x, y, 1)[0]))

    def covers(self, num_tokens: float) -> bool:
        return self.lo <= num_tokens <= self.hi

    def __call__(self, num_tokens: float) -> float:
        if num_tokens > self.hi:
            return float(self.ys[-1] + self._slope_hi * (num_tokens - self.hi))
        if num_tokens < self.lo:
            y0 = float(self.ys[0])
            return max(y0 - self._slope_lo * (self.lo - num_tokens),
                       y0 * max(num_tokens, 0.0) / self.lo, 0.0)
        return float(np.interp(num_tokens, self.xs, self.ys))

    @classmethod
    def from_trace(cls, trace: Sequence[TraceStep]) -> StepCostCurve:
        return cls([s.num_tokens for s in trace], [s.seconds for s in trace])


def fit_draft_cost(trace: Sequence[TraceStep]) -> DraftCostModel | None:
    """A draft cost model fitted on all draft records of the trace; None when there are none."""
    model = DraftCostModel(window=None)
    for s in trace:
        for d in s.drafts:
            model.observe(d.num_positions, d.num_reqs, d.seconds)
    return model if model.num_observations else None


# --------------------------------------------------------------------------------------- replay


class NoSpeculation:
    """Never drafts (the k=0 baseline); implements :class:`LookaheadPolicy`."""

    def observe(self, feedback: Sequence[StepFeedback], models_ready: bool = True) -> None:
        return None

    def observe_step(self, timing: StepTiming) -> None:
        return None

    def observe_draft(self, timing: DraftTiming) -> None:
        return None

    def choose(self, requests: Sequence[RequestView], max_lookahead: int,
               free_lens: Sequence[int] | None = None) -> list[int]:
        return [0] * len(requests)

    @property
    def models_on(self) -> bool:
        return False  # nothing is drafted, by model drafters or otherwise

    def wait_bound(self, requests: Sequence[RequestView], ready: Sequence[int],
                   max_wait_s: float) -> float:
        return 0.0

    def forget(self, req_ids: Iterable[str]) -> None:
        return None

    def snapshot(self) -> dict[str, Any]:
        return {"policy": "none"}


@dataclass
class SimResult:
    """Outcome of one replay."""

    concurrency: int
    pipelined: bool
    total_tokens: int
    total_seconds: float
    num_steps: int
    request_steps: int  # sum over steps of the requests in the step
    drafted_tokens: int  # draft tokens verified
    accepted_tokens: int
    waited_seconds: float  # steps' waits for drafts (synchronous: all the drafting)
    dropped_drafts: int  # pipelined steps that went on with some drafts cut to what was ready
    # Draft tokens chosen but not ready when the step went on (all of a stale path's k).
    cut_tokens: int = 0
    steps: list[TraceStep] = field(repr=False, default_factory=list)  # the replay, as a trace
    final_snapshot: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.total_tokens / self.total_seconds if self.total_seconds > 0 else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per request per step, bonus token included (1.0 without speculation)."""
        return self.total_tokens / self.request_steps if self.request_steps else 0.0

    @property
    def mean_lookahead(self) -> float:
        return self.drafted_tokens / self.request_steps if self.request_steps else 0.0

    def choices(self) -> list[dict[str, int]]:
        """Per step, ``req_id -> k`` verified."""
        return [{r.req_id: r.k for r in s.requests} for s in self.steps]


@dataclass
class _Slot:
    """A running request in a replay."""

    req: ReplayRequest
    pos: int = 0
    # Tokens the drafter has past the request's text; negative: what it still owes before its
    # path reaches the text: -1 the token that only stands in for the last one the target
    # produced (a new path), -2 that and the engine step of a restart (a restarted path).
    path: int = -1
    # The path no longer extends the text (a draft token rejected, or the drafter's token after
    # the accepted ones not the target's): no draft until the drafter restarts.
    stale: bool = False


def _engine_steps(seconds: float, t_d: float) -> int:
    return math.floor(seconds / t_d + _STEP_EPS)


def _advance_path(slot: _Slot, path: int, a: int, run: int, drafted: bool,
                  restarted: bool) -> None:
    """The request's path after a pipelined step that accepted ``a`` of its draft tokens.

    ``path``: the path during the step (after its growth); ``run``: the agreements from the
    step's position; ``restarted``: the path was stale and the drafter restarted from the text
    of the step's start (``a == 0``).
    """
    if slot.stale and not drafted:
        return  # not drafted for: the drafter is not told the text, the path stays stale
    # The drafter's token at pos + a (drafted, or still to come from a path short of the text)
    # is the one the target produced there: the path still extends the text.
    slot.stale = run == a
    if restarted:
        slot.path = -2  # a restart's engine step, then the token standing in for this step's
    elif path >= 0:
        slot.path = path - a - 1  # the accepted tokens and the bonus token are text now
    # else: a path still short of the text stays as it is (the drafter keeps pace with the
    # target's one token).


def replay(
    requests: Sequence[ReplayRequest],
    policy_factory: PolicyFactory,
    concurrency: int,
    pipelined: bool,
    step_cost: Callable[[int], float],
    draft_cost: Callable[[int, int], float] | None = None,
    max_lookahead: int = 8,
    max_wait_s: float = math.inf,
    noise: float = 0.0,
    seed: int = 0,
    step_cost_model_free: Callable[[int], float] | None = None,
) -> SimResult:
    """Replay ``requests`` under a fresh policy; see the module docstring.

    ``step_cost(num_tokens)`` and ``draft_cost(num_positions, num_reqs)`` give seconds (only
    ``draft_cost(1, R)``, one drafter engine step, is used); ``max_wait_s`` bounds a pipelined
    step's wait for its drafts; ``noise`` is the sigma of a log-normal factor on every target
    step (seeded by ``seed``).

    Requests with model-free data (``free_len``, from steps recorded without model drafting)
    make the replay offer the policy their ``free_lens`` every step; a step it then plans
    without the model drafters (``policy.models_on`` False) verifies the voters' drafts, costs
    no drafter time, is priced on ``step_cost_model_free`` (default: ``step_cost``) and lets the
    drafters' paths go: they restart when the model drafters are back.

    Raises:
        ValueError: on a bad setting, or when the policy returns a lookahead out of bounds.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if max_lookahead < 0:
        raise ValueError(f"max_lookahead must be >= 0, got {max_lookahead}")
    if not noise >= 0:
        raise ValueError(f"noise must be >= 0, got {noise!r}")
    if not max_wait_s >= 0:
        raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s!r}")
    rng = np.random.default_rng(seed)
    policy = policy_factory()
    pending = deque(r for r in requests if r.length > 0)
    active: list[_Slot] = []
    res = SimResult(concurrency, pipelined, 0, 0.0, 0, 0, 0, 0, 0.0, 0)
    prev_target = 0.0
    # Model-free drafting is replayed only where the trace recorded it.
    model_free = any(r.free_len is not None for r in requests)
    models_before = True
    while pending or active:
        while len(active) < concurrency and pending:
            active.append(_Slot(pending.popleft()))
        views = [RequestView(s.req.req_id, s.pos, s.req.length) for s in active]
        if model_free:
            free_lens = [0 if s.req.free_len is None else int(s.req.free_len[s.pos])
                         for s in active]
            ks = [int(k) for k in policy.choose(views, max_lookahead, free_lens)]
            # As the proposer: the model drafters draft when the plan has them and drafts.
            models = bool(policy.models_on) and any(ks)
            if models and not models_before:
                for slot in active:  # the drafters were paused: each path restarts
                    slot.path, slot.stale = -2, False
            models_before = models
        else:
            ks = [int(k) for k in policy.choose(views, max_lookahead)]
            models = True
        if len(ks) != len(views):
            raise ValueError(f"policy returned {len(ks)} lookaheads for {len(views)} requests")
        for v, k in zip(views, ks, strict=True):
            if not 0 <= k <= min(max_lookahead, room_for_drafts(v)):
                raise ValueError(f"policy chose k={k} for {v} with max_lookahead={max_lookahead}")
        drafted = [i for i, k in enumerate(ks) if k > 0]
        t_d = (float(draft_cost(1, len(drafted)))
               if models and drafted and draft_cost is not None else 0.0)
        paths = [s.path for s in active]  # uncapped, during this step
        ready = list(ks)
        wait = 0.0
        engine_steps = 0
        # Drafted requests whose path is stale: no draft now, the drafter restarts from the text
        # while the target verifies the others (pipelined, drafting not free).
        restarting: set[int] = set()
        if t_d > 0 and not pipelined:
            engine_steps = max(ks)
            wait = engine_steps * t_d
        elif t_d > 0:
            restarting = {i for i in drafted if active[i].stale}
            growing = [i for i in drafted if i not in restarting]
            grown = _engine_steps(prev_target, t_d)
            for i in growing:
                paths[i] += grown
            ready = [0 if i in restarting else min(k, max(0, p))
                     for i, (k, p) in enumerate(zip(ks, paths, strict=True))]
            waited_steps = 0
            for _ in range(_MAX_WAIT_QUESTIONS):
                late = [i for i in growing if ready[i] < ks[i]]
                left = max_wait_s - wait
                if not late or left <= 0:
                    break
                w = float(policy.wait_bound([views[i] for i in late], [ready[i] for i in late],
                                            left))
                if not w > 0:  # 0, or NaN
                    break
                # Never past the moment the last late draft is complete.
                done_at = (waited_steps + max(ks[i] - paths[i] for i in late)) * t_d
                wait += min(w, left, done_at - wait)
                now = _engine_steps(wait, t_d)
                for i in growing:
                    paths[i] += now - waited_steps
                    ready[i] = min(ks[i], max(0, paths[i]))
                waited_steps = now
            engine_steps = grown + waited_steps
            cut = sum(ks[i] - ready[i] for i in drafted)
            if cut:
                res.dropped_drafts += 1
                res.cut_tokens += cut
        drafts: tuple[DraftTiming, ...] = ()
        if engine_steps:
            drafts = (DraftTiming(len(drafted), 1, t_d),) * min(engine_steps, MAX_DRAFT_RECORDS)
        num_tokens = sum(1 + v for v in ready)
        cost = step_cost if models or step_cost_model_free is None else step_cost_model_free
        target = float(cost(num_tokens))
        if noise:
            target *= float(np.exp(noise * rng.standard_normal()))
        res.total_seconds += target + wait
        res.waited_seconds += wait
        feedback, step_reqs, finished = [], [], []
        for i, (slot, v, path) in enumerate(zip(active, ready, paths, strict=True)):
            r, pos = slot.req, slot.pos
            run = int(r.acc[pos] if models or r.free_acc is None else r.free_acc[pos])
            a = min(v, run)
            step_reqs.append(TraceRequest(r.req_id, pos, v, a))
            if v:
                feedback.append(StepFeedback(r.req_id, v, a))
            res.total_tokens += a + 1
            res.drafted_tokens += v
            res.accepted_tokens += a
            if pipelined and models:
                _advance_path(slot, path, a, run, ks[i] > 0, i in restarting)
            slot.pos = pos + a + 1
            if slot.pos >= r.length:
                finished.append(r.req_id)
        res.steps.append(TraceStep(res.num_steps, res.total_seconds, target, num_tokens,
                                   tuple(step_reqs), drafts, models if model_free else None))
        res.num_steps += 1
        res.request_steps += len(active)
        policy.observe_step(StepTiming(len(active), num_tokens, target, drafting=models))
        for d in drafts:
            policy.observe_draft(d)
        policy.observe(feedback)
        if finished:
            policy.forget(finished)
            done = set(finished)
            active = [slot for slot in active if slot.req.req_id not in done]
        prev_target = target
    res.final_snapshot = policy.snapshot()
    return res


def simulate(
    trace: Sequence[TraceStep],
    policy_factory: PolicyFactory,
    concurrency: int,
    pipelined: bool = True,
    max_lookahead: int = 8,
    max_wait_s: float = math.inf,
) -> SimResult:
    """Reconstruct ``trace`` and replay it under ``policy_factory`` (costs fitted on the trace;
    steps recorded without model drafting, if any, get a curve of their own)."""
    return replay(reconstruct(trace), policy_factory, concurrency, pipelined,
                  StepCostCurve.from_trace(trace), fit_draft_cost(trace), max_lookahead,
                  max_wait_s, step_cost_model_free=fit_model_free_cost(trace))


def fit_model_free_cost(trace: Sequence[TraceStep]) -> StepCostCurve | None:
    """The cost curve of the steps recorded without model drafting; None without any."""
    steps = [s for s in trace if s.drafting is False and s.num_tokens >= 1]
    return StepCostCurve.from_trace(steps) if steps else None


def has_model_free_steps(trace: Sequence[TraceStep]) -> bool:
    """Whether the trace recorded steps without model drafting (the policy can be replayed
    choosing between the two modes)."""
    return any(s.drafting is False for s in trace)


def default_policies(max_lookahead: int, pipelined: bool = True,
                     model_free_mode: bool = False) -> dict[str, PolicyFactory]:
    """adaptive, k=0 (no speculation) and fixed k=1..max_lookahead; ``model_free_mode``: the
    adaptive policy may leave the model drafters out (as served with ``pause_drafters``)."""
    pols: dict[str, PolicyFactory] = {
        "adaptive": lambda: AdaptiveLookahead(max_lookahead, pipelined=pipelined,
                                              model_free_mode=model_free_mode),
        "k=0": NoSpeculation,
    }
    for k in range(1, max_lookahead + 1):
        pols[f"k={k}"] = lambda k=k: FixedLookahead(k)
    return pols


# ------------------------------------------------------------------------------------ synthetic


def synthetic_trace(
    agreement: Mapping[str, Sequence[int]],
    record_k: int,
    concurrency: int,
    step_cost: Callable[[int], float],
    draft_cost: Callable[[int, int], float] | None = None,
    calibration_tokens: Iterable[int] = (),
    pipelined: bool = True,
) -> list[TraceStep]:
    """A trace as the proposer would record it at fixed lookahead ``record_k``.

    ``agreement[req_id]`` is the ground truth (1: the drafter agrees with the target at that
    output position). ``calibration_tokens`` appends request-less steps of those token counts
    (e.g. prefill steps), so the cost curve is sampled beyond the recorded load.
    """
    reqs = [ReplayRequest.from_agreement(rid, bits) for rid, bits in agreement.items()]
    factory: PolicyFactory = NoSpeculation if record_k == 0 else (lambda: FixedLookahead(record_k))
    steps = replay(reqs, factory, concurrency, pipelined, step_cost, draft_cost,
                   max_lookahead=record_k).steps
    t = steps[-1].t if steps else 0.0
    for n in calibration_tokens:
        s = float(step_cost(n))
        t += s
        steps.append(TraceStep(len(steps), t, s, int(n)))
    return steps


if __name__ == "__main__":
    # The CLI lives in `trace_report` (imported here only: the simulator does not need it).
    from vllm_smurfs.trace_report import main

    sys.exit(main())
