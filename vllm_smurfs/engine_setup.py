"""What configuring an engine with Smurfs checks and sets, before any engine process starts.

Called from the front process (`patches.engine_args_speculative`) once the user's config is
valid on its own: the model runner is checked (V1 only), the drafters are checked against the
target and against what vLLM can host in the target's worker (architecture, attention kinds, KV
cache space), so a bad setting fails at once with the setting named, not deep in a worker; and on
CPU the target is given every core by default.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm_smurfs.config import ModelDrafterConfig, SmurfsConfig

logger = logging.getLogger(__name__)

#: The CPU backend's KV cache block size (tokens): space is taken in whole blocks.
_CPU_BLOCK_TOKENS = 128
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


def check_in_worker_drafters(smurfs: SmurfsConfig, target_model_config: Any,
                             kv_cache_bytes: int | None, block_size: int | None = None) -> None:
    """Refuse in-worker drafters vLLM cannot run in the target's worker, and a KV cache space
    (CPU: ``VLLM_CPU_KVCACHE_SPACE`` or ``kv_cache_memory_bytes``) too small for one request of
    ``max_model_len`` with the target and every in-worker drafter, counted as vLLM counts it
    (whole blocks of ``block_size`` tokens, one of them kept empty), so that the error names the
    drafters where vLLM's own would not."""
    drafters = [(i, d) for i, d in enumerate(smurfs.drafters)
                if isinstance(d, ModelDrafterConfig) and d.placement == "worker"]
    if not drafters:
        return
    trust = bool(getattr(target_model_config, "trust_remote_code", False))
    configs = {i: _hf_config(d.model, trust) for i, d in drafters}
    for i, drafter in drafters:
        _check_architecture(i, drafter, configs[i])
    if kv_cache_bytes is None:
        return
    max_len = int(target_model_config.max_model_len)
    block = block_size or _CPU_BLOCK_TOKENS
    # As vLLM counts: one request's blocks, and the block the pool keeps empty (its null block).
    blocks = -(-max_len // block) + 1
    target_dtype = str(target_model_config.dtype).removeprefix("torch.")
    per_token = {"target": kv_bytes_per_token(target_model_config.hf_config, target_dtype)}
    for i, drafter in drafters:
        dtype = target_dtype if drafter.dtype == "auto" else drafter.dtype
        per_token[f"drafter '{drafter.display_name}'"] = kv_bytes_per_token(configs[i], dtype)
    needed = blocks * block * sum(per_token.values())
    if needed > kv_cache_bytes:
        fits = kv_cache_bytes // sum(per_token.values())
        parts = ", ".join(f"{name} {b / 1024:.0f} KiB" for name, b in per_token.items())
        raise ValueError(
            f"speculative_config.drafters: the KV cache space ({kv_cache_bytes / 2**30:.2f} GiB) "
            f"holds {fits} tokens of the target and its in-worker drafters together (per token: "
            f"{parts}), fewer than one request of max_model_len={max_len} needs (in blocks of "
            f"{block} tokens, one kept empty): raise "
            "VLLM_CPU_KVCACHE_SPACE (or kv_cache_memory_bytes), lower max_model_len, or move a "
            "drafter out of the worker (\"placement\": \"process\").")


def check_parallelism(smurfs: SmurfsConfig, parallel_config: Any) -> None:
    """Refuse in-worker drafters on a target split over several workers (tensor or pipeline
    parallel). One worker drafts (`proposer.owns_drafters`), and the others take its drafts from
    the scheduler; an in-worker drafter's forwards would have to run on every worker of the
    split in step, planned alike on each. Process and Ray drafters serve such a target."""
    if parallel_config is None:
        return
    size = (int(getattr(parallel_config, "tensor_parallel_size", 1))
            * int(getattr(parallel_config, "pipeline_parallel_size", 1)))
    in_worker = [i for i, d in enumerate(smurfs.drafters)
                 if isinstance(d, ModelDrafterConfig) and d.placement == "worker"]
    if size > 1 and in_worker:
        raise ValueError(
            f"speculative_config.drafters[{in_worker[0]}].placement: an in-worker drafter "
            f"(placement 'worker', the default) needs the target in one worker, and this target "
            f"is split over {size} (tensor_parallel_size x pipeline_parallel_size); place its "
            "model drafters out of the worker: \"placement\": \"ray\" or \"process\".")


def kv_bytes_per_token(hf_config: Any, dtype: str) -> int:
    """KV cache bytes one token takes in every attention layer of a model (keys and values)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    dtype = str(dtype).removeprefix("torch.")
    return 2 * int(text.num_hidden_layers) * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 2)


def _hf_config(model: str, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(os.path.expanduser(model),
                                      trust_remote_code=trust_remote_code)


#: Per-layer kinds (``layer_types`` in a Hugging Face config) an in-worker drafter can have: full
#: attention, and local attention, which it keeps a full-attention KV cache for
#: (`drafters.in_worker_kv`).
_WORKER_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})


def _check_architecture(index: int, drafter: ModelDrafterConfig, hf_config: Any) -> None:
    from vllm.model_executor.models import ModelRegistry

    key = f"speculative_config.drafters[{index}].model"
    archs = list(getattr(hf_config, "architectures", None) or [])
    supported = ModelRegistry.get_supported_archs()
    if not any(arch in supported for arch in archs):
        raise ValueError(
            f"{key}: '{drafter.model}' has architecture "
            f"{archs or '(none given)'}, which vLLM cannot run as a draft model in the target's "
            "worker; use a causal language model vLLM supports.")
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    other_layers = sorted(set(getattr(text, "layer_types", None) or ()) - _WORKER_LAYER_TYPES)
    info = next((i for i in map(_model_info, archs) if i is not None), None)
    recurrent = info is not None and (info.is_hybrid or info.has_inner_state
                                      or info.is_attention_free)
    if other_layers or recurrent:
        what = ("a recurrent state (Mamba-like layers) beside or instead of attention"
                if recurrent else f"layers of kind {other_layers}")
        raise ValueError(
            f"{key}: drafter '{drafter.display_name}' ({archs[0]}) has {what}: vLLM frees or "
            "overwrites such a cache while a request runs, and an in-worker drafter catches up "
            "lazily through the target's block tables, so it cannot run in the target's worker. "
            "Set \"placement\": \"process\" for it (its own engine manages its own cache).")


def _model_info(arch: str) -> Any:
    """vLLM's registry entry of ``arch`` (None if it has none)."""
    from vllm.model_executor.models import ModelRegistry

    try:
        return ModelRegistry._try_inspect_model_cls(arch)
    except Exception:  # noqa: BLE001 - an entry that cannot be inspected tells nothing more
        return None


def check_model_runner() -> None:
    """Refuse vLLM's V2 model runner: Smurfs hooks the V1 runner (`GPUModelRunner`, which the
    CPU runner subclasses); on V2 the proposer would never get its step context. vLLM chooses
    V1 for a custom proposer by itself; only ``VLLM_USE_V2_MODEL_RUNNER=1`` forces V2."""
    import vllm.envs as envs

    if envs.VLLM_USE_V2_MODEL_RUNNER:
        raise ValueError(
            "VLLM_USE_V2_MODEL_RUNNER=1: speculative_config method 'smurfs' runs on vLLM's V1 "
            "model runner (its patches hook GPUModelRunner; vLLM's V2 runner would never hand "
            "the Smurfs proposer the requests of a step). Unset VLLM_USE_V2_MODEL_RUNNER (vLLM "
            "picks the V1 runner for Smurfs by itself) or set it to 0.")


def default_to_all_cores() -> bool:
    """On CPU with no placement set (neither ``VLLM_CPU_OMP_THREADS_BIND`` nor
    ``VLLM_CPU_NUM_OF_RESERVED_CPU``), give the target every core its NUMA node offers.

    vLLM-CPU's automatic binding keeps one core per worker out of the compute threads, for the
    scheduler process: on a 2-core machine it computes on one core and leaves the other nearly
    idle (no speculation ran at 0.61x of its speed on both cores here). Smurfs' drafters compute
    on the target's threads (or borrow its cores), so the target is given them all: the engine
    processes inherit ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``. Returns whether it set it.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ or "VLLM_CPU_NUM_OF_RESERVED_CPU" in os.environ:
        return False
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    logger.info("Smurfs: the target computes on every core (VLLM_CPU_NUM_OF_RESERVED_CPU=0; set "
                "VLLM_CPU_OMP_THREADS_BIND or VLLM_CPU_NUM_OF_RESERVED_CPU to choose otherwise)")
    return True


def kv_cache_space_bytes(engine_args: Any) -> int | None:
    """The KV cache space the CPU backend will use, when it is known before the engine starts:
    ``VLLM_CPU_KVCACHE_SPACE`` (GiB; the CPU backend lets it override the argument), else
    ``kv_cache_memory_bytes``."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    if space:
        try:
            return int(space) * 2**30
        except ValueError:
            return None
    explicit = getattr(engine_args, "kv_cache_memory_bytes", None)
    return int(explicit) if explicit else None
