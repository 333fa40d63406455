"""Patch `GPUModelRunner.initialize_metadata_builders`: give in-worker drafters their attention
groups once the KV cache is sized.

Why: an in-worker drafter (`drafters.in_worker.InWorkerDrafter`, a vLLM `DraftModelProposer`)
registers its attention layers in the runner's forward context when it loads, so the runner sizes
and allocates their KV cache beside the target's, in the target's block tables. The runner then
calls the drafter's ``initialize_attn_backend`` for vLLM's own draft models only (``method:
draft_model`` or EAGLE); a ``custom_class`` proposer is never told.
How: after vLLM's body, hand the Smurfs proposer the KV cache config and kernel block sizes; it
initialises each in-worker drafter's attention groups (vLLM's own method). The runner reads the
proposer's ``draft_attn_groups`` when it binds the KV cache tensors, as for its own drafters.
When it can go: when vLLM initialises the attention backend of every proposer that has one.
"""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_smurfs.patches._patching import original, replace_attribute
from vllm_smurfs.proposer import SmurfsProposer

TARGET = GPUModelRunner
NAME = "initialize_metadata_builders"


def _initialize_metadata_builders(self, kv_cache_config, kernel_block_sizes, *args, **kwargs):
    result = original(TARGET, NAME)(self, kv_cache_config, kernel_block_sizes, *args, **kwargs)
    drafter = getattr(self, "drafter", None)
    if isinstance(drafter, SmurfsProposer):
        drafter.initialize_attn_backend(kv_cache_config, kernel_block_sizes)
    return result


def apply() -> bool:
    return replace_attribute(TARGET, NAME, _initialize_metadata_builders)
