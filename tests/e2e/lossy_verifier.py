"""TEST-ONLY: break vLLM's verifier on purpose, for the sampling test's control run.

Run in a generation job's process before its engine starts (`Job(preload=[this file])`; never
imported by the plugin). At a rejected draft position, vLLM's rejection sampler emits a token
drawn from the residual max(p - q, 0) (with no draft probabilities q is one-hot on the drafted
token: p with the drafted token removed). Here it is drawn from p itself, the drafted token
included: a classic lossy verifier. The drafted token d then comes out with probability
p(d) + (1 - p(d)) p(d) instead of p(d), every other token x with (1 - p(d)) p(x): the
distribution moves by p(d) (1 - p(d)) in total variation, towards the drafts.
"""

from __future__ import annotations

import torch
from vllm.v1.sample import rejection_sampler


def sample_recovered_tokens_from_p(
    max_spec_len: int,
    num_draft_tokens: list[int],
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,  # [num_tokens]
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,  # [num_tokens, vocab_size]
    sampling_metadata,
    device: torch.device,
    use_fp64_gumbel: bool = False,
) -> torch.Tensor:  # [num_tokens]
    """The recovered token of every draft position sampled from the target's p, not the
    residual (what `rejection_sampler.sample_recovered_tokens` computes)."""
    return torch.multinomial(target_probs, 1).squeeze(-1).to(draft_token_ids.dtype)


# rejection_sample() looks the function up in its module at each call.
assert callable(rejection_sampler.sample_recovered_tokens)
rejection_sampler.sample_recovered_tokens = sample_recovered_tokens_from_p
print("[lossy_verifier] TEST-ONLY lossy verifier installed: recovered tokens drawn from p")
