"""What the controller is told after a step: a verified draft's outcome (:class:`StepFeedback`),
the target's step (:class:`StepTiming`), a streaming drafter's engine step or a synchronous
drafter's call (:class:`DraftTiming`).

Pure module (stdlib only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


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
