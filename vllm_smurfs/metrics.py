"""The figures Smurfs counts, defined once (`SmurfsStats`, `DrafterStats`), and how Python users
fetch them: steps, drafts, accepted tokens, time per part of a step; per drafter vote wins,
tokens drafted and accepted, current weight.

vLLM's own counters (drafts, draft tokens, accepted tokens, acceptance per position) work with
Smurfs unchanged: `LLM.get_metrics()`, ``/metrics`` and ``vllm bench serve``. The per-drafter
figures live in the proposer, inside the worker; `get_smurfs_stats` fetches them with
`LLM.collective_rpc`. With an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) that works
as is; with vLLM's default multiprocess engine vLLM only ships a function to the worker when
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``. The same figures are logged every
``log_stats_interval_s`` seconds in any mode.

Like vLLM's counters, the figures are cumulative since the engine started: `stats_delta` gives
what happened between two snapshots (e.g. leaving a warm-up request out).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


def mean_acceptance_length(accepted_tokens: int, drafts: int) -> float | None:
    """1 + accepted / drafts: tokens produced per verified draft (None without drafts)."""
    return round(1 + accepted_tokens / drafts, 4) if drafts else None


@dataclass
class DrafterStats:
    """One drafter's figures over verified steps (drafts the target never checked don't count)."""

    name: str
    vote_wins: int = 0  # proposals where the voted chain was this drafter's draft
    drafted_tokens: int = 0  # tokens this drafter proposed in verified steps
    accepted_tokens: int = 0  # of those, the ones matching what the target produced
    weight: float = 1.0  # current global weight (the prior of new requests)

    def as_dict(self) -> dict[str, Any]:
        acceptance = self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0
        return {"name": self.name, "vote_wins": self.vote_wins,
                "drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens,
                "acceptance": round(acceptance, 4), "weight": round(self.weight, 4)}


@dataclass
class SmurfsStats:
    steps: int = 0
    proposed_drafts: int = 0  # requests that got a non-empty voted draft
    # Of those, the chains of the mixture rule (requests that sample; the others are the vote's,
    # and only they count in the drafters' vote_wins).
    sampled_drafts: int = 0
    verified_drafts: int = 0  # of those, the ones the target verified
    verified_draft_tokens: int = 0
    accepted_tokens: int = 0
    requests_drafted: int = 0  # (request, step) pairs with a lookahead > 0
    requests_without_draft: int = 0  # of those, the ones no drafter had anything ready for
    steps_without_models: int = 0  # steps the policy left the model drafters out of
    request_steps: int = 0  # (request, step) pairs planned
    # Of those, the ones the model drafters did not draft for, where the model-free voters had a
    # chain for the request and where they had none.
    request_steps_without_models_free_chain: int = 0
    request_steps_without_models_no_chain: int = 0
    prefill_takebacks: int = 0  # steps with prompt chunks that took lent cores back
    drafter_forwards: int = 0  # forwards of in-worker drafters
    drafter_tokens: int = 0  # tokens they computed (catch-up and draft tokens fed back)
    drafting_s: float = 0.0  # seconds they took (part of proposer_s)
    target_step_s: float = 0.0  # time between our return and the next call: the target's steps
    wait_s: float = 0.0  # time propose() waited for drafts
    proposer_s: float = 0.0  # time in propose(), waits included
    drafters: list[DrafterStats] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {key: getattr(self, key) for key in TOTAL_COUNTERS}
        out["mean_acceptance_length"] = mean_acceptance_length(self.accepted_tokens,
                                                               self.verified_drafts)
        out.update({key: round(getattr(self, key), 4) for key in SECONDS_COUNTERS})
        out["drafters"] = [d.as_dict() for d in self.drafters]
        return out


#: Cumulative fields of `get_smurfs_stats`' totals (`SmurfsStats`' counts and seconds) and of each
#: drafter's entry; the other fields (weights, health, derived ratios) describe the moment of
#: the snapshot.
TOTAL_COUNTERS = tuple(f.name for f in fields(SmurfsStats) if type(f.default) is int)
SECONDS_COUNTERS = tuple(f.name for f in fields(SmurfsStats) if type(f.default) is float)
DRAFTER_COUNTERS = ("vote_wins", "drafted_tokens", "accepted_tokens", "steps_late",
                    "engine_steps")


def _worker_smurfs_stats(worker: Any) -> dict[str, Any] | None:
    # Smurfs' proposer is the drafter that keeps a `SmurfsStats` (this module does not import
    # the proposer: it is the proposer's dependency, not the other way round).
    drafter = getattr(worker.model_runner, "drafter", None)
    ours = isinstance(getattr(drafter, "stats", None), SmurfsStats)
    return drafter.get_stats() if ours else None


def get_smurfs_stats(llm: Any) -> dict[str, Any]:
    """Smurfs figures of an `LLM` (first worker): totals and one entry per drafter."""
    stats = llm.collective_rpc(_worker_smurfs_stats)[0]
    if stats is None:
        raise ValueError("this engine does not use speculative_config method 'smurfs'")
    return stats


def stats_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """The figures of ``after`` with its counters counted from the ``before`` snapshot on."""
    out = {**after, **{key: after[key] - before[key] for key in TOTAL_COUNTERS}}
    out.update({key: round(after[key] - before[key], 4) for key in SECONDS_COUNTERS})
    out["mean_acceptance_length"] = mean_acceptance_length(out["accepted_tokens"],
                                                           out["verified_drafts"])
    drafters = []
    for now, then in zip(after["drafters"], before["drafters"], strict=True):
        entry = {**now, **{key: now[key] - then[key] for key in DRAFTER_COUNTERS if key in now}}
        if "busy_s" in now:
            entry["busy_s"] = round(now["busy_s"] - then["busy_s"], 4)
        drafted = entry["drafted_tokens"]
        entry["acceptance"] = round(entry["accepted_tokens"] / drafted, 4) if drafted else 0.0
        drafters.append(entry)
    out["drafters"] = drafters
    return out
