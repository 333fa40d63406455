"""Patch `GPUModelRunner.propose_draft_token_ids`: tell the Smurfs proposer who is in the batch.

Why: vLLM calls a ``custom_class`` proposer with token arrays only: no request ids (rows move when
requests finish), no finished/preempted requests, no per-step lookahead. Smurfs keeps drafter
state, vote weights and the previous draft per request, so it needs all of these.
How: before vLLM's own body runs, hand the proposer a `StepContext` built from
``input_batch.req_ids`` and the scheduler output (lifecycle events, lookahead cap, drafts
verified, tokens computed), the rows' prompt lengths (the suffix voter's prompt trees) and the
runner itself (in-worker drafters address their KV cache through its block tables), and mark the
step's propose call as come (`model_runner_execute` tells the proposer of the steps vLLM skips it
in). After it, hand the runner the proposer's draft probabilities (``_draft_probs``, which the
rejection sampler reads at the next step; vLLM takes them only from its own proposers, through
``take_last_draft_probs``), and cut each draft before its first id the target has no row for: drafters share the
target's tokenizer, but a drafter's embedding may be padded past the target's (the target's
rejection sampler indexes its logits with the draft).
The CPU runner inherits this method.
When it can go: when vLLM passes request ids, lifecycle events and prompt lengths to custom
proposers, and reads ``take_last_draft_probs`` of them.
"""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_smurfs.patches._patching import original, replace_attribute
from vllm_smurfs.proposer import SmurfsProposer
from vllm_smurfs.runner_hooks import StepContext, mark_proposed, within_vocabulary

TARGET = GPUModelRunner
NAME = "propose_draft_token_ids"


def _propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
    if not isinstance(self.drafter, SmurfsProposer):
        return original(TARGET, NAME)(self, scheduler_output, *args, **kwargs)
    mark_proposed(self)
    cached = scheduler_output.scheduled_cached_reqs
    req_ids = list(self.input_batch.req_ids)
    self.drafter.begin_step(
        StepContext(
            req_ids=req_ids,
            finished_req_ids=frozenset(scheduler_output.finished_req_ids),
            restarted_req_ids=frozenset(
                set(cached.resumed_req_ids) | set(scheduler_output.preempted_req_ids or ())
            ),
            max_spec_tokens=scheduler_output.num_spec_tokens_to_schedule,
            verified_drafts=scheduler_output.scheduled_spec_decode_tokens,
            num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
            num_prompt_tokens=self.input_batch.num_prompt_tokens[: len(req_ids)].tolist(),
            runner=self,
        )
    )
    drafts = original(TARGET, NAME)(self, scheduler_output, *args, **kwargs)
    # vLLM's body reset the draft probabilities and reads them only of its own proposers: a
    # request that samples is verified against the q its chain was drawn from.
    probs = self.drafter.take_last_draft_probs()
    if probs is not None:
        self._draft_probs = probs
        self._draft_prob_req_ids = list(req_ids)
    return within_vocabulary(drafts, self.model_config.get_vocab_size())


def apply() -> bool:
    return replace_attribute(TARGET, NAME, _propose_draft_token_ids)
