"""Step-cost models, learnt online from measured times: the target step's seconds by the tokens
it computes (:class:`StepCostModel`), a drafter call's seconds by its batch and draft length
(:class:`DraftCostModel`), and the correction of a plan's predicted step time by what its steps
took (:class:`StepTimeCalibration`).

Pure module (stdlib only).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm_smurfs.lookahead_types import _check_seconds


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
            self._knots = list(zip(xs, isotonic_regression(ys, ws), strict=True))
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
