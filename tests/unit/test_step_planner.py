"""The controller of in-worker drafting: plans, confidence stops, calibration (pure, no engine)."""

import pytest

from vllm_smurfs.length_controller import StepFeedback, StepTiming
from vllm_smurfs.step_planner import (
    ConfidenceCalibration,
    DrafterOutcome,
    PlanRequest,
    StepPlanner,
    _charged_catch_up,
)

K = 6


def request(i: int, free_len: int = 0, catch_up: int | None = 2, remaining: int | None = None,
            num_tokens: int = 100) -> PlanRequest:
    return PlanRequest(f"r{i}", num_tokens, 4096, free_len, (catch_up,), remaining)


def teach(planner: StepPlanner, *, target_s: float = 0.14, slope_s: float = 0.001,
          pass_s: float = 0.05, models_accept: int = 0, free_accept: int = 0,
          requests: int = 1, steps: int = 20) -> None:
    """Feed measured costs and outcomes: the target's steps cost ``target_s + slope_s`` per token,
    a drafter forward ``pass_s``; the voted chain of model steps gets ``models_accept`` of 6
    accepted, the n-gram chain ``free_accept`` of 6."""
    for tokens in range(1, 12):
        for _ in range(3):
            planner.target_cost.observe(tokens * requests, target_s + slope_s * tokens * requests)
            for d in range(len(planner.drafters)):
                planner.observe_pass(d, tokens, pass_s)
    for _ in range(steps):
        ids = [f"r{i}" for i in range(requests)]
        planner.observe(
            [(r, DrafterOutcome(6, free_accept, free_accept + 1)) for r in ids],
            [StepFeedback(r, 6, models_accept) for r in ids])


def test_calibration_starts_calibrated_and_learns_monotone():
    cal = ConfidenceCalibration(bins=10, prior_strength=4.0)
    assert cal(0.05) == pytest.approx(0.05)
    assert cal(0.95) == pytest.approx(0.95)
    for _ in range(200):
        cal.observe(0.35, True)  # a drafter that is right more often than it thinks
    assert cal(0.35) > 0.9
    for _ in range(400):
        cal.observe(0.65, False)  # ... and less right where it is surer: pooled, not inverted
    curve = cal.curve()
    assert all(a <= b + 1e-12 for a, b in zip(curve, curve[1:]))  # never less right when surer
    assert cal(0.35) == pytest.approx(cal(0.65)) and cal(0.35) < 0.9


def test_free_plan_without_model_drafters_takes_the_ngram_draft_when_verification_is_cheap():
    planner = StepPlanner(K, num_model_drafters=0)
    teach(planner, free_accept=5)
    plan = planner.plan([PlanRequest("r0", 100, 4096, free_len=4)], K)
    assert plan.mode == "free" and not plan.models
    assert plan.lookaheads == [4]
    # No n-gram draft, nothing to propose.
    plan = planner.plan([PlanRequest("r0", 100, 4096, free_len=0)], K)
    assert plan.lookaheads == [0]


def test_models_draft_when_they_pay_and_sit_out_when_the_ngram_draft_is_as_good():
    planner = StepPlanner(K, num_model_drafters=1)
    teach(planner, models_accept=4, free_accept=0)
    plan = planner.plan([request(0, free_len=0)], K)
    assert plan.mode == "models" and plan.model_rows == [[0]] and plan.lookaheads[0] >= 2
    # The n-gram chain is as good and free: the model drafter sits out this step.
    planner = StepPlanner(K, num_model_drafters=1)
    teach(planner, models_accept=4, free_accept=6)
    plan = planner.plan([request(0, free_len=6)], K)
    assert plan.mode == "free" and plan.model_rows == [[]] and plan.lookaheads == [6]


def test_models_sit_out_when_a_forward_costs_more_than_their_tokens_bring():
    planner = StepPlanner(K, num_model_drafters=1)
    teach(planner, models_accept=1, pass_s=0.5)  # a forward costs 3.5 target steps
    plan = planner.plan([request(0)], K)
    assert plan.mode == "free" and not plan.models


def test_models_explore_until_their_acceptance_is_measured_then_probe_within_a_budget():
    planner = StepPlanner(K, num_model_drafters=1)
    teach(planner, models_accept=0, pass_s=0.5, steps=0)  # costs known, acceptance not
    assert planner.plan([request(0)], K).mode == "explore"
    teach(planner, models_accept=0, pass_s=0.5, steps=20)  # measured: they never pay
    modes = []
    for _ in range(200):
        modes.append(planner.plan([request(0)], K).mode)
        planner.observe_step(StepTiming(1, 2, 1.0))  # 1 s steps: 1% pays a probe every 100 s
    probes = modes.count("probe")
    assert probes == 1 and set(modes) == {"free", "probe"}


def test_exploration_drafts_for_the_requests_cheapest_to_catch_up_with():
    planner = StepPlanner(K, num_model_drafters=1)
    teach(planner, steps=0)
    requests = [request(0, catch_up=400), request(1, catch_up=3), request(2, catch_up=300),
                request(3, catch_up=5)]
    plan = planner.plan(requests, K)
    assert plan.mode == "explore"
    assert sorted(plan.model_rows[0]) == [1, 2, 3]  # 3 + 5 + 300 tokens; 400 more is too many
    # Under load, not every prompt at once: 512 catch-up tokens in all, at least one request.
    plan = planner.plan([request(i, catch_up=900) for i in range(8)], K)
    assert len(plan.model_rows[0]) == 1


def test_a_long_catch_up_is_charged_over_the_requests_later_steps():
    assert _charged_catch_up(5, K, None) == 5  # a normal step's catch-up is charged in full
    assert _charged_catch_up(None, K, None) == 0
    spread = _charged_catch_up(1007, K, remaining=2000)
    assert spread == pytest.approx(7 + 1000 / 32)
    assert _charged_catch_up(1007, K, remaining=1) == 1007  # one step left: all of it now
    # Spread over the steps the models are expected to draft in: a quarter of them, 4x the charge.
    assert _charged_catch_up(1007, K, remaining=2000, model_share=0.25) == pytest.approx(
        7 + 1000 / 8)
    assert _charged_catch_up(1007, K, remaining=2000, model_share=0.0) == 1007
    planner = StepPlanner(K, num_model_drafters=1)
    # A forward's cost grows with the tokens it computes (1000 tokens: 4 s).
    for tokens in (1, 2, 4, 8, 16, 64, 256, 1000):
        for _ in range(3):
            planner.observe_pass(0, tokens, 0.05 + 0.004 * tokens)
    teach(planner, models_accept=4)
    long_left = planner.plan([request(0, catch_up=1000, remaining=2000)], K)
    one_left = planner.plan([request(0, catch_up=1000, remaining=1)], K)
    assert long_left.models and not one_left.models


def test_confident_drafts_go_on_and_unsure_ones_stop():
    planner = StepPlanner(K, num_model_drafters=1)
    teach(planner, models_accept=4, pass_s=0.02)
    plan = planner.plan([request(0), request(1)], K)
    assert plan.models
    unsure, sure = [0.3, 0.2], [0.97, 0.95]
    assert planner.keep_drafting(plan, 0, [0, 1], [sure, sure], 0.1) == [0, 1]
    assert planner.keep_drafting(plan, 0, [0, 1], [unsure, unsure], 0.1) == []
    # A forward that runs for a confident draft takes an unsure one along when verifying its
    # next token costs less than it is worth (at two requests verification is nearly free).
    assert planner.keep_drafting(plan, 0, [0, 1], [sure, unsure], 0.1) == [0, 1]
    # With forwards ten times dearer, even the confident one stops.
    for tokens in range(1, 12):
        for _ in range(16):
            planner.observe_pass(0, tokens, 5.0)
    plan = planner.plan([request(0)], K)
    assert planner.keep_drafting(plan, 0, [0], [[0.8, 0.8]], drafted_s=10.0) == []


def test_calibration_learns_up_to_the_first_rejection_and_only_what_was_observed():
    planner = StepPlanner(K, num_model_drafters=1)
    cal = planner.drafters[0].calibration
    planner.observe([], [], [[DrafterOutcome(4, 1, 6, (0.9, 0.9, 0.9, 0.9))]])
    assert cal.num_observations == 2  # accepted, rejected; after that nothing is known
    planner.observe([], [], [[DrafterOutcome(4, 2, 2, (0.9, 0.9, 0.9, 0.9))]])
    assert cal.num_observations == 4  # the target produced 2 tokens: positions 3, 4 unknown


def test_step_timing_teaches_the_target_curve_and_the_background():
    planner = StepPlanner(K, num_model_drafters=0)
    plan = planner.plan([PlanRequest("r0", 10, 4096, free_len=0)], K)
    assert plan.lookaheads == [0]
    # The step computed 101 tokens where 1 was planned: 100 prompt tokens rode along.
    planner.observe_step(StepTiming(1, 101, 1.0, overhead_s=0.01))
    assert planner.snapshot()["last_plan"]["background_tokens"] == 0.0
    planner.plan([PlanRequest("r0", 11, 4096)], K)
    assert planner.snapshot()["last_plan"]["background_tokens"] == pytest.approx(50.0)


def test_min_lookahead_keeps_the_models_in_every_step_and_arguments_are_checked():
    planner = StepPlanner(K, num_model_drafters=1, min_lookahead=1)
    teach(planner, models_accept=0, pass_s=1.0)
    plan = planner.plan([request(0)], K)
    assert plan.models and plan.lookaheads[0] >= 1
    with pytest.raises(ValueError, match="max_lookahead"):
        StepPlanner(0, 1)
    with pytest.raises(ValueError, match="min_lookahead"):
        StepPlanner(4, 1, min_lookahead=5)


def test_drafting_must_promise_a_margin_over_not_drafting():
    planner = StepPlanner(K, num_model_drafters=0)
    for tokens in range(1, 12):
        for _ in range(3):
            planner.target_cost.observe(tokens, 1.0)  # verification is free here
    # One draft token worth 2% more tokens is not worth the prediction's error; 50% is.
    assert planner._allocate([[0.02]], [0], lambda *_: 0.0)[0] == [0]
    assert planner._allocate([[0.5]], [0], lambda *_: 0.0)[0] == [1]
