"""Unit tests for vllm_smurfs.length_controller (pure, no engine)."""

from __future__ import annotations

import pytest

from vllm_smurfs.length_controller import (
    FixedLookahead,
    LookaheadPolicy,
    RequestView,
    StepFeedback,
    room_for_drafts,
)


def _req(num_tokens: int, max_model_len: int = 100, req_id: str = "r") -> RequestView:
    return RequestView(req_id=req_id, num_tokens=num_tokens, max_model_len=max_model_len)


def test_fixed_lookahead_is_a_policy() -> None:
    assert isinstance(FixedLookahead(3), LookaheadPolicy)


def test_choose_returns_configured_value_when_room() -> None:
    pol = FixedLookahead(4)
    assert pol.choose([_req(10), _req(20, req_id="s")], max_lookahead=8) == [4, 4]
    assert pol.choose([], max_lookahead=8) == []


def test_choose_clipped_by_max_lookahead() -> None:
    pol = FixedLookahead(5)
    assert pol.choose([_req(10)], max_lookahead=3) == [3]
    assert pol.choose([_req(10)], max_lookahead=0) == [0]
    with pytest.raises(ValueError, match="max_lookahead"):
        pol.choose([_req(10)], max_lookahead=-1)


def test_choose_clipped_by_model_length() -> None:
    pol = FixedLookahead(5)
    # 100 - 96 - 1 = 3 drafts fit: 96 + 3 drafts + 1 bonus = 100.
    reqs = [_req(96), _req(98), _req(99), _req(100), _req(120), _req(10)]
    assert pol.choose(reqs, max_lookahead=5) == [3, 1, 0, 0, 0, 5]
    for r, k in zip(reqs, pol.choose(reqs, max_lookahead=5), strict=True):
        assert k == 0 or r.num_tokens + k + 1 <= r.max_model_len
    assert room_for_drafts(_req(120)) == 0


def test_counters_and_forget() -> None:
    pol = FixedLookahead(3)
    assert (pol.total_drafted, pol.total_accepted, pol.acceptance_rate) == (0, 0, None)
    pol.observe([StepFeedback("a", 3, 2), StepFeedback("b", 3, 0)])
    pol.observe([StepFeedback("a", 1, 1)])
    pol.observe([])
    assert (pol.total_drafted, pol.total_accepted) == (7, 3)
    assert pol.acceptance_rate == pytest.approx(3 / 7)
    pol.forget(["a", "b", "never-seen"])
    # Totals are global metrics; forgetting requests keeps them and the choice is unchanged.
    assert (pol.total_drafted, pol.total_accepted) == (7, 3)
    assert pol.choose([_req(0)], max_lookahead=10) == [3]


@pytest.mark.parametrize("n", [0, -2])
def test_fixed_lookahead_rejects_non_positive(n: int) -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        FixedLookahead(n)


def test_step_feedback_validation() -> None:
    with pytest.raises(ValueError, match="num_accepted"):
        StepFeedback("a", num_draft_tokens=2, num_accepted=3)
    with pytest.raises(ValueError, match="num_accepted"):
        StepFeedback("a", num_draft_tokens=2, num_accepted=-1)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        StepFeedback("a", num_draft_tokens=-1, num_accepted=0)
    assert StepFeedback("a", 0, 0).num_accepted == 0
