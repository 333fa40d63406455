"""Per-drafter figures for Python users: vote wins, tokens drafted and accepted, current weight.

vLLM's own counters (drafts, draft tokens, accepted tokens, acceptance per position) work with
Smurfs unchanged: `LLM.get_metrics()`, ``/metrics`` and ``vllm bench serve``. The per-drafter
figures live in the proposer, inside the worker; `get_smurfs_stats` fetches them with
`LLM.collective_rpc`. With an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) that works
as is; with vLLM's default multiprocess engine vLLM only ships a function to the worker when
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``. The same figures are logged every
``log_stats_interval_s`` seconds in any mode.
"""

from __future__ import annotations

from typing import Any


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
