"""Lookahead (draft length) policies: the interface, and the fixed policy.

Each step the proposer asks a :class:`LookaheadPolicy` how many tokens to draft for every running
request, and afterwards tells it how many of them the target accepted. An adaptive controller will
implement the same protocol later; :class:`FixedLookahead` always asks for the configured
``num_speculative_tokens``, clipped to what the engine and the model length allow.

Pure module (stdlib only, no vllm/torch).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = [
    "FixedLookahead",
    "LookaheadPolicy",
    "RequestView",
    "StepFeedback",
]


@dataclass(frozen=True)
class RequestView:
    """What a policy may know about a request when choosing its lookahead."""

    req_id: str
    num_tokens: int  # current context length (prompt + output)
    max_model_len: int


@dataclass(frozen=True)
class StepFeedback:
    """Outcome of the last verification step for one request."""

    req_id: str
    num_draft_tokens: int  # tokens that were proposed for it last step
    num_accepted: int  # how many of them the target accepted

    def __post_init__(self) -> None:
        # Counts that cannot happen point at a bookkeeping bug upstream (e.g. counting the bonus
        # token as accepted); fail loudly rather than let it skew acceptance statistics.
        if self.num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}")
        if not (0 <= self.num_accepted <= self.num_draft_tokens):
            raise ValueError(
                f"num_accepted must be in [0, num_draft_tokens={self.num_draft_tokens}], "
                f"got {self.num_accepted}"
            )


@runtime_checkable
class LookaheadPolicy(Protocol):
    """Chooses how many tokens to draft per request, learning from verification feedback."""

    def observe(self, feedback: Sequence[StepFeedback]) -> None:
        """Record the outcome of the last step (one entry per request that was drafted for)."""
        ...

    def choose(self, requests: Sequence[RequestView], max_lookahead: int) -> list[int]:
        """One lookahead per request, in order, each in ``0..max_lookahead``."""
        ...

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop any per-request state of finished or preempted requests."""
        ...


def room_for_drafts(request: RequestView) -> int:
    """How many draft tokens still fit before ``max_model_len``, never negative.

    Verification appends the accepted drafts plus one bonus token, so ``k`` drafts need
    ``num_tokens + k + 1 <= max_model_len``.
    """
    return max(0, request.max_model_len - request.num_tokens - 1)


class FixedLookahead:
    """Always draft ``num_speculative_tokens`` (clipped); implements :class:`LookaheadPolicy`.

    Keeps running totals ``total_drafted`` / ``total_accepted`` for metrics only; they never
    influence the choice.
    """

    def __init__(self, num_speculative_tokens: int) -> None:
        """Raises ValueError when ``num_speculative_tokens < 1``."""
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.num_speculative_tokens = num_speculative_tokens
        self.total_drafted = 0
        self.total_accepted = 0

    def observe(self, feedback: Sequence[StepFeedback]) -> None:
        for fb in feedback:
            self.total_drafted += fb.num_draft_tokens
            self.total_accepted += fb.num_accepted

    def choose(self, requests: Sequence[RequestView], max_lookahead: int) -> list[int]:
        """``min(num_speculative_tokens, max_lookahead, room_for_drafts(r))`` per request.

        Raises:
            ValueError: when ``max_lookahead < 0``.
        """
        if max_lookahead < 0:
            raise ValueError(f"max_lookahead must be >= 0, got {max_lookahead}")
        cap = min(self.num_speculative_tokens, max_lookahead)
        return [min(cap, room_for_drafts(r)) for r in requests]

    def forget(self, req_ids: Iterable[str]) -> None:
        # No per-request state; the totals are global and must survive request turnover.
        return None

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over drafted so far; None before anything was drafted."""
        if self.total_drafted == 0:
            return None
        return self.total_accepted / self.total_drafted
