"""The rules a step's plan is applied by while it runs: how far an in-worker drafter drafts
(`keep_drafting`) and how long the step waits for streamed drafts (`wait_s`).

The plan (`length_controller.LengthController.plan`) fixes each request's lookahead and ``rho``,
what a second of the step is worth in tokens; these rules then decide, forward by forward and
drafter step by drafter step, whether what comes next is worth its time: a draft goes on while
its next token's chance (the drafter's probabilities, calibrated against what the target
accepted) beats ``rho`` times its verification, and a forward runs while the tokens it and the
next ones bring beat ``rho`` times their forwards; one more streaming drafter step is waited for
while the tokens it brings beat ``rho`` times its seconds.

Pure module (stdlib only).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vllm_smurfs.control.acceptance import ConfidenceCalibration
from vllm_smurfs.control.plan import Plan
from vllm_smurfs.control.step_costs import StepCostModel


def keep_drafting(plan: Plan, active: Sequence[int], confidences: Sequence[Sequence[float]],
                  calibration: Callable[[int], ConfidenceCalibration], cost: StepCostModel,
                  max_lookahead: int) -> list[int]:
    """Which of the ``active`` requests get one more token from an in-worker drafter
    (indices into ``confidences``: the drafter's probability of each token it drafted so
    far, per request of its ``plan.model_rows``); ``calibration(i)``: the calibration of
    request i's confidences, ``cost``: the drafter's forward seconds by token count.

    A request's next ``h`` tokens are worth ``q * (a + ... + a^h)``: ``q`` the chance that
    its draft so far is accepted (the calibrated probabilities multiplied), ``a`` the chance
    of a next token given its predecessors (its last token's calibrated probability: the
    drafter's certainty runs in streaks). A request goes on while its next token's worth
    beats ``rho`` times its verification; the forward runs while, for some ``h``, the
    requests that go on bring more over the next ``h`` forwards than ``rho`` times those
    forwards and their verification (a confidently continuing draft pays over several).
    """
    if not active:
        return []
    rho = plan.rho
    keep: list[tuple[int, float, float]] = []
    for i in active:
        confs = confidences[i]
        if not confs:
            continue
        cal = calibration(i)
        q = 1.0
        for c in confs:
            q *= cal(c)
        a = cal(confs[-1])
        if q * a > rho * plan.verify_s:
            keep.append((i, q, a))
    if not keep:
        return []
    if cost.is_empty or rho <= 0:
        return [i for i, _, _ in keep]
    pass_s = cost(len(keep)) + len(keep) * plan.verify_s
    for h in range(1, max_lookahead + 1):
        worth = sum(q * sum(a ** j for j in range(1, h + 1)) for _, q, a in keep)
        if worth > rho * h * pass_s:
            return [i for i, _, _ in keep]
    return []


def wait_s(plan: Plan, t_d: float, late: Sequence[tuple[int, int]], max_wait_s: float) -> float:
    """Seconds to wait for the streaming drafters' next engine step (``t_d`` seconds, as
    measured), given the ``late`` requests (row, tokens ready) whose plan wants more than
    is ready: one drafter step while the tokens it brings beat ``rho`` times it, else 0."""
    if not late or max_wait_s <= 0:
        return 0.0
    if t_d <= 0 or plan.rho <= 0:
        return max_wait_s
    gain = 0.0
    for row, ready in late:
        qs = plan.gains.get(row)
        k = plan.lookaheads[row] if row < len(plan.lookaheads) else 0
        if qs is not None and ready < min(k, len(qs)):
            gain += qs[ready]
    if gain <= plan.rho * t_d:
        return 0.0
    return min(t_d, max_wait_s)
