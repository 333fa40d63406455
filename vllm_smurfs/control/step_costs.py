"""Step-cost models, learnt online from measured times: a forward's seconds by the tokens it
computes (:class:`StepCostModel`: the target's step, an in-worker drafter's forward), and a
streaming drafter's engine step by its batch (:class:`DraftCostModel`).

Pure module (stdlib only).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from typing import Any

from vllm_smurfs.control.feedback import _check_seconds

# The target's step time is memory-bound (flat) up to some token count and compute-bound (linear)
# beyond, with steps where kernels change tiles; a single line a + b*N fits neither end. Token
# counts are grouped in buckets: exact counts up to 32 (at small batches the knee of the curve
# matters to the token, e.g. 4 requests at k=3 are 16 tokens, at k=4 20), then 8 buckets per
# octave (9% apart: one more draft token per request at k~4 moves the step by 20%, two buckets),
# at most ~100 buckets up to 16384 tokens.
_EXACT_BUCKETS = 32
_BUCKETS_PER_OCTAVE = 8
# Each bucket keeps its last 16 observations and uses their median: robust to up to 7 outliers (a
# GC pause, a step that also ran a long prefill), and it follows a lasting change of the curve
# (longer contexts, a co-located job) within ~8 visits.
_DEFAULT_COST_WINDOW = 16
# The first call at a token count may be no sample of its cost: on CPU it builds the oneDNN
# primitives of that shape, on GPU it compiles or captures a graph (seen here: one 30 s first
# forward among 0.14 s ones). A bucket observed once is worth at most SINGLE_CALL_CAP times what
# the buckets observed more often predict for it, and a bucket's value is the lower median of its
# observations: no single slow call sets the curve, and a token count first seen slow is
# revisited (the start-up warm-up runs the drafters' shapes twice).
SINGLE_CALL_CAP = 2.0
# A bucket forgets observations older than this many observations of the whole curve (about a
# minute of steps): a curve forgets what the machine no longer does (a job that ended, a cache
# that warmed up), and a token count not revisited for that long is priced from its neighbours.
_DEFAULT_MAX_AGE = 4096
# The machine's speed drifts as a whole (a co-located process, the clock, caches), and a batch-1
# run visits a few token counts often and the others seldom: a knot refreshed only by steps of
# its own size keeps the speed of the time it was measured. (At temperature 1 a first prompt's
# 2-token knot, 107 ms, stayed for three prompts while the 1-token knot followed the machine
# from 99 to 67-76 ms: a 2-token step looked 41-55% dearer than a 1-token one, against 0-7%
# later, and the model drafts that need one were priced out.) So the curve also tracks a common
# *level* (log speed factor): each bucket gets a fixed reference, the lower median of its first
# _REFERENCE_OBSERVATIONS observations (robust to a first call that builds kernels and to a
# pause) taken relative to the level then, and the level is an exponential average, weight
# DRIFT_RATE, of each later observation's log ratio to its bucket's reference (clipped to
# DRIFT_CLIP: a pause moves it by at most DRIFT_RATE * DRIFT_CLIP, undone within ~1/DRIFT_RATE
# observations). The fixed references anchor it: it is an average, not a sum, and no timing
# noise accumulates in it. Each observation is stored relative to the level at its time and
# each bucket is valued at the level now, so a knot not visited for a while moves with the
# ones that are. Decisions compare costs on one curve (each drafter's curve has its own level):
# the level's own noise, common to all knots, changes none of them.
DRIFT_RATE = 0.1
DRIFT_CLIP = 0.7
_REFERENCE_OBSERVATIONS = 5


def _bucket(num_tokens: int) -> int:
    if num_tokens <= _EXACT_BUCKETS:
        return num_tokens
    return _EXACT_BUCKETS + 1 + math.floor(
        _BUCKETS_PER_OCTAVE * math.log2(num_tokens / _EXACT_BUCKETS))


def isotonic_regression(values: list[float], weights: list[float]) -> list[float]:
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


def lower_envelope(values: Sequence[float]) -> list[float]:
    """The largest non-decreasing sequence at or below ``values``: each value lowered to the
    smallest value at or after it."""
    out = list(values)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else 0.5 * (s[m - 1] + s[m])


def _lower_median(xs: Sequence[float]) -> float:
    """The median, or of two middle values the lower: timing noise only adds time, so of two
    observations the slower is the suspect."""
    s = sorted(xs)
    return s[(len(s) - 1) // 2]


class StepCostModel:
    """Seconds of a forward as a non-decreasing function of its token count, learnt online (the
    target's step, a drafter's forward).

    Knots are the (mean token count, lower median seconds) of each populated bucket; a bucket
    observed once is capped at SINGLE_CALL_CAP times what the others predict; the knots are made
    non-decreasing (more tokens never cost less) by lowering: a knot above a later one is set to
    the later one (:func:`lower_envelope`). Timing noise is one-sided (a pause, a co-located
    job, a first call only ever add time), so a slow knot is the suspect, not the fast ones after
    it: pooling them upwards, as a least-squares isotonic fit does, let one 30 s first forward
    price every larger token count at seconds and shut drafting out for good. Observations older
    than ``max_age`` observations are forgotten. The whole curve moves with the machine's speed
    (a common level learnt from every bucket's observations, see DRIFT_RATE), so a knot keeps
    its ratio to the others, not the seconds of the time it was measured.

    Between two knots the curve is *optimistic*: the lowest value a convex non-decreasing curve
    through the knots allows, i.e. the largest of the left knot's value and the neighbouring
    segments extended into the gap (never above the straight chord). Real curves are about
    convex (flat, then linear), and the chord over a wide gap would price everything in between
    as if the knee were at the start: the controller would never try a middle token count and
    never learn it was cheap. With exactly two knots the chord is used. Outside the knots the
    end segments are extended (below: floored at the proportional ``T(x0) * N / x0``; above: at
    least at the curve's average slope); a single knot makes a flat curve.
    """

    def __init__(self, window: int | None = _DEFAULT_COST_WINDOW,
                 max_age: int | None = _DEFAULT_MAX_AGE, drift_rate: float = DRIFT_RATE) -> None:
        """``window``: observations kept per bucket (None: all); ``max_age``: observations of the
        whole curve after which one is forgotten (None: never); ``drift_rate``: weight of each
        observation in the common level (0: no level, a static fit). Raises ValueError if
        ``window`` or ``max_age`` < 1 or ``drift_rate`` is not in [0, 1]."""
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 or None, got {window}")
        if max_age is not None and max_age < 1:
            raise ValueError(f"max_age must be >= 1 or None, got {max_age}")
        if not 0.0 <= drift_rate <= 1.0:
            raise ValueError(f"drift_rate must be in [0, 1], got {drift_rate!r}")
        self.window = window
        self.max_age = max_age
        self.drift_rate = drift_rate
        self.level = 0.0  # log speed factor now (see DRIFT_RATE)
        # Per bucket: its first observations' log seconds at level 0; their lower median is its
        # reference once there are _REFERENCE_OBSERVATIONS.
        self._refs: dict[int, list[float]] = {}
        # Per bucket: (observation index, tokens, seconds), oldest first.
        self._buckets: dict[int, deque[tuple[int, int, float]]] = {}
        self._knots: list[tuple[float, float]] | None = None
        self._xs: list[float] = []
        self._ys: list[float] = []
        # Predictions of the present knots (a plan asks for the same token counts many times).
        self._cache: dict[float, float] = {}
        self._by_bucket: dict[int, float] = {}
        self.num_observations = 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Add one forward; forwards of 0 tokens carry no cost information and are ignored."""
        _check_seconds("seconds", seconds)
        if num_tokens < 1:
            return
        b = _bucket(num_tokens)
        q = self._buckets.get(b)
        if q is None:
            q = self._buckets[b] = deque(maxlen=self.window)
        if self.drift_rate > 0.0:
            self._follow_level(b, math.log(max(seconds, 1e-9)))
        # Stored at level 0: the bucket's value is rescaled to the level now (`knots`).
        q.append((self.num_observations, num_tokens, seconds * math.exp(-self.level)))
        self.num_observations += 1
        self._knots = None

    def _follow_level(self, b: int, log_s: float) -> None:
        """Update the level with an observation of bucket ``b`` (see DRIFT_RATE)."""
        ref = self._refs.setdefault(b, [])
        if len(ref) == _REFERENCE_OBSERVATIONS:
            deviation = log_s - _lower_median(ref) - self.level
            self.level += self.drift_rate * min(DRIFT_CLIP, max(-DRIFT_CLIP, deviation))
        else:
            ref.append(log_s - self.level)

    def knots(self) -> list[tuple[float, float]]:
        """The fitted curve's knots ``(num_tokens, seconds)``, non-decreasing in both."""
        if self._knots is None:
            oldest = (self.num_observations - self.max_age if self.max_age is not None
                      else -1)
            stats = []  # (mean tokens, lower median seconds, observations)
            for b in sorted(self._buckets):
                q = self._buckets[b]
                while len(q) > 1 and q[0][0] < oldest:
                    q.popleft()
                if q[0][0] < oldest and len(self._buckets) > 1:
                    continue  # stale: priced from its neighbours
                stats.append((sum(n for _, n, _ in q) / len(q),
                              _lower_median([s for *_, s in q]), len(q)))
            trusted = [(x, y) for x, y, c in stats if c > 1]
            if trusted and len(trusted) < len(stats):
                txs = [x for x, _ in trusted]
                tys = lower_envelope([y for _, y in trusted])
                stats = [(x, y if c > 1 else min(y, SINGLE_CALL_CAP * _predict(txs, tys, x)), c)
                         for x, y, c in stats]
            level = math.exp(self.level)
            ys = lower_envelope([y * level for _, y, _ in stats])
            self._knots = [(x, y) for (x, _, _), y in zip(stats, ys, strict=True)]
            # A token count in a measured bucket costs what the bucket does (interpolating
            # towards the bucket's mean token count from a gap below it would keep pricing the
            # counts just below the mean at the gap's optimistic floor).
            self._by_bucket = {_bucket(round(x)): y for x, y in self._knots}
            self._xs = [x for x, _ in self._knots]
            self._ys = [y for _, y in self._knots]
            self._cache = {}
        return list(self._knots)

    @property
    def max_tokens(self) -> float:
        """The largest token count the curve has measured (0 when empty)."""
        self.knots()
        return self._xs[-1] if self._xs else 0.0

    @property
    def is_empty(self) -> bool:
        return not self._buckets

    def __call__(self, num_tokens: float) -> float:
        """Predicted seconds of a step of ``num_tokens`` tokens (0.0 before any observation)."""
        if self._knots is None:
            self.knots()
        cached = self._cache.get(num_tokens)
        if cached is None:
            measured = self._by_bucket.get(_bucket(max(1, round(num_tokens))))
            cached = self._cache[num_tokens] = (
                measured if measured is not None else _predict(self._xs, self._ys, num_tokens))
        return cached

    def snapshot(self) -> dict[str, Any]:
        knots = self.knots()
        return {
            "observations": self.num_observations,
            "level": round(math.exp(self.level), 4),
            "knots": [[round(x, 2), round(y, 6)] for x, y in knots],
        }


def _predict(xs: Sequence[float], ys: Sequence[float], num_tokens: float) -> float:
    """The curve through knots ``xs, ys`` at ``num_tokens`` (see `StepCostModel`)."""
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
        # Beyond the last knot: its segment's slope, but at least the curve's average slope (a
        # flat last segment, a decode batch's cost measured at a few neighbouring token counts,
        # says nothing of twice as many: priced flat, every draft there looked free, seen
        # replaying a served trace at 32 requests).
        slope = max((yl - ys[-2]) / (xl - xs[-2]), (yl - y0) / (xl - x0))
        return yl + slope * (num_tokens - xl)
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
