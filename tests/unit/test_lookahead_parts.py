"""The adaptive policy's parts on their own: the drafter mode controller and the plan."""

import pytest

from vllm_smurfs.length_controller import AdaptiveLookahead, DraftTiming, RequestView, StepTiming
from vllm_smurfs.lookahead_mode import (
    MIN_DWELL_STEPS,
    RETRY_INTERVAL_STEPS,
    SWITCH_MARGIN,
    DrafterModeController,
)
from vllm_smurfs.lookahead_plan import LookaheadPlan


def _greedy(mode: DrafterModeController, step: int, rate_models: float,
            rate_free: float) -> bool:
    retrying = mode.retrying(step, 0.0)
    models = mode.choose_models(step, rate_models, rate_free, retrying)
    mode.commit(step, models, greedy=True)
    return models


def test_mode_controller_switches_with_a_margin_and_keeps_a_dwell() -> None:
    mode = DrafterModeController()
    assert _greedy(mode, 1, 1.0, 2.0) is False and mode.switches == 1
    # Within the dwell the mode is kept, whatever the rates.
    for step in range(2, 1 + MIN_DWELL_STEPS):
        assert _greedy(mode, step, 10.0, 1.0) is False
    step = 1 + MIN_DWELL_STEPS
    # Back on only with the margin.
    assert _greedy(mode, step, 1.0 + SWITCH_MARGIN / 2, 1.0) is False
    assert _greedy(mode, step + 1, 1.0 + 2 * SWITCH_MARGIN, 1.0) is True
    assert mode.switches == 2


def test_mode_controller_retries_and_backs_off_when_the_retry_did_not_pay() -> None:
    mode = DrafterModeController()
    _greedy(mode, 1, 1.0, 2.0)  # models off at step 1
    due = 1 + RETRY_INTERVAL_STEPS
    assert not mode.retry_due(due - 1, 0.0)
    assert not mode.retry_due(due, 1.0)  # not in a busy (prefill) step
    assert mode.retry_due(due, 0.0)
    mode.start_retry(due)
    mode.commit(due, True, greedy=False)
    assert mode.models_on and mode.retries == 1
    # The drafters deliver for a dwell; the retry then ends and the greedy choice judges it.
    for step in range(due + 1, due + 1 + MIN_DWELL_STEPS):
        assert mode.retrying(step, 0.0)
        mode.observe_feedback(drafted=True, models_ready=True)
    assert _greedy(mode, due + 1 + MIN_DWELL_STEPS, 1.0, 2.0) is False
    assert mode.retry_interval_steps == 2 * RETRY_INTERVAL_STEPS
    assert mode.snapshot()["retry_interval_steps"] == 2 * RETRY_INTERVAL_STEPS


def test_a_retry_is_priced_beyond_the_steps_without_model_drafting() -> None:
    mode = DrafterModeController()
    mode.start_retry(1)
    mode.commit(1, True, greedy=False)
    mode.observe_step(0.3, drafting=True, seconds_without=0.2)
    mode.observe_step(0.3, drafting=False, seconds_without=0.2)  # ran without: no price
    assert mode.retry_cost_s == pytest.approx(0.1)


def _plan(step_seconds: float = 0.1) -> LookaheadPlan:
    return LookaheadPlan(lookaheads={"a": 3, "b": 2}, expected={"a": [1.0, 1.9, 2.7, 3.4],
                                                                "b": [1.0, 1.5, 1.8]},
                         models=True, mode="greedy", num_drafted=2, decode_tokens=7,
                         background_tokens=0.0, expected_tokens=3.4 + 1.8,
                         target_seconds=step_seconds, step_seconds=step_seconds)


def test_plan_waits_one_drafter_step_when_the_token_it_brings_pays() -> None:
    a, b = RequestView("a", 10, 100), RequestView("b", 10, 100)
    plan = _plan()
    assert plan.wait_bound([a], [0], 1.0, t_d=0.001) == 0.001
    assert plan.wait_bound([a], [0], 0.0005, t_d=0.001) == 0.0005  # clipped
    assert plan.wait_bound([a], [0], 1.0, t_d=1.0) == 0.0  # a drafter step too slow
    assert plan.wait_bound([b], [2], 1.0, t_d=0.001) == 0.0  # complete already
    plan.forget(["a"])
    assert plan.wait_bound([a], [0], 1.0, t_d=0.001) == 0.0  # nothing waited for a finished one


def test_wait_bound_reads_the_last_plan() -> None:
    pol = AdaptiveLookahead(4, probe_interval=0)
    a = RequestView("a", 10, 100)
    assert pol.plan is None and pol.wait_bound([a], [0], 0.5) == 0.5  # nothing planned yet
    ks = pol.choose([a], 4)
    assert pol.plan is not None and pol.plan.lookaheads == {"a": ks[0]}
    assert pol.snapshot()["last_choice"] == {
        k: (round(v, 9) if isinstance(v, float) else v) for k, v in pol.plan.summary().items()}
    pol.observe_step(StepTiming(1, 1 + ks[0], 0.05))
    pol.observe_draft(DraftTiming(1, 1, 0.001))
    # The answer is the plan's, with t_d from the drafters' cost model.
    t_d = pol.draft_cost(1, max(1, pol.plan.num_drafted))
    assert pol.wait_bound([a], [0], 0.5) == pol.plan.wait_bound([a], [0], 0.5, t_d)


def test_model_drafting_is_one_record_that_tells_its_listeners() -> None:
    from vllm_smurfs.model_drafting import ModelDrafting

    drafting, told = ModelDrafting(), []
    drafting.subscribe(told.append)
    assert not drafting.on and not drafting.take_back()
    assert drafting.step(True) and drafting.steps_on == 1
    assert not drafting.step(True) and drafting.steps_on == 2
    assert drafting.take_back() and not drafting.on and drafting.take_backs == 1
    assert not drafting.step(False)
    assert told == [True, False]
    pol = AdaptiveLookahead(4, drafting=drafting)
    assert pol.snapshot()["model_drafting"] == drafting.snapshot()
