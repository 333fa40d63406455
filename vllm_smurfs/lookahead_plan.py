"""One step's lookahead plan for streaming drafters, and the greedy allocation that makes it.

:class:`~vllm_smurfs.length_controller.AdaptiveLookahead` plans each step as a
:class:`LookaheadPlan`: the lookahead per request, whether the model drafters draft, and what the
proposer's waits for late drafts are weighed against (:meth:`LookaheadPlan.wait_bound`). It
parallels `step_planner.Plan`, the plan of in-worker drafting, which has per-drafter rows and a
stop rule instead of a wait.

:func:`greedy_lookaheads` is the allocation (see `AdaptiveLookahead`'s docstring for why the
greedy path is the best one per token count); :func:`cumulative_acceptance` feeds it.

Pure module (stdlib only).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_smurfs.acceptance import AcceptanceModel
from vllm_smurfs.lookahead_types import RequestView
from vllm_smurfs.step_costs import DraftCostModel

# A longer draft must improve the predicted rate by this relative margin to be taken: it breaks
# numerical ties (free verification, zero expected gain) towards fewer tokens.
MIN_RELATIVE_GAIN = 1e-9


@dataclass
class LookaheadPlan:
    """One step's decision (the last :meth:`AdaptiveLookahead.choose`)."""

    lookaheads: dict[str, int]  # req_id -> lookahead chosen
    # req_id -> E(0..cap): expected tokens of the request at each lookahead (1 + drafts accepted)
    expected: dict[str, list[float]]
    models: bool  # the model drafters draft
    mode: str  # how it was chosen: explore-*, retry, greedy, greedy-free, +probe
    num_drafted: int  # requests with a lookahead > 0
    decode_tokens: int  # sum over requests of 1 + lookahead
    background_tokens: float  # prompt-chunk tokens expected in the step
    expected_tokens: float  # sum over requests of E(lookahead)
    target_seconds: float  # predicted target step
    step_seconds: float  # predicted step, the visible drafting included
    histogram: dict[str, int] = field(default_factory=dict)  # lookahead -> requests

    def forget(self, req_ids: Iterable[str]) -> None:
        """Finished requests: nothing more is waited for them."""
        for req_id in req_ids:
            self.expected.pop(req_id, None)

    def wait_bound(self, requests: Sequence[RequestView], ready: Sequence[int],
                   max_wait_s: float, t_d: float) -> float:
        """``t_d`` (at most ``max_wait_s``) when one more drafter step of ``t_d`` seconds for the
        late ``requests`` (``ready`` tokens each) raises the step's predicted rate, else 0 (see
        `AdaptiveLookahead.wait_bound`)."""
        s = self.expected_tokens + self.background_tokens
        gain = 0.0
        for r, m in zip(requests, ready, strict=True):
            e = self.expected.get(r.req_id)
            k = self.lookaheads.get(r.req_id, 0)
            if e is None or m >= k:
                continue
            s -= e[k] - e[m]  # what the late draft does not deliver now
            gain += e[m + 1] - e[m]
        t = self.step_seconds
        if gain <= 0 or t <= 0 or (s + gain) / (t + t_d) <= s / t:
            return 0.0
        return min(t_d, max_wait_s)

    def summary(self) -> dict[str, Any]:
        """The plan's numbers as the controller's snapshot shows them (``last_choice``)."""
        n = len(self.lookaheads)
        return {
            "mode": self.mode, "models_on": self.models, "num_reqs": n,
            "num_drafted": self.num_drafted, "decode_tokens": self.decode_tokens,
            "total_tokens": self.background_tokens + self.decode_tokens,
            "background_tokens": self.background_tokens,
            "expected_tokens": self.expected_tokens, "target_seconds": self.target_seconds,
            "step_seconds": self.step_seconds,
            "mean_lookahead": sum(self.lookaheads.values()) / n, "histogram": self.histogram,
        }


def cumulative_acceptance(model: AcceptanceModel, ids: list[str],
                          caps: list[int]) -> list[list[float]]:
    """Per request, ``q[j] = prod_{i<=j} p_i`` for ``j = 1..cap``."""
    cum: list[list[float]] = []
    for req_id, cap in zip(ids, caps, strict=True):
        qs, q = [], 1.0
        for p in model.request_acceptance(req_id)[:cap]:
            q *= p
            qs.append(q)
        cum.append(qs)
    return cum


def expected_table(cum: list[list[float]]) -> list[list[float]]:
    """Per request, ``E(k) = 1 + sum_{j<=k} q[j]`` for ``k = 0..cap``."""
    expected = []
    for qs in cum:
        e = [1.0]
        for q in qs:
            e.append(e[-1] + q)
        expected.append(e)
    return expected


def step_seconds(target_s: float, draft_s: float, pipelined: bool) -> float:
    """A step's seconds: the target's, plus the drafting it does not hide (all of it when not
    ``pipelined``)."""
    return target_s + (max(0.0, draft_s - target_s) if pipelined else draft_s)


def greedy_lookaheads(cum: list[list[float]], caps: list[int], lows: list[int],
                      target: Callable[[float], float], background: float,
                      draft_cost: DraftCostModel | None,
                      pipelined: bool) -> tuple[list[int], float]:
    """The allocation with the best predicted rate along the greedy path, and that rate.

    ``target(tokens)``: the target step's seconds; ``background``: the step's prompt tokens
    (work done, like output tokens); ``draft_cost``: the model drafters' call, whose visible
    time counts (None: a plan without model drafting).
    """
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
    exp_tokens = background + sum(1.0 + sum(qs[:lo]) for qs, lo in zip(cum, lows, strict=True))
    tokens = background + sum(1 + lo for lo in lows)
    num_drafted = sum(1 for lo in lows if lo > 0)
    max_k = max(lows)
    t0 = target(tokens)
    if draft_cost is not None:
        t0 = step_seconds(t0, draft_cost(max_k, num_drafted), pipelined)
    best_rate = exp_tokens / max(t0, 1e-300)
    best_len = 0
    levels = list(lows)
    # The loop below is step_seconds inlined (it runs for every draft token of the batch).
    measured = draft_cost is not None and draft_cost.num_observations > 0
    c0, c1, c2 = draft_cost.coefficients if draft_cost is not None else (0.0, 0.0, 0.0)
    threshold = best_rate * (1.0 + MIN_RELATIVE_GAIN)
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
            threshold = best_rate * (1.0 + MIN_RELATIVE_GAIN)
    for _, r, j in gains[:best_len]:
        ks[r] = j
    return ks, best_rate
