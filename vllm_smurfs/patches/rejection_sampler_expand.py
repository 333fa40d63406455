"""Patch `vllm.v1.sample.rejection_sampler.expand_batch_to_tokens` on CPU: sampling stays lossless.

Why: on the CPU build, vLLM replaces the Triton ``expand_kernel`` with a C++ kernel whose wrapper
(`vllm.utils.cpu_triton_utils._expand_kernel_impl`) converts the output tensor to int64 and writes
into that converted copy. For the float tensors the rejection sampler expands (per-request
temperature, top-p) the real output is never written: the verifier divides the logits by
uninitialised memory (seen: 1.8e24), samples draft positions from a near-uniform distribution,
and speculative decoding at temperature > 0 is lossy on CPU for every method, vLLM's own too.
How: on CPU only, the function becomes `torch.repeat_interleave` of the per-request values with the
same ``replace_from -> replace_to`` substitution; GPU builds keep vLLM's kernel.
When it can go: when the CPU wrapper writes back into float outputs (check with
``tests/e2e/test_patches_vllm.py``).
"""

from __future__ import annotations

import torch
from vllm.v1.sample import rejection_sampler

from vllm_smurfs.patches._patching import replace_attribute

TARGET = rejection_sampler
NAME = "expand_batch_to_tokens"


def expand_batch_to_tokens(
    x: torch.Tensor,  # [batch_size]
    cu_num_tokens: torch.Tensor,  # [batch_size] cumulative tokens per request
    num_tokens: int,
    replace_from: int = 0,
    replace_to: int = 0,
) -> torch.Tensor:  # [num_tokens]
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1)).to(torch.long)
    expanded = torch.repeat_interleave(x, counts, output_size=num_tokens)
    if replace_from != replace_to:
        expanded = torch.where(expanded == replace_from,
                               torch.full_like(expanded, replace_to), expanded)
    return expanded


def apply() -> bool:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    return replace_attribute(TARGET, NAME, expand_batch_to_tokens)
