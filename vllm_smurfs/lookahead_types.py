"""The interface between the proposer and a lookahead policy with process drafters: what the policy
sees of each request (:class:`RequestView`), what it is told after a step (:class:`StepFeedback`,
:class:`StepTiming`, :class:`DraftTiming`), and the :class:`LookaheadPolicy` protocol.

Pure module (stdlib only).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


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


def _check_seconds(name: str, seconds: float) -> None:
    # `not x >= 0` also rejects NaN.
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {seconds!r}")


@dataclass(frozen=True)
class StepTiming:
    """One target step as the proposer saw it."""

    num_reqs: int  # requests in the step
    # Tokens the target computed in it: for decodes 1 + len(draft) each, plus prefill chunks.
    num_tokens: int
    # Wall time of the target's step (forward, sampling, scheduling), not the proposer's own time.
    seconds: float
    # Whether model drafters drafted during it (the target may have lent them cores): such steps
    # and steps without model drafting have their own cost curves.
    drafting: bool = True
    # The proposer's own time for this step's drafts, spent before it (drafting with the
    # model-free voters, voting, planning; not drafter forwards or waits, priced on their own).
    overhead_s: float = 0.0
    # Of num_tokens, the prompt-chunk tokens (exact, from the step's scheduler output).
    prompt_tokens: int = 0

    def __post_init__(self) -> None:
        if self.num_reqs < 0:
            raise ValueError(f"num_reqs must be >= 0, got {self.num_reqs}")
        if self.num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {self.num_tokens}")
        _check_seconds("seconds", self.seconds)
        _check_seconds("overhead_s", self.overhead_s)
        if not 0 <= self.prompt_tokens <= self.num_tokens:
            raise ValueError(f"prompt_tokens must be in [0, num_tokens={self.num_tokens}], "
                             f"got {self.prompt_tokens}")


@dataclass(frozen=True)
class DraftTiming:
    """One model-drafter engine call."""

    num_reqs: int  # requests drafted for in the call (batched)
    num_positions: int  # tokens drafted per request (the longest)
    seconds: float

    def __post_init__(self) -> None:
        if self.num_reqs < 0:
            raise ValueError(f"num_reqs must be >= 0, got {self.num_reqs}")
        if self.num_positions < 0:
            raise ValueError(f"num_positions must be >= 0, got {self.num_positions}")
        _check_seconds("seconds", self.seconds)


@runtime_checkable
class LookaheadPolicy(Protocol):
    """Chooses how many tokens to draft per request, learning from verification feedback."""

    def observe(self, feedback: Sequence[StepFeedback], models_ready: bool = True) -> None:
        """Record the outcome of the last step (one entry per request that was drafted for).

        ``models_ready``: whether the model drafters had caught up with the step's requests
        (False while they re-prefill requests after a start or a pause: the step's feedback
        then says little about what they deliver)."""
        ...

    def observe_step(self, timing: StepTiming) -> None:
        """Record how long the target's last step took and how many tokens it computed."""
        ...

    def observe_draft(self, timing: DraftTiming) -> None:
        """Record one drafter engine call."""
        ...

    def choose(self, requests: Sequence[RequestView], max_lookahead: int,
               free_lens: Sequence[int] | None = None) -> list[int]:
        """One lookahead per request, in order, each in ``0..max_lookahead``.

        ``free_lens[i]``: tokens the model-free voters have ready for request ``i`` now (they
        cost nothing to draft). After the call `models_on` says whether model drafters draft
        this step; when it is False every lookahead is at most ``free_lens[i]``.
        """
        ...

    @property
    def models_on(self) -> bool:
        """Whether the last choice drafts with the model drafters."""
        ...

    def wait_bound(
        self, requests: Sequence[RequestView], ready: Sequence[int], max_wait_s: float
    ) -> float:
        """Pipelined mode: seconds in ``[0, max_wait_s]`` to wait for the drafters' next tokens
        for ``requests`` (of the last choice), which have ``ready`` tokens ready now, fewer than
        chosen. The proposer asks again after each wait."""
        ...

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop any per-request state of finished or preempted requests."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """JSON-able state for metrics and logs."""
        ...


def room_for_drafts(request: RequestView) -> int:
    """How many draft tokens still fit before ``max_model_len``, never negative.

    Verification appends the accepted drafts plus one bonus token, so ``k`` drafts need
    ``num_tokens + k + 1 <= max_model_len``.
    """
    return max(0, request.max_model_len - request.num_tokens - 1)


def _check_max_lookahead(max_lookahead: int) -> None:
    if max_lookahead < 0:
        raise ValueError(f"max_lookahead must be >= 0, got {max_lookahead}")


def _check_wait_args(
    requests: Sequence[RequestView], ready: Sequence[int], max_wait_s: float
) -> None:
    if len(requests) != len(ready):
        raise ValueError(f"got {len(ready)} ready counts for {len(requests)} requests")
    if any(m < 0 for m in ready):
        # A negative count would index E(k) from the end: a silently wrong answer.
        raise ValueError(f"ready counts must be >= 0, got {list(ready)}")
    if not max_wait_s >= 0:  # rejects NaN too; +inf means "no limit"
        raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s!r}")
