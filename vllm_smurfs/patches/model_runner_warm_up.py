"""Patch `GPUModelRunner.initialize_kv_cache`: warm the in-worker drafters up at start-up.

Why: a drafter's first forward at each shape builds its kernels (oneDNN primitives on CPU,
compilation on GPU), and the controller's cost curves need a clean measurement of each shape.
vLLM warms its own draft models up (``_dummy_run``), never a ``custom_class`` proposer, so the
warm-up ran inside the first request's step: a cold burst of requests paid for it.
How: after vLLM's body (the KV cache tensors are bound, the in-worker drafters' included), the
Smurfs proposer runs its warm-up (`SmurfsProposer.warm_up`: each drafting shape twice, KV writes
into vLLM's null block); not in a profiling call. Without the patch the first `propose` does it.
When it can go: when vLLM warms up custom proposers once their KV cache is bound.
"""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_smurfs.patches._patching import original, replace_attribute
from vllm_smurfs.proposer import SmurfsProposer

TARGET = GPUModelRunner
NAME = "initialize_kv_cache"


def _initialize_kv_cache(self, kv_cache_config, is_profiling=False, *args, **kwargs):
    result = original(TARGET, NAME)(self, kv_cache_config, is_profiling, *args, **kwargs)
    drafter = getattr(self, "drafter", None)
    if isinstance(drafter, SmurfsProposer) and not is_profiling:
        drafter.warm_up()
    return result


def apply() -> bool:
    return replace_attribute(TARGET, NAME, _initialize_kv_cache)
