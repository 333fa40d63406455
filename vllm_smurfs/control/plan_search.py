"""The arithmetic of plans, given acceptance curves and costs: the greedy allocation of draft
tokens along one path, the prefix sizes a model plan is valued at, and how a request's catch-up
is charged to a step. `length_controller` searches its plans with these.

Pure module (stdlib only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_smurfs.control.plan import PlanRequest, expected

# A request's catch-up beyond a normal step's (a full accepted lookahead and its bonus token) is
# an investment in its later steps: charged spread over the steps it is expected to still run
# (its remaining tokens over its expected tokens per step, at most this many) in which its
# voters have no chain (`spread_steps`).
CATCH_UP_SPREAD_STEPS = 32


@dataclass
class Point:
    """A point of a plan: expected tokens, target tokens, seconds (without the target's part)."""

    expected: float
    tokens: float
    extra_s: float = 0.0  # drafter forwards and calls


@dataclass
class ModelChoice:
    """The best model plan found: its rows (with lookahead caps and catch-ups), value, cost."""

    rows: list[int]
    ks: dict[int, int]
    value: float
    expected: float
    tokens: float
    extra_s: float


def greedy_path(curves: list[list[float]], lows: list[int]) -> list[Point]:
    """The points of the greedy allocation: draft tokens added one at a time, the one with the
    largest chance of acceptance first (each request's chances never increase along its draft,
    so every prefix is a valid allocation, and the best one for its token count)."""
    exp_tokens = sum(expected(q, lo) for q, lo in zip(curves, lows, strict=True))
    tokens = float(sum(1 + lo for lo in lows))
    points = [Point(exp_tokens, tokens)]
    for g, _, _ in token_gains(curves, lows):
        exp_tokens += g
        tokens += 1
        points.append(Point(exp_tokens, tokens))
    return points


def token_gains(curves: list[list[float]], lows: list[int]) -> list[tuple[float, int, int]]:
    gains = [(qs[j - 1], r, j) for r, (qs, lo) in enumerate(zip(curves, lows, strict=True))
             for j in range(lo + 1, len(qs) + 1)]
    # Stable sort by gain only: within a request gains never increase, so equal gains keep their
    # (request, position) order.
    gains.sort(key=lambda g: -g[0])
    return gains


def ks_of_path(curves: list[list[float]], length: int) -> list[int]:
    ks = [0] * len(curves)
    for _, r, j in token_gains(curves, [0] * len(curves))[:length]:
        ks[r] = j
    return ks


def scaled(qs: list[float], factor: float) -> list[float]:
    """Cumulative chances scaled by ``factor``, each at most 1 and never increasing."""
    if factor == 1.0:
        return qs
    out, prev = [], 1.0
    for q in qs:
        prev = min(prev, q * factor, 1.0)
        out.append(prev)
    return out


def checkpoint_sizes(n: int) -> set[int]:
    """The prefix sizes a model plan is valued at: all up to 32, then about 12 per doubling (a
    plan for 200 requests is as good as one for 198 within the noise of the estimates)."""
    out = set(range(1, min(n, 32) + 1))
    m = 32.0
    while m < n:
        m *= 1.06
        out.add(min(n, int(m)))
    out.add(n)
    return out


def total_catch_up(request: PlanRequest) -> int:
    return sum(c for c in request.catch_up if c is not None)


def catch_ups(request: PlanRequest, num_drafters: int) -> list[int | None]:
    """The request's catch-up per in-worker drafter (None where it cannot draft)."""
    return [request.catch_up[d] if d < len(request.catch_up) else None
            for d in range(num_drafters)]


def marginal(curve: Any, tokens: float, span: int) -> float:
    """Seconds per token the curve adds from ``tokens`` over the next ``span`` tokens."""
    return max(0.0, (curve(tokens + span) - curve(tokens)) / span)


def spread_steps(remaining: int | None, tokens_per_step: float, chainless: float = 1.0) -> float:
    """The later steps a request's catch-up is spread over: the steps it is expected to still
    run (at most CATCH_UP_SPREAD_STEPS) times ``chainless``, the share of them in which its
    model-free voters are expected to have no chain (where the models draft; where a chain is
    in hand they seldom do, and a catch-up charged as if they drafted in every later step was
    seen paid for one or two)."""
    steps = float(CATCH_UP_SPREAD_STEPS)
    if remaining is not None:
        steps = min(steps, remaining / max(tokens_per_step, 1.0))
    return max(1.0, steps * min(1.0, max(0.0, chainless)))


@dataclass(frozen=True)
class CatchUpCharge:
    """One drafter's first forward in a plan, as charged to the step: ``full`` catch-up tokens
    computed, of which ``normal`` are a normal step's (charged in full), the rest an investment
    in later steps charged at ``amortized`` / (``full`` - ``normal``): the sum over its requests
    of their extra tokens over their spread, so each request's extra is charged ``1 / spread``
    of what it costs. Priced in seconds on the drafter's measured curve, at the tokens it will
    really compute (`seconds`). Spreading the tokens instead and pricing the share on the curve,
    which has a large fixed cost per forward (flat up to ~50 tokens on the 2-core CPU, then
    ~1.2 ms a token), charged a 710-token catch-up (0.87 s) about a third of its spread share."""

    normal: float = 0.0
    full: float = 0.0
    amortized: float = 0.0

    def __add__(self, other: CatchUpCharge) -> CatchUpCharge:
        return CatchUpCharge(self.normal + other.normal, self.full + other.full,
                             self.amortized + other.amortized)

    def seconds(self, cost: Any) -> float:
        """Seconds charged: the forward over the normal part, and the share of the rest."""
        if self.full <= 0:
            return 0.0
        base = cost(self.normal)
        extra = self.full - self.normal
        if extra <= 0:
            return base
        return base + max(0.0, cost(self.full) - base) * (self.amortized / extra)


def charged_catch_up(tokens: int | None, max_lookahead: int, spread: float) -> CatchUpCharge:
    """A request's catch-up as charged to this step: all of a normal step's (a full accepted
    lookahead and its bonus token), the rest spread over the request's later steps."""
    if tokens is None or tokens <= 0:
        return CatchUpCharge()
    normal = min(tokens, max_lookahead + 1)
    return CatchUpCharge(float(normal), float(tokens), (tokens - normal) / spread)
