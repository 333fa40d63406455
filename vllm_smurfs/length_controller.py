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

Pure module (stdlib only, no vllm/torch): :meth:`AdaptiveLookahead.choose` runs every step for up
to a few hundred requests, so it is written to cost O(n * max_lookahead * log) plain-Python work.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

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


@dataclass(frozen=True)
class RequestView:
    """What a policy may know about a request when choosing its lookahead."""

    req_id: str
    num_tokens: int  # current context length (prompt + output)
    max_model_len: int


@dataclass(frozen=True)
class StepFeedback:
    """Outcome of the last verification step for one request."""

    req_id: str
    num_draft_tokens: int  # tokens that were proposed for it last step
    num_accepted: int  # how many of them the target accepted

    def __post_init__(self) -> None:
        # Counts that cannot happen point at a bookkeeping bug upstream (e.g. counting the bonus
        # token as accepted); fail loudly rather than let it skew acceptance statistics.
        if self.num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}")
        if not (0 <= self.num_accepted <= self.num_draft_tokens):
            raise ValueError(
                f"num_accepted must be in [0, num_draft_tokens={self.num_draft_tokens}], "
                f"got {self.num_accepted}"
            )


def _check_seconds(name: str, seconds: float) -> None:
    # `not x >= 0` also rejects NaN.
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {seconds!r}")


@dataclass(frozen=True)
class StepTiming:
    """One target step as the proposer saw it."""

    num_reqs: int  # requests in the step
    # Tokens the target computed in it: for decodes 1 + len(draft) each, plus prefill chunks.
    num_tokens: int
    # Wall time of the target's step (forward, sampling, scheduling), not the proposer's own time.
    seconds: float
    # Whether model drafters drafted during it (the target may have lent them cores): such steps
    # and steps without model drafting have their own cost curves.
    drafting: bool = True
    # The proposer's own time for this step's drafts, spent before it (drafting with the
    # model-free voters, waiting for the model drafters, voting): part of what the step's
    # tokens cost, though not of the target's cost curve.
    overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if self.num_reqs < 0:
            raise ValueError(f"num_reqs must be >= 0, got {self.num_reqs}")
        if self.num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {self.num_tokens}")
        _check_seconds("seconds", self.seconds)
        _check_seconds("overhead_s", self.overhead_s)


@dataclass(frozen=True)
class DraftTiming:
    """One model-drafter engine call."""

    num_reqs: int  # requests drafted for in the call (batched)
    num_positions: int  # tokens drafted per request (the longest)
    seconds: float

    def __post_init__(self) -> None:
        if self.num_reqs < 0:
            raise ValueError(f"num_reqs must be >= 0, got {self.num_reqs}")
        if self.num_positions < 0:
            raise ValueError(f"num_positions must be >= 0, got {self.num_positions}")
        _check_seconds("seconds", self.seconds)


@runtime_checkable
class LookaheadPolicy(Protocol):
    """Chooses how many tokens to draft per request, learning from verification feedback."""

    def observe(self, feedback: Sequence[StepFeedback], models_ready: bool = True) -> None:
        """Record the outcome of the last step (one entry per request that was drafted for).

        ``models_ready``: whether the model drafters had caught up with the step's requests
        (False while they re-prefill requests after a start or a pause: the step's feedback
        then says little about what they deliver)."""
        ...

    def observe_step(self, timing: StepTiming) -> None:
        """Record how long the target's last step took and how many tokens it computed."""
        ...

    def observe_draft(self, timing: DraftTiming) -> None:
        """Record one drafter engine call."""
        ...

    def choose(self, requests: Sequence[RequestView], max_lookahead: int,
               free_lens: Sequence[int] | None = None) -> list[int]:
        """One lookahead per request, in order, each in ``0..max_lookahead``.

        ``free_lens[i]``: tokens the model-free voters have ready for request ``i`` now (they
        cost nothing to draft). After the call `models_on` says whether model drafters draft
        this step; when it is False every lookahead is at most ``free_lens[i]``.
        """
        ...

    @property
    def models_on(self) -> bool:
        """Whether the last choice drafts with the model drafters."""
        ...

    def wait_bound(
        self, requests: Sequence[RequestView], ready: Sequence[int], max_wait_s: float
    ) -> float:
        """Pipelined mode: seconds in ``[0, max_wait_s]`` to wait for the drafters' next tokens
        for ``requests`` (of the last choice), which have ``ready`` tokens ready now, fewer than
        chosen. The proposer asks again after each wait."""
        ...

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop any per-request state of finished or preempted requests."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """JSON-able state for metrics and logs."""
        ...


def room_for_drafts(request: RequestView) -> int:
    """How many draft tokens still fit before ``max_model_len``, never negative.

    Verification appends the accepted drafts plus one bonus token, so ``k`` drafts need
    ``num_tokens + k + 1 <= max_model_len``.
    """
    return max(0, request.max_model_len - request.num_tokens - 1)


def _check_max_lookahead(max_lookahead: int) -> None:
    if max_lookahead < 0:
        raise ValueError(f"max_lookahead must be >= 0, got {max_lookahead}")


def _check_wait_args(
    requests: Sequence[RequestView], ready: Sequence[int], max_wait_s: float
) -> None:
    if len(requests) != len(ready):
        raise ValueError(f"got {len(ready)} ready counts for {len(requests)} requests")
    if any(m < 0 for m in ready):
        # A negative count would index E(k) from the end: a silently wrong answer.
        raise ValueError(f"ready counts must be >= 0, got {list(ready)}")
    if not max_wait_s >= 0:  # rejects NaN too; +inf means "no limit"
        raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s!r}")


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


# ------------------------------------------------------------------------------------ acceptance

# Prior of the conditional acceptance at position 1 before anything was verified: the mean of a
# uniform prior. It weighs one pseudo-observation, so the first verified drafts override it.
_PRIOR_ACCEPTANCE = 0.5
# A position never observed globally inherits the estimate of the position before it, with the
# weight of one observation: after an accepted prefix the next token is, in practice, about as
# predictable as the previous one (copying stays copying). Without it position 8 would sit at the
# 0.5 prior until a draft of 8 had reached it, i.e. long drafts would look worse than they are.
_POSITION_PRIOR_STRENGTH = 1.0
# The global estimate is the prior of new requests and of positions a request has not reached
# recently. It forgets with a time constant of 256 verified drafts: ~8 steps at 32 requests,
# ~256 steps at batch 1, long enough to be a stable average over many requests and short enough
# to follow a change of workload (a new benchmark, a new prompt mix) within a few seconds.
_DEFAULT_GLOBAL_MEMORY = 256.0
# Per request, counts decay with a half-life of 2 steps (factor 0.707 per step, at most ~3.4
# effective observations of position 1): a request that turns from copying text (acceptance
# ~0.9) to free generation (~0.3) has its estimate of the new regime weighted 75% after 4 steps
# and 87% after 6. Longer memories (half-life 8) average over both regimes and keep drafting long
# for ~20 steps after the switch; shorter ones (1) make the estimate a coin flip of the last step.
_DEFAULT_REQUEST_HALF_LIFE_STEPS = 2.0
# The global estimate enters a request's estimate as this many pseudo-observations at every
# position: a new request starts at the global prior, and 1 pseudo-observation against at most
# ~3.4 real ones leaves a request that differs from the average most of its own evidence.
_DEFAULT_PRIOR_STRENGTH = 1.0


@dataclass
class _RequestCounts:
    successes: list[float]
    trials: list[float]


class AcceptanceModel:
    """Conditional acceptance ``p_i = P(position i accepted | positions < i accepted)``.

    A verified draft of ``k`` tokens with ``a`` accepted says: positions ``1..a`` accepted,
    position ``a + 1`` rejected (when ``a < k``), later positions unobserved. Counts of trials and
    successes are kept per position, globally (exponential forgetting per verified draft) and per
    request (exponential forgetting per step, shrunk towards the global estimate by
    ``prior_strength`` pseudo-observations).

    Why per position: the naive estimate "accepted / drafted" depends on the lookahead itself (with
    i.i.d. acceptance 0.7 it is 0.60 at k=2 and 0.34 at k=6), so after a change of lookahead it
    drifts for as long as the memory spans old and new drafts: the "mixed period" the paper drops.
    A per-position conditional estimate is updated only at positions a draft actually reached,
    and the evidence there does not depend on how long the draft was, so switching from k=2 to
    k=6 leaves p_1 and p_2 where they were and only starts to fill in p_3..p_6 (which until then
    come from the global prior). Nothing has to be discarded.
    """

    def __init__(
        self,
        max_positions: int,
        request_half_life_steps: float = _DEFAULT_REQUEST_HALF_LIFE_STEPS,
        prior_strength: float = _DEFAULT_PRIOR_STRENGTH,
        global_memory: float = _DEFAULT_GLOBAL_MEMORY,
    ) -> None:
        """Raises ValueError naming the setting when an argument is out of range."""
        if max_positions < 1:
            raise ValueError(f"max_positions must be >= 1, got {max_positions}")
        if not (math.isfinite(request_half_life_steps) and request_half_life_steps > 0):
            raise ValueError(
                f"request_half_life_steps must be finite and > 0, got {request_half_life_steps!r}"
            )
        if not (math.isfinite(prior_strength) and prior_strength > 0):
            raise ValueError(f"prior_strength must be finite and > 0, got {prior_strength!r}")
        if not (math.isfinite(global_memory) and global_memory > 0):
            raise ValueError(f"global_memory must be finite and > 0, got {global_memory!r}")
        self.max_positions = max_positions
        self.prior_strength = prior_strength
        self.global_memory = global_memory
        self._request_decay = 0.5 ** (1.0 / request_half_life_steps)
        self._g_succ = [0.0] * max_positions
        self._g_trials = [0.0] * max_positions
        self._global_cache: list[float] | None = None
        self._requests: dict[str, _RequestCounts] = {}

    # -- updates ----------------------------------------------------------------------------
    def tick(self, req_ids: Iterable[str]) -> None:
        """One step passed for these requests: their own evidence decays (drafted for or not).

        Decaying also while a request is not drafted for lets its estimate relax to the global
        one, so a request set to k=0 on bad evidence is reconsidered once that evidence is old.
        """
        d = self._request_decay
        for req_id in req_ids:
            counts = self._requests.get(req_id)
            if counts is None:
                continue
            s, n = counts.successes, counts.trials
            for i in range(len(s)):
                s[i] *= d
                n[i] *= d

    def observe(self, feedback: Sequence[StepFeedback]) -> None:
        """Add one step's verification outcomes."""
        drafted = [fb for fb in feedback if fb.num_draft_tokens > 0]
        if not drafted:
            return
        g = math.exp(-len(drafted) / self.global_memory)
        gs, gn = self._g_succ, self._g_trials
        for i in range(self.max_positions):
            gs[i] *= g
            gn[i] *= g
        K = self.max_positions
        for fb in drafted:
            counts = self._requests.get(fb.req_id)
            if counts is None:
                counts = self._requests[fb.req_id] = _RequestCounts([0.0] * K, [0.0] * K)
            rs, rn = counts.successes, counts.trials
            a = fb.num_accepted
            for i in range(min(a, K)):
                gs[i] += 1.0
                gn[i] += 1.0
                rs[i] += 1.0
                rn[i] += 1.0
            if a < fb.num_draft_tokens and a < K:
                gn[a] += 1.0
                rn[a] += 1.0
        self._global_cache = None

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._requests.pop(req_id, None)

    # -- estimates --------------------------------------------------------------------------
    def global_acceptance(self) -> list[float]:
        """``[p_1, ..., p_max_positions]`` over all requests, each in [0, 1]."""
        if self._global_cache is None:
            out = []
            prev = _PRIOR_ACCEPTANCE
            for s, n in zip(self._g_succ, self._g_trials, strict=True):
                prev = (s + _POSITION_PRIOR_STRENGTH * prev) / (n + _POSITION_PRIOR_STRENGTH)
                out.append(prev)
            self._global_cache = out
        return list(self._global_cache)

    def global_trials(self) -> list[float]:
        """Effective (decayed) number of observations per position, globally."""
        return list(self._g_trials)

    def request_acceptance(self, req_id: str) -> list[float]:
        """``[p_1, ..., p_max_positions]`` of one request (the global estimate if unknown).

        Each position's own evidence is shrunk towards a prior worth ``prior_strength``
        observations: the global estimate ``g_i``, except that a request doing worse than the
        population at position i-1 gets ``min(g_i, p_{i-1})``. The population's later positions
        are high partly by selection (only copying requests reach them), so they are no evidence
        for a request that fails early; this matters after a change of character, when drafts
        are rejected at position 1, later positions get no fresh evidence, and their old
        evidence says "copying": through the prior they follow position 1 down. A request doing
        better keeps the plain global prior (scaling it up would count the selection twice). In
        the simulator, over requests turning from acceptance 0.9 to 0.3 (batch 1, synchronous
        drafting) this is worth +3% throughput, with mixed workloads unchanged. A new request
        gets exactly the global estimate; position i depends only on positions <= i, so
        evidence at later positions never moves earlier ones.
        """
        glob = self.global_acceptance()
        counts = self._requests.get(req_id)
        if counts is None:
            return glob
        c = self.prior_strength
        out: list[float] = []
        prev = prev_glob = 1.0
        for s, n, pg in zip(counts.successes, counts.trials, glob, strict=True):
            prior = min(pg, prev) if prev < prev_glob else pg
            prev = (s + c * prior) / (n + c)
            prev_glob = pg
            out.append(prev)
        return out

    def expected_tokens(self, req_id: str, k: int) -> float:
        """``E(k) = 1 + sum_{j<=k} prod_{i<=j} p_i``: tokens a draft of ``k`` yields, bonus included.

        Positions beyond ``max_positions`` count as rejected.
        """
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        total, q = 1.0, 1.0
        for p in self.request_acceptance(req_id)[:k]:
            q *= p
            total += q
        return total

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)


# ----------------------------------------------------------------------------------- step costs

# The target's step time is memory-bound (flat) up to some token count and compute-bound (linear)
# beyond, with steps where kernels change tiles; a single line a + b*N fits neither end. Token
# counts are grouped in buckets: exact counts up to 32 (at small batches the knee of the curve
# matters to the token, e.g. 4 requests at k=3 are 16 tokens, at k=4 20), then 8 buckets per
# octave (9% apart: one more draft token per request at k~4 moves the step by 20%, two buckets),
# at most ~100 buckets up to 16384 tokens.
_EXACT_BUCKETS = 32
_BUCKETS_PER_OCTAVE = 8
# Each bucket keeps its last 16 observations and uses their median: robust to up to 7 outliers (a
# GC pause, a CUDA-graph capture, a step that also ran a long prefill), and it follows a lasting
# change of the curve (longer contexts, a co-located job) within ~8 visits.
_DEFAULT_COST_WINDOW = 16
# A knot is priced one standard error of its median (1.2533 * sigma / sqrt(n), sigma the steps'
# relative noise pooled over all buckets) below the median: a lower confidence bound. A bucket
# measured once during a slow step would otherwise make its whole neighbourhood look expensive
# for good, since the controller would never go back there; with the bound, thinly measured
# token counts look a little cheaper and get revisited until they are measured as well as the
# rest (with 20% step-time noise this recovers 7% of throughput at 16 requests in the
# simulator). Noiseless measurements are not changed.
_MEDIAN_STANDARD_ERROR = 1.2533
# The pooled noise is recomputed every this many observations (it sorts every bucket's
# deviations: the only part of a step's update that grows with the number of buckets).
_NOISE_REFRESH = 16


def _bucket(num_tokens: int) -> int:
    if num_tokens <= _EXACT_BUCKETS:
        return num_tokens
    return _EXACT_BUCKETS + 1 + math.floor(
        _BUCKETS_PER_OCTAVE * math.log2(num_tokens / _EXACT_BUCKETS))


def _pava(values: list[float], weights: list[float]) -> list[float]:
    """Weighted isotonic (non-decreasing) regression by pool-adjacent-violators."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights, strict=True):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, c2 = blocks.pop()
            b = blocks[-1]
            b[0] = (b[0] * b[1] + v2 * w2) / (b[1] + w2)
            b[1] += w2
            b[2] += c2
    out: list[float] = []
    for v, _, c in blocks:
        out.extend([v] * int(c))
    return out


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else 0.5 * (s[m - 1] + s[m])


class StepCostModel:
    """Target step seconds as a non-decreasing function of its token count, learnt online.

    Knots are the (mean token count, median seconds) of each populated bucket, lowered by one
    standard error of the median (see the constant), made non-decreasing by weighted isotonic regression (more tokens never cost less; this also keeps
    every slope non-negative).

    Between two knots the curve is *optimistic*: the lowest value a convex non-decreasing curve
    through the knots allows, i.e. the largest of the left knot's value and the neighbouring
    segments extended into the gap (never above the straight chord). Real curves are about
    convex (flat, then linear), and the chord over a wide gap, e.g. between the exploration steps
    at k=0 and k=max and a third one, would price everything in between as if the knee were at
    the start: the controller would never try a middle token count and never learn it was cheap.
    With the optimistic value it tries the gap, and each try closes it. With exactly two knots
    nothing is known about curvature and the chord is used (exact for a linear cost, where an
    optimistic guess would cost a second step at the largest token count). Outside the knots the end segments
    are extended (below: floored at the proportional ``T(x0) * N / x0``, which a cost ``a + b*N``
    with ``a >= 0`` never undercuts); a single knot makes a flat curve, which is again the
    optimistic choice that leads the controller to measure other token counts.
    """

    def __init__(self, window: int | None = _DEFAULT_COST_WINDOW) -> None:
        """``window``: observations kept per bucket (None: all). Raises ValueError if < 1."""
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 or None, got {window}")
        self.window = window
        self._buckets: dict[int, deque[tuple[int, float]]] = {}
        self._order: list[int] = []  # bucket keys, sorted
        # Per bucket: (mean token count, median seconds, count, relative deviations from the
        # median); only the bucket a step lands in is recomputed (a step costs O(window), not
        # O(every bucket)).
        self._stats: dict[int, tuple[float, float, float, list[float]]] = {}
        self._noise_due = 0  # observations since the pooled noise was last computed
        self._knots: list[tuple[float, float]] | None = None
        self._xs: list[float] = []
        self._ys: list[float] = []
        self._noise = 0.0
        self.num_observations = 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Add one step; steps of 0 tokens carry no cost information and are ignored."""
        _check_seconds("seconds", seconds)
        if num_tokens < 1:
            return
        b = _bucket(num_tokens)
        q = self._buckets.get(b)
        if q is None:
            q = self._buckets[b] = deque(maxlen=self.window)
            bisect.insort(self._order, b)
        q.append((num_tokens, seconds))
        med = _median([s for _, s in q])
        devs = [abs(s / med - 1.0) for _, s in q] if len(q) >= 2 and med > 0 else []
        self._stats[b] = (sum(n for n, _ in q) / len(q), med, float(len(q)), devs)
        self.num_observations += 1
        self._noise_due += 1
        self._knots = None

    def knots(self) -> list[tuple[float, float]]:
        """The fitted curve's knots ``(num_tokens, seconds)``, increasing in both coordinates."""
        if self._knots is None:
            stats = [self._stats[b] for b in self._order]
            if self._noise_due >= _NOISE_REFRESH or self._noise_due >= self.num_observations:
                # Robust (MAD) relative noise of a step's time, pooled over the buckets: it moves
                # slowly, so it is pooled again every _NOISE_REFRESH steps, not every step.
                devs = [d for *_, ds in stats for d in ds]
                self._noise = 1.4826 * _median(devs) if devs else 0.0
                self._noise_due = 0
            xs = [x for x, _, _, _ in stats]
            ws = [w for _, _, w, _ in stats]
            ys = [y * max(0.0, 1.0 - _MEDIAN_STANDARD_ERROR * self._noise / math.sqrt(w))
                  for _, y, w, _ in stats]
            self._knots = list(zip(xs, _pava(ys, ws), strict=True))
            self._xs = [x for x, _ in self._knots]
            self._ys = [y for _, y in self._knots]
        return list(self._knots)

    @property
    def is_empty(self) -> bool:
        return not self._buckets

    @property
    def noise(self) -> float:
        """Relative noise of step times (robust standard deviation), pooled over buckets (as of
        at most _NOISE_REFRESH observations ago)."""
        self.knots()
        return self._noise

    def __call__(self, num_tokens: float) -> float:
        """Predicted seconds of a step of ``num_tokens`` tokens (0.0 before any observation)."""
        if self._knots is None:
            self.knots()
        xs, ys = self._xs, self._ys
        if not xs:
            return 0.0
        x0, y0 = xs[0], ys[0]
        if len(xs) == 1:
            return y0
        if num_tokens <= x0:
            slope = (ys[1] - y0) / (xs[1] - x0)
            return max(y0 - slope * (x0 - num_tokens), y0 * max(num_tokens, 0.0) / x0)
        xl, yl = xs[-1], ys[-1]
        if num_tokens >= xl:
            return yl + (yl - ys[-2]) / (xl - xs[-2]) * (num_tokens - xl)
        i = bisect.bisect_right(xs, num_tokens)
        xa, ya, xb, yb = xs[i - 1], ys[i - 1], xs[i], ys[i]
        chord = ya + (yb - ya) * (num_tokens - xa) / (xb - xa)
        if len(xs) == 2:
            # No neighbouring segment tells anything about curvature yet: the chord (a linear
            # cost) is the only estimate, and it is exact when the cost is linear.
            return chord
        low = ya
        if i >= 2:  # the segment to the left, extended to the right
            low = max(low, ya + (ya - ys[i - 2]) / (xa - xs[i - 2]) * (num_tokens - xa))
        if i + 1 < len(xs):  # the segment to the right, extended to the left
            low = max(low, yb - (ys[i + 1] - yb) / (xs[i + 1] - xb) * (xb - num_tokens))
        return min(chord, low)

    def snapshot(self) -> dict[str, Any]:
        knots = self.knots()
        return {
            "observations": self.num_observations,
            "noise": round(self._noise, 4),
            "knots": [[round(x, 2), round(y, 9)] for x, y in knots],
        }


# ---------------------------------------------------------------------------------- draft costs

# A drafter call runs `num_positions` autoregressive forwards of a small model over `num_reqs`
# requests: seconds ~ c0 + P * (c1 + c2 * R) (c0: IPC and scheduling, c1: one forward's fixed
# cost, c2: its per-request part), fitted by non-negative least squares over the last 64 calls
# (a few seconds of drafting at any load), after dropping calls more than 3 robust standard
# deviations (1.4826 * MAD) off a first fit, so a stalled call does not bend the line.
_DEFAULT_DRAFT_WINDOW = 64
_OUTLIER_MADS = 3.0
# The robust noise scale is floored at 0.1% of the median call: no timing is more precise than
# that, and an exact fit of noiseless calls leaves residuals of ~1e-6 relative (the ridge) that,
# against a noise scale of ~0, would make every call of a minority batch size an "outlier".
_MIN_RELATIVE_NOISE = 1e-3
# Tiny ridge, relative to the features' scale: only there to make the normal equations of
# degenerate data (every call with the same P and R) solvable; it then spreads the cost over the
# features in proportion to their size, which predicts the observed calls exactly.
_RIDGE = 1e-9
# The line is refitted every this many calls once it has as many (see DraftCostModel.observe).
_REFIT_EVERY = 8


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def _nnls(rows: list[tuple[float, ...]], ys: list[float]) -> list[float]:
    """Non-negative least squares for a handful of features, by enumerating active sets."""
    k = len(rows[0])
    xtx = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    xty = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(k)]
    ridge = _RIDGE * max(1e-300, sum(xtx[i][i] for i in range(k)) / k)
    best, best_sse = [0.0] * k, sum(y * y for y in ys)
    for mask in range(1, 1 << k):
        idx = [i for i in range(k) if mask >> i & 1]
        a = [[xtx[i][j] + (ridge if i == j else 0.0) for j in idx] for i in idx]
        sol = _solve(a, [xty[i] for i in idx])
        if sol is None or min(sol) < 0:
            continue
        coef = [0.0] * k
        for i, v in zip(idx, sol, strict=True):
            coef[i] = v
        sse = sum((sum(c * f for c, f in zip(coef, r, strict=True)) - y) ** 2
                  for r, y in zip(rows, ys, strict=True))
        if sse < best_sse * (1 - 1e-12):
            best, best_sse = coef, sse
    return best


class DraftCostModel:
    """Seconds of one drafter call ~ ``c0 + num_positions * (c1 + c2 * num_reqs)``, all >= 0.

    Before any observation every call is predicted to cost 0: nothing is invented, and drafting
    cost then simply does not enter the decision until it has been measured.
    """

    def __init__(self, window: int | None = _DEFAULT_DRAFT_WINDOW) -> None:
        """``window``: calls kept (None: all). Raises ValueError if < 1."""
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 or None, got {window}")
        self._obs: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._coef: list[float] | None = None
        self._fitted_at = 0  # num_observations when the coefficients were last fitted
        self.num_observations = 0

    def observe(self, num_positions: int, num_reqs: int, seconds: float) -> None:
        _check_seconds("seconds", seconds)
        if num_positions < 0 or num_reqs < 0:
            raise ValueError(
                f"num_positions and num_reqs must be >= 0, got {num_positions}, {num_reqs}"
            )
        self._obs.append((num_positions, num_reqs, seconds))
        self.num_observations += 1
        # Refitted after the first observations, then every _REFIT_EVERY: a streaming drafter
        # reports every engine step, and one more of 64 calls barely moves the line.
        if (self.num_observations <= _REFIT_EVERY
                or self.num_observations - self._fitted_at >= _REFIT_EVERY):
            self._coef = None

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """``(c0, c1, c2)``; zeros before any observation."""
        if self._coef is None:
            if not self._obs:
                self._coef = [0.0, 0.0, 0.0]
            else:
                # Streaming drafters report one position per engine step: with the number of
                # positions never varying the intercept is not identifiable, and the cost of p
                # positions is p steps, so c0 is 0 then.
                intercept = 1.0 if len({p for p, _, _ in self._obs}) > 1 else 0.0
                rows = [(intercept, float(p), float(p * r)) for p, r, _ in self._obs]
                ys = [s for _, _, s in self._obs]
                coef = _nnls(rows, ys)
                res = [abs(sum(c * f for c, f in zip(coef, row, strict=True)) - y)
                       for row, y in zip(rows, ys, strict=True)]
                cut = _OUTLIER_MADS * max(1.4826 * _median(res),
                                          _MIN_RELATIVE_NOISE * _median(ys))
                keep = [i for i, r in enumerate(res) if r <= cut + 1e-12]
                if 0 < len(keep) < len(rows):
                    coef = _nnls([rows[i] for i in keep], [ys[i] for i in keep])
                self._coef = coef
                self._fitted_at = self.num_observations
        c0, c1, c2 = self._coef
        return c0, c1, c2

    def __call__(self, num_positions: int, num_reqs: int) -> float:
        """Predicted seconds of a call; 0.0 when nothing is drafted."""
        if num_positions <= 0 or num_reqs <= 0:
            return 0.0
        c0, c1, c2 = self.coefficients
        return c0 + num_positions * (c1 + c2 * num_reqs)

    def snapshot(self) -> dict[str, Any]:
        c0, c1, c2 = self.coefficients
        return {"observations": self.num_observations, "c0": c0, "per_position": c1,
                "per_position_per_request": c2}


# ------------------------------------------------------------------------------ time calibration

# A plan's predicted-to-taken time ratio averages about its last 16 sampled steps and is shrunk
# towards 1 as if 4 more steps had taken just the predicted time: a few steps move it (a retry
# of the model drafters lasts 8 once they have caught up), one step cannot.
_CALIBRATION_MEMORY = 16.0
_CALIBRATION_PRIOR_STEPS = 4.0


@dataclass
class _PendingSample:
    """The last choice, while it can still become a calibration sample."""

    models: bool  # the plan with the model drafters
    predicted_s: float
    taken_s: float | None = None  # set by observe_step


class StepTimeCalibration:
    """How long a plan's steps took against the time predicted for them.

    The predicted step time rests on cost curves of the target's step and of the drafters; what
    a step really costs also holds time no curve sees: the proposer waiting for model drafts
    (outside the target's step), its own drafting and voting, a curve learnt in other
    conditions. Each sample is one step, predicted against taken seconds; :meth:`factor` is
    ``sum(predicted) / sum(taken)`` over exponentially decaying sums (``memory`` steps), shrunk
    towards a prior (1 unless given) by ``prior_steps`` steps: the factor on the plan's
    predicted rate. Only time is calibrated: the expected tokens come from the acceptance
    models, which count drafts that were not ready in time as rejected and adapt within a few
    steps.
    """

    def __init__(self, memory: float = _CALIBRATION_MEMORY,
                 prior_steps: float = _CALIBRATION_PRIOR_STEPS) -> None:
        if not memory >= 1:
            raise ValueError(f"memory must be >= 1 step, got {memory!r}")
        if not prior_steps > 0:
            raise ValueError(f"prior_steps must be > 0, got {prior_steps!r}")
        self._decay = 1.0 - 1.0 / memory
        self.prior_steps = prior_steps
        self._predicted = 0.0
        self._taken = 0.0
        self._steps = 0.0

    def observe(self, predicted_s: float, taken_s: float) -> None:
        """One step; ignored unless both times are positive (nothing to compare)."""
        if not (predicted_s > 0 and taken_s > 0 and math.isfinite(predicted_s)
                and math.isfinite(taken_s)):
            return
        d = self._decay
        self._predicted = d * self._predicted + predicted_s
        self._taken = d * self._taken + taken_s
        self._steps = d * self._steps + 1.0

    @property
    def steps(self) -> float:
        """The decayed number of steps sampled."""
        return self._steps

    def factor(self, prior: float = 1.0) -> float:
        """Predicted over taken time, shrunk towards ``prior``; ``prior`` before any sample."""
        if self._steps == 0:
            return prior
        weight = self._steps / (self._steps + self.prior_steps)
        return prior + weight * (self._predicted / self._taken - prior)

    def snapshot(self, prior: float = 1.0) -> dict[str, Any]:
        return {"factor": round(self.factor(prior), 4), "steps": round(self._steps, 2)}


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
