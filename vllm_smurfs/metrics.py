"""Per-drafter figures for Python users: vote wins, tokens drafted and accepted, current weight.

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

from typing import Any

#: Cumulative fields of `get_smurfs_stats`' totals and of each drafter's entry; the other fields
#: (weights, health, derived ratios) describe the moment of the snapshot.
TOTAL_COUNTERS = ("steps", "proposed_drafts", "verified_drafts", "verified_draft_tokens",
                  "accepted_tokens", "requests_drafted", "requests_without_draft",
                  "steps_without_models", "prefill_takebacks", "drafter_forwards",
                  "drafter_tokens")
SECONDS_COUNTERS = ("target_step_s", "wait_s", "proposer_s", "drafting_s")
DRAFTER_COUNTERS = ("vote_wins", "drafted_tokens", "accepted_tokens", "steps_late",
                    "engine_steps")


def _worker_smurfs_stats(worker: Any) -> dict[str, Any] | None:
    from vllm_smurfs.proposer import SmurfsProposer

    drafter = getattr(worker.model_runner, "drafter", None)
    return drafter.get_stats() if isinstance(drafter, SmurfsProposer) else None


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
    out["mean_acceptance_length"] = (
        round(1 + out["accepted_tokens"] / out["verified_drafts"], 4)
        if out["verified_drafts"] else None)
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
