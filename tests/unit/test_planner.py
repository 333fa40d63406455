"""`control.planner.StepSearch`: one step's plans priced on given curves (pure, milliseconds)."""

from __future__ import annotations

import pytest

from vllm_smurfs.control.plan import PlanRequest, cumulative
from vllm_smurfs.control.plan_search import Point
from vllm_smurfs.control.planner import DRAFT_MARGIN, EXPERIMENT_CATCH_UP_TOKENS, StepSearch


def flat_target(tokens: float) -> float:
    """A memory-bound step: 100 ms up to 32 tokens, then 5 ms a token."""
    return 0.1 + 0.005 * max(0.0, tokens - 32)


def steep_target(tokens: float) -> float:
    """A step whose every token costs as much as a whole step."""
    return 0.1 * tokens


def drafter(tokens: float) -> float:
    return 0.02 + 0.0005 * tokens


def search(requests, hand, *, target=flat_target, pass_costs=(drafter,), caps=None):
    caps = caps or [4] * len(requests)
    return StepSearch(requests, caps, hand, target=target, target_max_tokens=64, prompt=0.0,
                      overhead_s=0.0, pass_costs=list(pass_costs), sync_cost=None,
                      chainless=lambda req_id: 1.0, max_lookahead=4, min_lookahead=0,
                      force_models=False)


def request(i: int, catch_up: int = 1, free_len: int = 0) -> PlanRequest:
    return PlanRequest(f"r{i}", num_tokens=100, max_model_len=4096, free_len=free_len,
                       catch_up=(catch_up,), remaining=64)


def test_the_plan_in_hand_drafts_where_verifying_is_cheap_and_not_where_it_is_dear() -> None:
    hand = [cumulative([0.8] * 4, 4)]
    cheap = search([request(0, free_len=4)], hand)
    assert cheap.in_hand and cheap.hand_ks == [4]
    assert cheap.hand_value > cheap.value(Point(1.0, 1.0))
    # rho is the best rate of the plan in hand: 1 + 0.8 + 0.64 + ... tokens in 0.1 s.
    assert cheap.rho == pytest.approx(sum([1.0, *hand[0]]) / 0.1)
    dear = search([request(0, free_len=4)], hand, target=steep_target)
    assert not dear.in_hand and dear.hand_ks == [0]
    assert dear.rho == pytest.approx(1 / 0.1)


def test_a_model_plan_is_taken_where_its_drafts_pay_and_priced_with_the_forwards() -> None:
    reqs = [request(0)]
    s = search(reqs, [[]])
    good = s.model_choice([0], [cumulative([0.9] * 4, 4)])
    assert good is not None and good.rows == [0] and good.ks[0] >= 1
    assert good.value > s.hand_value + s.margin
    # Its seconds are the first forward and one extension per further token.
    assert good.extra_s == pytest.approx(drafter(1) + (good.ks[0] - 1) * drafter(1))
    poor = s.model_choice([0], [cumulative([0.05] * 4, 4)])
    assert poor is None or poor.value < s.hand_value + s.margin
    assert s.margin == pytest.approx(DRAFT_MARGIN * s.rho * 0.1)


def test_an_experiment_takes_the_requests_cheapest_to_catch_up_within_its_budget() -> None:
    reqs = [request(0, catch_up=600), request(1, catch_up=100), request(2, catch_up=120)]
    s = search(reqs, [[], [], []])
    curves = [cumulative([0.7] * 4, 4)] * 3
    exp = s.experiment([0, 1, 2], curves)
    assert exp is not None and exp.rows == [1, 2]
    assert 100 + 120 <= EXPERIMENT_CATCH_UP_TOKENS < 100 + 120 + 600
    # At least one request, whatever its catch-up.
    only_long = s.experiment([0], curves)
    assert only_long is not None and only_long.rows == [0]
    assert s.experiment([], curves) is None
    # Its price: what it loses against the plan in hand, in seconds at the step's rate.
    assert s.experiment_price_s(only_long) == pytest.approx(
        max(0.0, s.hand_value - only_long.value) / s.rho)
    assert s.experiment_price_s(only_long) > s.experiment_price_s(exp) >= 0.0
