"""``lookahead.policy: fixed``: vLLM's own methods' behaviour, as a controller.

Pure module (stdlib only).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from vllm_smurfs.control.feedback import DraftTiming, StepTiming
from vllm_smurfs.control.plan import Plan, PlanRequest, RequestOutcome

__all__ = ["FixedLookahead"]


class FixedLookahead:
    """Every request drafts ``num_speculative_tokens`` (clipped to the context) with every drafter,
    every step: vLLM's own methods' behaviour."""

    def __init__(self, num_speculative_tokens: int, num_worker_drafters: int = 0) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.num_speculative_tokens = num_speculative_tokens
        self.num_worker_drafters = num_worker_drafters
        self.total_drafted = 0
        self.total_accepted = 0

    @property
    def streaming(self) -> bool:
        return True

    def plan(self, requests: Sequence[PlanRequest], max_lookahead: int, *,
             prompt_pending: bool = False) -> Plan:
        """``prompt_pending`` is ignored: a fixed lookahead drafts in every step."""
        top = min(self.num_speculative_tokens, max(0, max_lookahead))
        # As vLLM's methods: k tokens whenever the context holds them, also in a request's last
        # step (drafts past its max_tokens are verified and dropped).
        ks = [min(top, r.room) for r in requests]
        rows = [[i for i, r in enumerate(requests)
                 if ks[i] > 0 and d < len(r.catch_up) and r.catch_up[d] is not None]
                for d in range(self.num_worker_drafters)]
        return Plan(lookaheads=ks, model_rows=rows, streaming=True, mode="fixed",
                    sync_rows=[i for i, k in enumerate(ks) if k > 0])

    def keep_drafting(self, plan: Plan, drafter: int, active: Sequence[int],
                      confidences: Sequence[Sequence[float]], drafted_s: float = 0.0
                      ) -> list[int]:
        return list(active)

    def wait_s(self, plan: Plan, late: Sequence[tuple[int, int]], max_wait_s: float) -> float:
        return max_wait_s

    def observe(self, outcomes: Sequence[RequestOutcome]) -> None:
        for o in outcomes:
            if o.voted is not None:
                self.total_drafted += o.voted[0]
                self.total_accepted += o.voted[1]

    def observe_step(self, timing: StepTiming) -> None:
        return None

    def observe_pass(self, drafter: int, num_tokens: int, seconds: float) -> None:
        return None

    def observe_draft(self, timing: DraftTiming) -> None:
        return None

    def forget(self, req_ids: Iterable[str]) -> None:
        return None

    def step_lost(self) -> None:
        return None

    def snapshot(self) -> dict[str, Any]:
        rate = self.total_accepted / self.total_drafted if self.total_drafted else None
        return {"policy": "fixed", "num_speculative_tokens": self.num_speculative_tokens,
                "total_drafted": self.total_drafted, "total_accepted": self.total_accepted,
                "acceptance_rate": None if rate is None else round(rate, 6)}
