"""The proposer's bookkeeping between steps: what it keeps of each request (`RequestState`), and
what a step taught (`learn`): every drafter's last draft scored against the tokens the target
produced (the vote weights, the figures), and the outcomes the controller learns from; the
trace's view of them (`trace_requests`).

Pure module (stdlib and numpy arrays passed in; no vLLM, no torch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_smurfs.control.plan import DrafterOutcome, RequestOutcome
from vllm_smurfs.metrics import SmurfsStats
from vllm_smurfs.trace.format import TraceRequest
from vllm_smurfs.vote_sampler import DrafterWeights, matched_prefix_len, score_draft


@dataclass
class RequestState:
    """What the proposer keeps of one request between its steps."""

    weights: DrafterWeights
    drafts: list[list[int]] | None = None  # each drafter's draft of the last step
    voted: list[int] | None = None  # the chain sent to the target last step
    free_chain: list[int] | None = None  # the model-free voters' own chain
    models: bool = False  # model drafts (in-worker or streamed) were in its vote
    # Each in-worker drafter's probability of each of its draft tokens (empty for the others).
    confidences: list[list[float]] | None = None
    # The mixture's member shares per chain position (a request that samples), else None.
    shares: list[dict[int, float]] | None = None
    band: int = 0  # its temperature band (the controller learns acceptance per band)

    def drop_pending(self) -> None:
        """Forget the last step's drafts (verified without us seeing the outcome, or scored)."""
        self.voted = self.drafts = self.confidences = self.free_chain = None
        self.models = False


def learn(states: Mapping[str, RequestState], req_ids: Sequence[str],
          sampled_token_ids: Sequence[Sequence[int]],
          verified_drafts: Mapping[str, list[int]] | None, in_worker: Sequence[int],
          stats: SmurfsStats, global_weights: DrafterWeights) -> list[RequestOutcome]:
    """Score every drafter's last draft of each request against what the target produced
    (``sampled_token_ids``, in the rows of ``req_ids``): the request's and the global vote
    weights, ``stats``; return what each request's last step taught the controller.
    ``verified_drafts``: the drafts the scheduler sent (None: each request's own last chain)."""
    outcomes = []
    for req_id, produced in zip(req_ids, sampled_token_ids, strict=True):
        state = states.get(req_id)
        if state is None or state.free_chain is None or not produced:
            continue
        verified = (state.voted or [] if verified_drafts is None
                    else verified_drafts.get(req_id, []))
        accepted = matched_prefix_len(verified, produced)
        if verified:
            stats.verified_drafts += 1
            stats.verified_draft_tokens += len(verified)
            stats.accepted_tokens += accepted
        free = None
        if state.free_chain:
            free = DrafterOutcome(len(state.free_chain),
                                  matched_prefix_len(state.free_chain, produced), len(produced))
        own = []
        if state.drafts is not None:
            # Every drafter is judged on what the target produced, verified draft or not.
            scores = [score_draft(draft, produced) for draft in state.drafts]
            state.weights.update(scores)
            global_weights.update(scores)
            for drafter_stats, draft in zip(stats.drafters, state.drafts, strict=True):
                drafter_stats.drafted_tokens += len(draft)
                drafter_stats.accepted_tokens += matched_prefix_len(draft, produced)
            for d in in_worker:
                draft = state.drafts[d]
                own.append(DrafterOutcome(
                    len(draft), matched_prefix_len(draft, produced), len(produced),
                    tuple(state.confidences[d]) if state.confidences else ())
                    if draft else None)
        outcomes.append(RequestOutcome(
            req_id, free=free, voted=(len(verified), accepted) if verified else None,
            models=state.models, drafters=tuple(own), band=state.band,
            with_free=bool(state.free_chain)))  # a model-free chain was in hand when planned
        state.drop_pending()
    for drafter_stats, weight in zip(stats.drafters, global_weights.weights, strict=True):
        drafter_stats.weight = weight
    return outcomes


def trace_requests(req_ids: Sequence[str], sampled_token_ids: Sequence[Sequence[int]],
                   num_tokens_no_spec: Any, outcomes: Sequence[RequestOutcome]
                   ) -> tuple[TraceRequest, ...]:
    """The trace's record of each request that produced tokens in the step (`trace.format`)."""
    by_id = {o.req_id: o for o in outcomes}
    requests = []
    for i, (req_id, produced) in enumerate(zip(req_ids, sampled_token_ids, strict=True)):
        if not produced:
            continue
        o = by_id.get(req_id)
        voted = o.voted if o is not None and o.voted is not None else (0, 0)
        requests.append(TraceRequest(
            req_id, int(num_tokens_no_spec[i]) - len(produced), voted[0], voted[1],
            free=(o.free.tokens, o.free.matched) if o is not None and o.free else None,
            models=bool(o is not None and o.models),
            drafts=tuple((d.tokens, d.matched) if d is not None else None
                         for d in o.drafters) if o is not None else (),
            band=o.band if o is not None else 0))
    return tuple(requests)


#: Attributes that hold one entry per live request, in the proposer's parts (the controller's
#: acceptance models, the drafters' paths and catch-up positions).
_PER_REQUEST_ATTRIBUTES = ("_requests", "_last_drafted", "expected", "_synced", "_paths", "_live",
                           "_sent")


def per_request_entries(holder: Any, depth: int = 2) -> int:
    """Entries of `_PER_REQUEST_ATTRIBUTES` in ``holder`` and its parts, ``depth`` levels down
    (nothing may outlive its request: the tests count them after generate() calls)."""
    try:
        attributes = vars(holder)
    except TypeError:
        return 0
    count = 0
    for name, value in attributes.items():
        if name in _PER_REQUEST_ATTRIBUTES and isinstance(value, (dict, set)):
            count += len(value)
        elif depth > 0 and hasattr(value, "__dict__") and not isinstance(value, type):
            count += per_request_entries(value, depth - 1)
        elif depth > 0 and isinstance(value, dict):  # parts kept by key (acceptance models)
            count += sum(per_request_entries(v, depth - 1) for v in value.values()
                         if hasattr(v, "__dict__") and not isinstance(v, type))
    return count
