"""Patch `GPUModelRunner.execute_model`: tell the Smurfs proposer, before the target's forward,
how many prompt tokens the step computes.

Why: on a machine without a spare core a pipelined model drafter borrows one of the target's
cores while it drafts (the target runs on fewer OpenMP threads, `cores.ElasticThreads`). vLLM's
CPU GEMMs cache one oneDNN primitive per token count, and a primitive keeps the thread count it
was created with: a token count first computed while the core was lent runs on fewer threads for
as long as it stays cached. Measured: after a retry of the model drafter overlapped a burst of
prompts, every later 2048-token prefill step took 13 ms per token instead of 7 (the profile puts
it all in ``_C::onednn_mm``). Prompt chunks bring new token counts, so the proposer takes the
cores back before a step that carries one.
How: before vLLM's body, call the proposer's ``before_forward`` with the step's prompt tokens
(scheduled tokens beyond one per request and its draft tokens).
When it can go: when vLLM's CPU GEMM cache keys on the thread count, or drafters never share
the target's cores.
"""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_smurfs.patches._patching import original, replace_attribute
from vllm_smurfs.proposer import SmurfsProposer

TARGET = GPUModelRunner
NAME = "execute_model"


def prompt_tokens(scheduler_output) -> int:
    """Tokens of a step that are neither a request's next token nor its draft tokens."""
    drafts = sum(len(t) for t in scheduler_output.scheduled_spec_decode_tokens.values())
    return max(0, scheduler_output.total_num_scheduled_tokens
               - len(scheduler_output.num_scheduled_tokens) - drafts)


def _execute_model(self, scheduler_output, *args, **kwargs):
    drafter = getattr(self, "drafter", None)
    if isinstance(drafter, SmurfsProposer):
        drafter.before_forward(prompt_tokens(scheduler_output))
    return original(TARGET, NAME)(self, scheduler_output, *args, **kwargs)


def apply() -> bool:
    return replace_attribute(TARGET, NAME, _execute_model)
