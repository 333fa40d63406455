"""What the controller is told about a step, what it decides, and what it learns afterwards.

The proposer describes each running request as a :class:`PlanRequest` (the chain in hand from the
model-free voters and the streaming drafters, what each in-worker drafter would have to catch up,
the tokens the request may still produce), asks the controller
(`length_controller.LengthController`) for a :class:`Plan`, drafts and votes by it, and after the
target's step reports a :class:`RequestOutcome` per request.

Pure module (stdlib only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["DrafterOutcome", "Plan", "PlanRequest", "RequestOutcome", "cumulative", "expected"]


@dataclass(frozen=True)
class PlanRequest:
    """What the controller knows of one request this step."""

    req_id: str
    num_tokens: int  # context length (prompt + output so far)
    max_model_len: int
    free_len: int = 0  # tokens of the model-free voters' chain (drafted already: free)
    # Tokens the streaming drafters have ready for it (0: none); their drafts are in hand too,
    # but they join the vote only in steps with streaming on.
    streamed_len: int = 0
    # Per in-worker drafter: tokens its first forward would compute for this request (None: it
    # cannot draft for it, e.g. past its context limit or failed).
    catch_up: tuple[int | None, ...] = ()
    remaining: int | None = None  # output tokens it may still produce (max_tokens left)
    band: int = 0  # its temperature band (`acceptance.temperature_band`; 0: greedy)

    @property
    def room(self) -> int:
        """Most draft tokens the context holds: verification appends the accepted drafts and one
        token more, so ``k`` drafts need ``num_tokens + k + 1 <= max_model_len``."""
        return max(0, self.max_model_len - self.num_tokens - 1)

    @property
    def cap(self) -> int:
        """Most draft tokens worth proposing: as many as the context holds, and at most
        ``remaining - 1`` (the step's own token ends the request after that many)."""
        if self.remaining is None:
            return self.room
        return max(0, min(self.room, self.remaining - 1))


@dataclass
class Plan:
    """One step's decision."""

    # Per request: most draft tokens proposed (0: none): the vote over its drafts (the
    # model-free voters', the streaming drafters' in steps with streaming, the in-worker
    # drafters' where they draft) is cut to it.
    lookaheads: list[int]
    model_rows: list[list[int]]  # per in-worker drafter: the requests it drafts for
    streaming: bool = False  # streaming drafters draft on, and their drafts join the vote
    # The requests synchronous process drafters (``pipeline: false``) draft for, exactly their
    # lookaheads, waited for.
    sync_rows: list[int] = field(default_factory=list)
    # What a second of the step is worth in tokens (the best rate the step can reach): a draft
    # token pays where its chance of acceptance beats rho times what it costs.
    rho: float = 0.0
    verify_s: float = 0.0  # predicted seconds one more verified token adds to the step
    mode: str = "none"  # how it was chosen (see LengthController.plan)
    expected_tokens: float = 0.0
    step_seconds: float = 0.0
    # Per request, for the rows drafted from the model curve: q[j] = P(the first j + 1 draft
    # tokens accepted), j = 0..cap-1 (the wait for late streamed drafts reads it).
    gains: dict[int, list[float]] = field(default_factory=dict)
    # Per model row: the draft length the plan was priced at (drafts stop by the drafter's
    # confidence while drafting; the simulator, which has no confidences, drafts this many).
    draft_lens: dict[int, int] = field(default_factory=dict)
    bands: list[int] = field(default_factory=list)  # per request: its temperature band

    @property
    def models(self) -> bool:
        """Whether any in-worker model drafter drafts in this step."""
        return any(self.model_rows)

    @property
    def model_row_set(self) -> set[int]:
        return {r for rows in self.model_rows for r in rows}


@dataclass(frozen=True)
class DrafterOutcome:
    """How one draft fared against the tokens the target produced."""

    tokens: int  # draft length
    matched: int  # leading draft tokens equal to the produced ones
    observed: int  # produced tokens (positions beyond them are unknown)
    confidences: tuple[float, ...] = ()  # the drafter's probability of each draft token

    @property
    def seen(self) -> tuple[int, int]:
        """(draft tokens, accepted) as far as the produced tokens tell."""
        seen = min(self.tokens, self.observed)
        return seen, min(self.matched, seen)


@dataclass(frozen=True)
class RequestOutcome:
    """What one request's last step taught: its model-free chain (scored whether verified or
    not), the chain verified (``voted``: tokens, accepted) and whether the model drafters' drafts
    were in its vote, with or without a model-free chain beside them, and each in-worker
    drafter's own draft (for its calibration)."""

    req_id: str
    free: DrafterOutcome | None = None
    voted: tuple[int, int] | None = None
    models: bool = False
    with_free: bool = False
    drafters: tuple[DrafterOutcome | None, ...] = ()
    band: int = 0  # its temperature band (acceptance is learnt per band)


def cumulative(acceptance: Sequence[float], cap: int) -> list[float]:
    """``q[j] = prod_{i<=j} p_i`` for the first ``cap`` positions: the chance that a draft's
    first ``j + 1`` tokens are all accepted."""
    out, q = [], 1.0
    for p in acceptance[:cap]:
        q *= p
        out.append(q)
    return out


def expected(qs: Sequence[float], k: int) -> float:
    """Tokens a step yields for a request drafted ``k`` tokens with cumulative acceptance ``qs``:
    the accepted drafts and the target's own token."""
    return 1.0 + sum(qs[:k])
