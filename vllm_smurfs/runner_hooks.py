"""What the model runner patches do around vLLM's steps, without vLLM (pure, unit tested).

`patches.model_runner_execute` calls `deliver_lifecycle` before every step's forward, and
`patches.model_runner_propose` hands the proposer a `StepContext` and calls `mark_proposed` and
`within_vocabulary` around vLLM's ``propose_draft_token_ids``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

#: Runner attribute: the runner's last step computed tokens, and its propose call has not come.
PROPOSE_PENDING = "_smurfs_propose_pending"


@dataclass(frozen=True)
class StepContext:
    """What vLLM knows about the batch and does not pass to custom proposers (see patches)."""

    req_ids: list[str]  # [num_reqs] in the row order of propose()'s arrays
    finished_req_ids: frozenset[str]  # finished or aborted since the last step
    restarted_req_ids: frozenset[str]  # preempted or resumed: their old drafts are void
    max_spec_tokens: int  # the scheduler's lookahead cap for this step (0 = none given)
    # The drafts verified in this step, as the scheduler sent them (it may cut a draft short,
    # e.g. near max_tokens); None when unknown: the proposer's own last draft is assumed.
    verified_drafts: Mapping[str, list[int]] | None = None
    num_scheduled_tokens: int = 0  # tokens the target computes in this step (drafts, prefills)
    # [num_reqs] prompt length per row (the suffix voter's prompt tree); None when unknown.
    num_prompt_tokens: Sequence[int] | None = None
    # The model runner (in-worker drafters address their KV cache through its block tables, and
    # the planner reads each request's remaining token budget); None in unit tests.
    runner: Any = None


def remaining_tokens(runner: Any, req_id: str) -> int | None:
    """Output tokens a request may still produce (its max_tokens left), when the runner says."""
    state = getattr(runner, "requests", {}).get(req_id) if runner is not None else None
    max_tokens = getattr(getattr(state, "sampling_params", None), "max_tokens", None)
    if max_tokens is None:
        return None
    return max(0, int(max_tokens) - len(getattr(state, "output_token_ids", ())))


class LifecycleListener(Protocol):
    """The part of `SmurfsProposer` the lifecycle hook drives."""

    def forget(self, req_ids: Any) -> None: ...

    def propose_skipped(self) -> None: ...


def ended_req_ids(scheduler_output: Any) -> frozenset[str]:
    """Requests whose per-request state ends with this step: finished or aborted since the last
    step, preempted now, or resumed now (their KV cache, any drafter's too, starts over)."""
    cached = scheduler_output.scheduled_cached_reqs
    return (frozenset(scheduler_output.finished_req_ids)
            | frozenset(scheduler_output.preempted_req_ids or ())
            | frozenset(cached.resumed_req_ids))


def deliver_lifecycle(runner: Any, listener: LifecycleListener, scheduler_output: Any) -> None:
    """Before a step's forward: what the proposer must hear of it whether or not vLLM calls
    ``propose`` after it. vLLM skips ``propose`` in steps with no scheduled tokens (the one that
    carries the last finished requests before the engine goes idle) and in steps with a request
    within num_speculative_tokens of ``max_model_len`` (the whole batch).

    1. If the runner's previous step computed tokens and no propose came after it, the proposer
       hears so (`propose_skipped`): the drafts verified in that step are void.
    2. The step's finished, preempted and resumed requests are forgotten now.
    """
    if getattr(runner, PROPOSE_PENDING, False):
        listener.propose_skipped()
    setattr(runner, PROPOSE_PENDING, scheduler_output.total_num_scheduled_tokens > 0)
    ended = ended_req_ids(scheduler_output)
    if ended:
        listener.forget(ended)


def mark_proposed(runner: Any) -> None:
    """vLLM calls ``propose`` for the runner's last step."""
    setattr(runner, PROPOSE_PENDING, False)


def within_vocabulary(drafts: Any, vocab_size: int) -> Any:
    """Each draft cut before its first id >= ``vocab_size``: drafters share the target's
    tokenizer, but one whose embedding is padded past the target's could draft an id the
    target has no row for (its rejection sampler indexes the target's logits with it). Values
    other than lists pass unchanged."""
    if not isinstance(drafts, list):
        return drafts
    out = []
    for draft in drafts:
        cut = next((j for j, token in enumerate(draft) if token >= vocab_size), None)
        out.append(draft if cut is None else draft[:cut])
    return out
