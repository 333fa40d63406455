"""Patch `vllm.v1.sample.rejection_sampler.apply_sampling_constraints`: a step without draft
tokens survives top-k.

Why: vLLM 0.32.0 builds speculative metadata for every step once a speculative method is set,
so the rejection sampler also runs on steps in which no request has a draft (the first decode
step, or one where no drafter had anything), with zero draft positions. Its sampling constraints
then call ``apply_top_k_top_p`` on an empty logits tensor; on CPU, with a request that sets
``top_k`` (and no ``top_p``), vLLM's `apply_top_k_only` takes ``k.max()`` of an empty tensor
and raises: the engine dies at the first such step, for every speculative method (vLLM's own
``ngram`` and ``draft_model`` too).
How: with no draft positions there is nothing to constrain: the (empty) logits are returned as
they are, which is what the function returns for them when it does not fail. Every other call
is vLLM's own.
When it can go: when `apply_top_k_only` (or the rejection sampler) handles zero rows (check with
``tests/e2e/test_patches_vllm.py``).
"""

from __future__ import annotations

import torch
from vllm.v1.sample import rejection_sampler

from vllm_smurfs.patches._patching import original, replace_attribute

TARGET = rejection_sampler
NAME = "apply_sampling_constraints"


def apply_sampling_constraints(logits: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                               sampling_metadata) -> torch.Tensor:
    if logits.shape[0] == 0:
        return logits
    return original(TARGET, NAME)(logits, cu_num_draft_tokens, sampling_metadata)


def apply() -> bool:
    return replace_attribute(TARGET, NAME, apply_sampling_constraints)
