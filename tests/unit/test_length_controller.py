"""The one lookahead controller (`length_controller.LengthController`): plans, prices, learning,
exploration, the stop and wait rules, the streaming switch. Pure: milliseconds, no engine.

The costs in these tests are the ones measured here on the real models (2-core CPU,
env/BASELINES.md): a target step of 141 ms for 1-5 tokens, a 0.5B drafter forward of 53 ms for
1-3 tokens and 77 ms for 6-52, and the target turning compute-bound past ~32 tokens.
"""

from __future__ import annotations

import random

import pytest

from vllm_smurfs.control.acceptance import ConfidenceCalibration, PlanYield
from vllm_smurfs.control.feedback import DraftTiming, StepTiming
from vllm_smurfs.control.fixed import FixedLookahead
from vllm_smurfs.control.plan import DrafterOutcome, PlanRequest, RequestOutcome
from vllm_smurfs.control.plan_search import charged_catch_up
from vllm_smurfs.control.step_costs import StepCostModel
from vllm_smurfs.length_controller import (
    EXPERIMENT_CATCH_UP_TOKENS,
    EXPLORE_ALLOWANCE_S,
    EXPLORE_BUDGET,
    INVESTMENT_EVIDENCE_STEPS,
    LengthController,
)

K = 6


def target_s(tokens: float) -> float:
    """The target's step: flat to 32 tokens, then 7 ms a token (compute-bound)."""
    return 0.141 + 0.007 * max(0.0, tokens - 32)


def pass_s(tokens: float) -> float:
    """The drafter's forward: 53 ms up to 3 tokens, 77 ms to 52, then 0.5 ms a token."""
    if tokens <= 3:
        return 0.053
    return 0.077 + 0.0005 * max(0.0, tokens - 52)


def measured(num_drafters: int = 1, **kwargs) -> LengthController:
    """A controller whose target and drafter curves are measured (each shape seen 3 times)."""
    c = LengthController(K, num_drafters, **kwargs)
    for n in list(range(1, 33)) + [48, 64, 96, 128, 256, 512, 1024, 2048]:
        for _ in range(3):
            c.observe_step(StepTiming(1, n, target_s(n)))
            for d in range(num_drafters):
                c.observe_pass(d, n, pass_s(n))
    return c


def teach(c: LengthController, req_id: str, *, models: float | None = None,
          free: float | None = None, with_free: bool = False, steps: int = 40,
          seed: int = 0) -> None:
    """Verified drafts of K tokens with i.i.d. acceptance per position."""
    rng = random.Random(seed)

    def accepted(p: float) -> int:
        a = 0
        while a < K and rng.random() < p:
            a += 1
        return a

    for _ in range(steps):
        outcomes = []
        if models is not None:
            a = accepted(models)
            outcomes.append(RequestOutcome(req_id, voted=(K, a), models=True,
                                           with_free=with_free))
        if free is not None:
            a = accepted(free)
            outcomes.append(RequestOutcome(req_id, free=DrafterOutcome(K, a, a + 1),
                                           voted=(K, a)))
        c.observe(outcomes)


def req(req_id: str = "r", *, free_len: int = 0, catch_up: int | None = 3, num_tokens: int = 200,
        remaining: int | None = 500, **kwargs) -> PlanRequest:
    return PlanRequest(req_id, num_tokens, 4096, free_len=free_len, catch_up=(catch_up,),
                       remaining=remaining, **kwargs)


# -- plans ---------------------------------------------------------------------------------------
def test_the_model_drafter_drafts_where_the_step_offers_no_chain():
    # The case: a one-token model draft pays whenever the n-gram has nothing (53 ms
    # against a 141 ms step at a first-position acceptance of ~0.7).
    c = measured()
    teach(c, "r", models=0.7)
    plan = c.plan([req()], K)
    assert plan.model_rows == [[0]] and plan.lookaheads == [K]
    assert plan.mode == "models"


def test_a_strong_model_free_chain_keeps_the_models_out_and_a_weak_one_does_not():
    c = measured()
    teach(c, "strong", free=0.95, models=0.7, with_free=True)
    teach(c, "weak", free=0.2, models=0.7, with_free=True, seed=1)
    # Conditioned per request on what the step offers it.
    strong = c.plan([req("strong", free_len=K)], K)
    assert not strong.models and strong.lookaheads == [K]  # the copy goes in full
    assert c.plan([req("weak", free_len=2)], K).model_rows == [[0]]
    # In one batch, a forward that lengthens the step of a strong copy for another request's
    # small gain does not pay: the step's rate is what a second of it is worth.
    assert not c.plan([req("strong", free_len=K), req("weak", free_len=2)], K).models


def test_the_models_sit_out_when_a_forward_costs_more_than_their_tokens_bring():
    c = measured(0)
    c.pass_costs, c.num_worker_drafters = [StepCostModel()], 1
    c.band(0).calibrations = c.calibrations or [ConfidenceCalibration()]
    for n in range(1, 65):
        for _ in range(3):
            c.observe_pass(0, n, 1.0)  # a drafter forward dearer than several target steps
    teach(c, "r", models=0.7)
    plan = c.plan([req()], K)
    assert not plan.models
    assert plan.mode in ("none", "explore")


def test_under_load_only_likely_tokens_are_drafted():
    # 32 requests: the target is compute-bound, a draft token costs 7 ms against a rate of
    # 32 tokens per 141 ms; model drafting would need most of its drafts accepted.
    c = measured()
    reqs = [req(f"r{i}", free_len=K) for i in range(32)]
    for i in range(32):
        teach(c, f"r{i}", free=0.3, models=0.5, steps=10, seed=i)
    plan = c.plan(reqs, K)
    assert not plan.models
    assert sum(plan.lookaheads) < 32 * 2


def test_prompt_tokens_count_as_work_not_as_output():
    # Cause 1 of the issue: with prompt tokens counted as output, 512 of them turned model
    # drafting off and 2048 turned speculation off. A draft is judged against what a decode step
    # of the batch reaches, so a prompt chunk in the step changes the plan only through what the
    # drafts add to the step's time.
    c = measured()
    teach(c, "r", models=0.7)
    for prompt in (0, 512):
        c._prompt = float(prompt)
        assert c.plan([req()], K).models, prompt
    c._prompt = 2048.0  # compute-bound: each draft token costs 7 ms; the first ones still pay
    plan = c.plan([req()], K)
    assert plan.lookaheads[0] > 0


def test_nothing_is_drafted_while_a_prompt_is_pending():
    # A chunked prefill still going: the next steps run for the prompts whatever is drafted, so
    # a draft cannot save one; the same request and chain draft again once it is done.
    c = measured()
    teach(c, "r", models=0.9, free=0.9)
    reqs = [req(), req("s", free_len=K)]
    held = c.plan(reqs, K, prompt_pending=True)
    assert held.lookaheads == [0, 0] and not held.models and held.mode == "prompt"
    assert c.snapshot()["prompt_pending_steps"] == 1
    assert c.plan(reqs, K).lookaheads[1] > 0
    assert c.plan([req()], K).models
    assert not c.plan([req()], K, prompt_pending=True).models
    # A configuration that forces the model drafters keeps them in those steps too.
    forced = measured(min_lookahead=1)
    assert forced.plan(reqs, K, prompt_pending=True).model_rows == [[0, 1]]


def test_prompt_tokens_are_learnt_from_the_step_itself():
    c = measured()
    c.observe_step(StepTiming(1, 600, target_s(600), prompt_tokens=596))
    assert c.snapshot()["prompt_tokens"] == pytest.approx(298.0)  # half of the last step's
    c.observe_step(StepTiming(1, 4, target_s(4), prompt_tokens=0))
    assert c.snapshot()["prompt_tokens"] == pytest.approx(149.0)


def test_no_draft_past_max_tokens():
    # Cause 5: a request near its end gets no draft it cannot use.
    c = measured()
    teach(c, "r", models=0.9)
    plan = c.plan([req(remaining=1), req("s", remaining=3), req("t", remaining=None)], K)
    assert plan.lookaheads == [0, 2, K]
    assert plan.model_rows == [[1, 2]]


def test_a_long_catch_up_is_an_investment_spread_over_the_request():
    # Cause 4: the catch-up is priced at the tokens the first forward computes, the part beyond
    # a normal step's spread over the request's remaining steps, whatever share of steps the
    # models drafted in before (no feedback loop). (At 0.7 the same catch-up, 351 ms where a
    # normal first forward takes 77 ms, no longer pays back within the spread's 32 steps.)
    c = measured()
    teach(c, "r", models=0.8)
    assert c.plan([req(catch_up=600, remaining=500)], K).models
    # Near its end the same catch-up does not pay back.
    assert not c.plan([req(catch_up=600, remaining=3)], K).models
    # Many steps without models change nothing of the price.
    teach(c, "x", free=0.9, steps=200)
    for _ in range(200):
        c.plan([req("x", free_len=K, catch_up=50)], K)
    assert c.plan([req(catch_up=600, remaining=500)], K).models


def test_min_lookahead_keeps_the_models_in_every_step():
    c = measured(min_lookahead=1)
    for n in range(1, 65):
        for _ in range(3):
            c.observe_pass(0, n, 1.0)
    plan = c.plan([req(), req("s", free_len=K)], K)
    assert plan.model_rows == [[0, 1]]


def test_the_first_step_drafts_only_what_is_in_hand_and_the_second_is_priced():
    c = LengthController(K, 1)
    for n in (1, 2, 3, 4, 8, 16, 32, 64):
        for _ in range(2):
            c.observe_pass(0, n, pass_s(n))  # the start-up warm-up
    reqs = [req(f"r{i}", catch_up=300, free_len=i % 2 * 3) for i in range(8)]
    plan = c.plan(reqs, K)
    assert plan.mode == "warmup" and not plan.models
    assert plan.lookaheads == [0, 3] * 4
    # The engine's first decode step is timed: a first call, dropped from the curve once
    # anything else is measured, but standing in until then.
    c.observe_step(StepTiming(8, 20, 0.25))
    assert c.plan([req()], K).mode != "warmup"


# -- clean measurements --------------------------------------------------------------------------
def test_a_poisoned_first_forward_does_not_set_the_curve():
    # Cause 3: one 30 s first forward among 0.14 s ones made the fit predict 2.3 s for every
    # count from 8 to 256. A shape's first call is dropped, and a slow point is lowered to the
    # points after it rather than raising them.
    curve = StepCostModel()
    curve.observe(8, 30.0)  # the first call at 8 tokens: dropped
    for n in range(1, 257):
        for _ in range(2):
            curve.observe(n, 0.14 + 0.001 * n / 32)
    assert curve(8) < 0.2 and curve(256) < 0.2
    later = StepCostModel()
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        later.observe(n, 0.14)
        later.observe(n, 0.14)
    later.observe(8, 30.0)  # a stall on a later call: the median of its bucket holds
    later.observe(8, 0.14)
    assert later(8) < 0.2 and later(256) < 0.2
    # A prefill-sized call seen once counts at most twice what the rest predicts; of two
    # observations the slower is the suspect; it raises nothing below it.
    later.observe(2048, 30.0)
    assert later(2048) < 1.0
    later.observe(2048, 14.0)
    assert later(2048) == pytest.approx(14.0) and later(64) < 0.2
    later.observe(2048, 15.0)
    assert later(2048) == pytest.approx(15.0)


def test_the_curve_forgets_what_the_machine_no_longer_does():
    curve = StepCostModel(max_age=100)
    for _ in range(5):
        curve.observe(8, 1.0)  # a co-located job, long ago
    for _ in range(200):
        curve.observe(4, 0.1)
        curve.observe(16, 0.12)
    assert curve(8) < 0.2


def test_a_knot_not_visited_for_a_while_moves_with_the_machine():
    # Seen at temperature 1 (2026-12-07-vocab, 115ebb1/t1.0-free pass 1): the first prompt's
    # steps ran at 99 ms (1 token), 107 ms (2) and 128 ms (3); then the machine sped up and the
    # 1-token knot followed it to ~72 ms while the 2-token one, seldom visited, stayed at 107:
    # one model draft token (a 2-token step) looked 41-55% dearer than none, and the models were
    # priced out for three prompts. A common level moves every knot with the machine.
    rng = random.Random(0)
    first = {1: 0.099, 2: 0.107, 3: 0.128}
    curve = StepCostModel()
    for _ in range(55):
        n = rng.choice([1, 1, 1, 2, 3])
        curve.observe(n, first[n] * rng.uniform(1.0, 1.08))
    assert curve(2) / curve(1) == pytest.approx(1.08, abs=0.05)
    for _ in range(150):
        curve.observe(1, 0.072 * rng.uniform(1.0, 1.08))
    assert curve(1) == pytest.approx(0.075, rel=0.06)
    assert curve(2) / curve(1) == pytest.approx(1.08, abs=0.05)
    assert curve(3) / curve(1) == pytest.approx(1.29, abs=0.07)
    # Without the level (the static fit the simulator uses), the old knot stays.
    static = StepCostModel(drift_rate=0.0)
    for n, s in [(1, 0.099)] * 3 + [(2, 0.107)] * 3 + [(1, 0.072)] * 150:
        static.observe(n, s)
    assert static(2) == pytest.approx(0.107)
    # In the controller: with the models' first-position acceptance at 0.62 and no chain in
    # hand, a one-token model draft pays once the 2-token step is priced at the machine's speed.
    c = LengthController(K, 1)
    for n in range(1, 65):
        for _ in range(3):
            c.observe_pass(0, n, 0.025 + 0.0008 * n)
    for n in (1, 2, 3):
        for _ in range(5):
            c.observe_step(StepTiming(1, n, first[n]))
    for _ in range(150):
        c.observe_step(StepTiming(1, 1, 0.072))
    teach(c, "r", models=0.62)
    assert c.plan([req()], K).models


def test_the_level_holds_under_pauses_and_noise_and_rejects_bad_settings():
    rng = random.Random(1)
    curve = StepCostModel()
    levels = []
    for _ in range(5000):
        n = rng.choice([1, 1, 2, 3, 4, 7])
        s = (0.07 + 0.004 * n) * rng.uniform(1.0, 1.1)
        if rng.random() < 0.03:
            s *= rng.uniform(1.5, 4.0)  # a pause
        curve.observe(n, s)
        levels.append(curve.level)
    assert max(abs(v) for v in levels) < 0.25  # no accumulated noise: an average, not a sum
    for n in (1, 2, 3, 4, 7):
        assert curve(n) == pytest.approx(0.07 + 0.004 * n, rel=0.08)
    with pytest.raises(ValueError, match="drift_rate"):
        StepCostModel(drift_rate=1.5)


def test_a_poisoned_drafter_warm_up_does_not_lock_the_models_out():
    c = LengthController(K, 1)
    for n in range(1, 33):
        for _ in range(3):
            c.observe_step(StepTiming(1, n, target_s(n)))
    c.observe_pass(0, 1, 30.0)  # the first forward ever: kernels built
    for n in list(range(1, 9)) + [16, 32, 64]:
        for _ in range(2):
            c.observe_pass(0, n, pass_s(n))
    teach(c, "r", models=0.7)
    assert c.plan([req()], K).models


# -- exploration ---------------------------------------------------------------------------------
def test_exploration_retries_the_models_within_its_budget_and_cannot_lock_them_out():
    c = measured()
    # The models look bad (a pessimistic early estimate) while the free chain is fine.
    teach(c, "x", models=0.05, steps=30)
    explored_at = []
    for s in range(3000):
        plan = c.plan([req(f"r{s // 30}", free_len=2, catch_up=3)], K)
        c.observe_step(StepTiming(1, 1 + plan.lookaheads[0], target_s(3)))
        if plan.mode == "explore":
            explored_at.append(s)
            c.observe([RequestOutcome(f"r{s // 30}", voted=(K, 4), models=True,
                                      with_free=True)])
    assert explored_at, "the models were never tried again"
    spent = c.explore_spent_s
    assert spent <= EXPLORE_BUDGET * c.snapshot()["elapsed_s"] + EXPLORE_ALLOWANCE_S
    # Once the retries showed the models pay (4 of 6 accepted), they are exploited.
    assert c.plan([req("y", free_len=2, catch_up=3)], K).mode == "models"


def test_unused_evidence_fades_so_the_optimistic_bound_widens():
    c = measured()
    teach(c, "x", models=0.1, steps=200)
    model = c.acceptance_models[False]
    width_before = model.global_acceptance(1.0)[0] - model.global_acceptance()[0]
    for _ in range(2000):
        model.tick(["y"])
    width_after = model.global_acceptance(1.0)[0] - model.global_acceptance()[0]
    assert width_after > 2 * width_before


# -- while drafting ------------------------------------------------------------------------------
def test_confident_drafts_go_on_and_unsure_ones_stop():
    c = measured()
    teach(c, "a", models=0.7)
    plan = c.plan([req("a"), req("b")], K)
    assert plan.model_rows == [[0, 1]]
    # An unsure draft rides along in a forward a confident one pays for (its verification is
    # nearly free at batch 2), and does not pay for a forward of its own.
    assert c.keep_drafting(plan, 0, [0, 1], [[0.99, 0.98], [0.1]]) == [0, 1]
    assert c.keep_drafting(plan, 0, [1], [[0.99], [0.1]]) == []


def test_the_calibration_learns_up_to_the_first_rejection():
    c = measured()
    c.observe([RequestOutcome("r", voted=(3, 1), models=True,
                              drafters=(DrafterOutcome(3, 1, 2, (0.95, 0.95, 0.95)),))] * 50)
    cal = c.calibrations[0]
    assert cal(0.95) < 0.7  # half of the 0.95 tokens it judged were accepted
    assert cal.num_observations == 100  # positions 1 and 2 of each; position 3 unseen


def test_waits_for_streamed_drafts_while_the_next_token_pays():
    c = measured(0, streaming=True)
    for _ in range(20):
        c.observe_draft(DraftTiming(1, 1, 0.01))
    teach(c, "r", models=0.9)
    plan = c.plan([req(catch_up=None, streamed_len=2)], K)
    assert plan.streaming and plan.lookaheads == [K]
    # One more drafter step (10 ms) brings the third token (0.67 likely) against a rate of 35
    # tokens a second: worth it.
    assert c.wait_s(plan, [(0, 2)], 1.0) == pytest.approx(0.01, rel=0.05)
    for _ in range(64):
        c.observe_draft(DraftTiming(1, 1, 5.0))  # a drafter step now dearer than its tokens
    assert c.wait_s(plan, [(0, 2)], 10.0) == 0.0


# -- the streaming switch ------------------------------------------------------------------------
def test_streaming_drafters_are_switched_off_when_they_do_not_pay_and_retried_later():
    c = measured(0, streaming=True)
    # While they draft, the target's step costs twice as much (cores lent).
    for n in range(1, 33):
        for _ in range(3):
            c.observe_step(StepTiming(1, n, 2 * target_s(n), drafting=True))
    teach(c, "r", models=0.5, free=0.5)
    states = []
    for s in range(600):
        plan = c.plan([req(f"r{s // 40}", catch_up=None, free_len=2,
                           streamed_len=K if c.switch.on else 0)], K)
        states.append(plan.streaming)
    assert states[0] and not states[-1]
    assert c.switch.switches >= 1


def test_fixed_lookahead_drafts_everything_with_every_drafter():
    # As vLLM's methods: the context bounds the drafts, max_tokens does not ("s" has 2 tokens
    # left, "u" room for 1 draft token in its context).
    f = FixedLookahead(4, 2)
    plan = f.plan([req(free_len=1), req("s", remaining=2),
                   PlanRequest("t", 10, 4096, catch_up=(None, 5)),
                   PlanRequest("u", 4094, 4096, catch_up=(0,))], 3)
    assert plan.lookaheads == [3, 3, 3, 1]
    assert plan.model_rows == [[0, 1, 3], [2]]  # drafter 1 can draft only for "t"
    assert plan.streaming


def test_a_lost_step_is_not_held_against_the_next():
    # vLLM skipped propose after a step (the proposer calls step_lost): the drafts planned for
    # it were verified unseen, so the next outcome (nothing verified) must not lower the yield.
    c = measured()
    teach(c, "r", models=0.9)
    plan = c.plan([req(free_len=0)], K)
    assert plan.models and plan.expected_tokens > 1.5
    before = c.snapshot()["yield"]
    c.step_lost()
    c.observe([RequestOutcome("r")])
    assert c.snapshot()["yield"] == before
    # Without step_lost the same outcome counts as a plan that yielded nothing.
    c.plan([req(free_len=0)], K)
    c.observe([RequestOutcome("r")])
    assert c.snapshot()["yield"]["models"] < before["models"]


def test_the_yield_fades_towards_one_when_its_plans_are_not_taken():
    y = PlanYield()
    for _ in range(100):
        y.tick()
        y.observe(2.0, 0.5)
    low = y.factor
    assert low < 0.4
    for _ in range(256):  # steps whose plans are of the other kind
        y.tick()
    assert y.factor > low + 0.2
    for _ in range(2000):
        y.tick()
    assert y.factor > 0.95


def test_a_catch_up_is_charged_in_seconds_at_the_tokens_it_computes():
    # The first forward computes all 600 tokens: the normal step's part (7 tokens) is charged in
    # full, the rest's seconds (not its tokens) spread. A share of the tokens priced on a curve
    # with a large fixed cost per forward charged almost nothing: pass_s(7 + 593 / 32) == pass_s(7).
    charge = charged_catch_up(600, K, 32.0)
    assert charge.seconds(pass_s) == pytest.approx(pass_s(7) + (pass_s(600) - pass_s(7)) / 32)
    assert charged_catch_up(5, K, 32.0).seconds(pass_s) == pass_s(5)  # a normal step's: in full
    assert charged_catch_up(None, K, 32.0).seconds(pass_s) == 0.0
    # Two requests in one forward: their own spreads, weighted by their extra tokens.
    both = charged_catch_up(600, K, 32.0) + charged_catch_up(107, K, 4.0)
    share = (593 / 32 + 100 / 4) / 693
    assert both.seconds(pass_s) == pytest.approx(pass_s(14) + (pass_s(707) - pass_s(14)) * share)


def test_a_probe_needs_a_cheap_catch_up():
    # At batch 1 a new request is probed although the population's estimate says no, but not
    # when the probe would prefill a long prompt in the drafter on that guess.
    for catch_up, probed in ((20, True), (EXPERIMENT_CATCH_UP_TOKENS + 1, False), (600, False)):
        c = measured()
        teach(c, "a", models=0.15, steps=60)
        c.forget(["a"])
        plan = c.plan([req("n", catch_up=catch_up, remaining=60)], K)
        assert (plan.mode == "explore" and plan.models) == probed, catch_up


def test_a_prefill_sized_catch_up_waits_for_the_request_s_own_evidence():
    # Spec-Bench summarization: a 710-token prompt whose voters have a chain in ~90% of its
    # steps, after requests whose voters seldom had one. On the population's share the catch-up
    # looked repaid; the request's own first steps say whether it is.
    for own_chain, steps, drafts in ((True, 20, False), (False, INVESTMENT_EVIDENCE_STEPS, True)):
        c = measured()
        teach(c, "r", models=0.8, with_free=False)
        for s in range(40):  # earlier requests: no chain
            c.observe([RequestOutcome(f"old{s // 20}")])
        new = req("q", catch_up=710, remaining=60)  # a step with no chain in hand
        assert not c.plan([new], K).models  # no own evidence yet: no prefill in the drafter
        for _ in range(steps):
            c.observe([RequestOutcome("q", free=DrafterOutcome(2, 1, 2) if own_chain else None,
                                      with_free=own_chain)])
        assert bool(c.plan([new], K).models) == drafts, own_chain
        # A normal catch-up needs no such evidence.
        assert c.plan([req("s", catch_up=5, remaining=60)], K).models


def test_a_catch_up_is_spread_over_the_steps_without_a_model_free_chain():
    # The models draft where the voters have no chain: a request whose voters had a chain in
    # most of its steps repays a long catch-up over few of them (and in no experiment either).
    for with_chain, drafts in ((False, True), (True, False)):
        c = measured()
        teach(c, "r", models=0.8)
        for _ in range(20):
            c.observe([RequestOutcome("q", free=DrafterOutcome(2, 0, 1) if with_chain else None,
                                      with_free=with_chain)])
        assert c.chainless("q") == pytest.approx(0.11 if with_chain else 1.0, abs=0.01)
        plan = c.plan([req("q", catch_up=600, remaining=500)], K)
        assert bool(plan.models) == drafts, with_chain
        # A short catch-up is a normal step's: charged in full either way, and it pays.
        assert c.plan([req("q", catch_up=5, remaining=500)], K).models
    c.forget(["q"])
    assert "q" not in c.chainless.requests


def test_in_a_batch_of_long_prompts_the_models_are_still_tried():
    # At batch 1 a long catch-up is never an experiment's; in a batch the cheapest request is
    # taken whatever its catch-up (the first experiment is always made), or a load of long
    # prompts would never try the models.
    c = measured()
    assert not c.plan([req("a", catch_up=600, remaining=60)], K).models
    c = measured()
    plan = c.plan([req("a", catch_up=600, remaining=60), req("b", catch_up=700, remaining=60)], K)
    assert plan.mode == "explore" and plan.model_rows == [[0]]
