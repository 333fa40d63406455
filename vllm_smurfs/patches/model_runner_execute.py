"""Patch `GPUModelRunner.execute_model`: before the target's forward, tell the Smurfs proposer
what the step brings that it must hear every step, and how many prompt tokens it computes.

Why, lifecycle: vLLM calls a custom proposer only from ``propose_draft_token_ids``, which it skips
in two kinds of steps: steps with no scheduled tokens (the one that carries the last
``finished_req_ids`` before the engine goes idle), and steps where ``_input_fits_in_drafter`` is
false (a request within num_speculative_tokens of ``max_model_len``: the whole batch is skipped).
Finished, preempted and resumed requests seen only in such a step would leave per-request state
behind (the proposer's, the planner's, the policy's, the process drafters' paths, an in-worker
drafter's catch-up position, stale after a resume), and the drafts verified in a skipped step
would be scored later against another step's tokens.
Why, cores: on a machine without a spare core a pipelined model drafter borrows one of the
target's cores while it drafts (the target runs on fewer OpenMP threads, `cores.ElasticThreads`).
vLLM's CPU GEMMs cache one oneDNN primitive per token count, and a primitive keeps the thread
count it was created with: a token count first computed while the core was lent runs on fewer
threads for as long as it stays cached. Measured: after a retry of the model drafter overlapped a
burst of prompts, every later 2048-token prefill step took 13 ms per token instead of 7 (the
profile puts it all in ``_C::onednn_mm``). Prompt chunks bring new token counts, so the proposer
takes the cores back before a step that carries one.
How: before vLLM's body, `runner_hooks.deliver_lifecycle`: (1) if the runner's last step
computed tokens and vLLM did not call ``propose_draft_token_ids`` after it (`model_runner_propose`
marks the calls), call the proposer's ``propose_skipped``; (2) call its ``forget`` with the step's
finished, preempted and resumed requests (``propose`` hears them again when it runs: forgetting
twice is harmless); then (3) call its ``before_forward`` with the step's prompt tokens (scheduled tokens beyond one per
request and its draft tokens).
When it can go: lifecycle, when vLLM hands custom proposers every step's request events; cores,
when vLLM's CPU GEMM cache keys on the thread count, or drafters never share the target's cores.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_smurfs.patches._patching import original, replace_attribute
from vllm_smurfs.proposer import SmurfsProposer
from vllm_smurfs.runner_hooks import deliver_lifecycle

TARGET = GPUModelRunner
NAME = "execute_model"


def prompt_tokens(scheduler_output: Any) -> int:
    """Tokens of a step that are neither a request's next token nor its draft tokens."""
    drafts = sum(len(t) for t in scheduler_output.scheduled_spec_decode_tokens.values())
    return max(0, scheduler_output.total_num_scheduled_tokens
               - len(scheduler_output.num_scheduled_tokens) - drafts)


def _execute_model(self, scheduler_output, *args, **kwargs):
    drafter = getattr(self, "drafter", None)
    if isinstance(drafter, SmurfsProposer):
        deliver_lifecycle(self, drafter, scheduler_output)
        drafter.before_forward(prompt_tokens(scheduler_output))
    return original(TARGET, NAME)(self, scheduler_output, *args, **kwargs)


def apply() -> bool:
    return replace_attribute(TARGET, NAME, _execute_model)
