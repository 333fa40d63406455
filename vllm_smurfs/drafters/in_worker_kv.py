"""Which KV cache an in-worker drafter's layers get, so that it never writes into another
request's blocks.

An in-worker drafter computes lazily: it catches up from the position it last computed (after a
long chunked prompt, after sitting out steps, after a preemption: from the start) and writes the
KV of old positions through the target's block tables. That is safe only where vLLM keeps a
request's blocks for its whole life, which its full-attention manager does. vLLM 0.32.0 gives
other attention kinds managers that free blocks early, and its runner's block table keeps the
freed ids (it only appends):

- a sliding-window layer (``SlidingWindowSpec``: Mistral-, Gemma-, Qwen3-style ``layer_types``)
  gets a KV cache group of its own, with a manager that frees each block once it leaves the
  window; vLLM lays every group over the same bytes ("Groups alias from byte 0" in
  ``kv_cache_utils``) and hands a freed block, which has no prefix hash, to the next allocation
  at once (``BlockPool.free_blocks`` prepends it: LIFO reuse). A lazy catch-up then writes the
  drafter's KV over another request's target KV: measured on the tiny models, every request's
  output changed, with a pool of 100 blocks or 1000;
- a chunked-local layer (Llama-4 style) is freed chunk by chunk, alike;
- a drafter with both sliding and full layers (Gemma-2/3 style) has its layers in several groups,
  which vLLM's draft-model machinery refuses with an assertion.

So every local-attention layer of an in-worker drafter declares the KV cache of a full-attention
layer of the same shape (what vLLM itself does for such layers when its hybrid KV cache manager
is off): its blocks live as long as the request, in the target's full-attention group when the
shapes agree. The layer still computes over its window (the attention backends read the window
from the layer, not from the KV cache spec); its cache holds every position instead of the last
window, as for a full-attention drafter of its size. Kinds that no full-attention cache can stand
for (Mamba-like recurrent state, and the rest) are refused: such a drafter runs in a process of
its own (``"placement": "process"``), on an engine that manages its cache as vLLM means to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    replace_as,
)

#: Kinds vLLM's full-attention manager keeps for the request's whole life (exact types: several
#: subclasses of `FullAttentionSpec` have managers that free blocks early).
_KEPT_KINDS = (FullAttentionSpec, MLAAttentionSpec)
#: Local-attention kinds a full-attention cache can stand for (exact types).
_LOCAL_KINDS = (SlidingWindowSpec, ChunkedLocalAttentionSpec)
#: Fields of the local kinds that a full-attention spec leaves unset.
_LOCAL_FIELDS = ("sliding_window", "extra_retained_tokens", "attention_chunk_size")


class UnsupportedDrafterLayers(ValueError):
    """An in-worker drafter has layers whose KV cache vLLM would free while the request runs."""


def full_attention_spec(spec: KVCacheSpec, block_size: int) -> KVCacheSpec | None:
    """The KV cache spec a drafter layer declares in the worker: ``spec`` itself for full
    attention; for a local-attention layer, the spec of a full-attention layer of the same shape
    in blocks of ``block_size`` tokens (the engine's); None when no full-attention cache can
    stand for it."""
    kind = type(spec)
    if kind in _KEPT_KINDS:
        return spec
    if kind not in _LOCAL_KINDS:
        return None
    padded = spec.page_size_padded
    if padded is not None:
        # As vLLM pads a promoted page: at least the page of the new block size.
        padded = max(padded, spec.unpadded_page_size_bytes * block_size // spec.block_size)
    return replace_as(spec, FullAttentionSpec, drop=_LOCAL_FIELDS, block_size=block_size,
                      page_size_padded=padded)


def keep_kv_for_request_lifetime(layers: dict[str, Any], vllm_config: Any,
                                 drafter_name: str) -> list[str]:
    """Make each of a drafter's attention ``layers`` (name -> vLLM attention layer) declare a
    KV cache vLLM keeps for the request's whole life (`full_attention_spec`). Returns the names
    of the layers changed; raises `UnsupportedDrafterLayers` naming the drafter and the kinds
    when a layer cannot have one."""
    block_size = int(vllm_config.cache_config.block_size)
    changed: list[str] = []
    refused: dict[str, str] = {}
    for name, layer in sorted(layers.items()):
        spec = layer.get_kv_cache_spec(vllm_config)
        if spec is None:
            continue
        full = full_attention_spec(spec, block_size)
        if full is None:
            refused[name] = type(spec).__name__
        elif full is not spec:
            layer.get_kv_cache_spec = _declaring_full_attention(layer.get_kv_cache_spec)
            changed.append(name)
    if refused:
        raise UnsupportedDrafterLayers(unsupported_message(drafter_name, refused.values()))
    return changed


def unsupported_message(drafter_name: str, kinds: Iterable[str]) -> str:
    return (f"Smurfs drafter '{drafter_name}' has layers whose KV cache vLLM cannot keep in the "
            f"target's worker for a request's whole life ({', '.join(sorted(set(kinds)))}): it "
            "cannot run there. Set \"placement\": \"process\" for it (its own engine manages "
            "its own cache).")


def _declaring_full_attention(get_spec: Callable[[Any], KVCacheSpec | None]
                              ) -> Callable[[Any], KVCacheSpec | None]:
    def get_kv_cache_spec(vllm_config: Any) -> KVCacheSpec | None:
        spec = get_spec(vllm_config)
        if spec is None:
            return None
        full = full_attention_spec(spec, int(vllm_config.cache_config.block_size))
        if full is None:  # cannot happen: the kind was checked when the drafter loaded
            raise UnsupportedDrafterLayers(f"KV cache spec {type(spec).__name__} changed kind")
        return full

    return get_kv_cache_spec
