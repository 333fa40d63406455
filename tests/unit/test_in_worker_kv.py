"""Which KV cache an in-worker drafter's layers declare (vLLM's own spec classes, no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from vllm_smurfs.drafters.in_worker_kv import (
    UnsupportedDrafterLayers,
    full_attention_spec,
    keep_kv_for_request_lifetime,
)

SHAPE = dict(num_kv_heads=1, head_size=64, dtype=torch.float32)
CONFIG = SimpleNamespace(cache_config=SimpleNamespace(block_size=32))


class Layer:
    def __init__(self, spec):
        self.spec = spec

    def get_kv_cache_spec(self, vllm_config):
        return self.spec


def test_a_local_attention_layer_declares_the_full_attention_cache_of_its_shape():
    full = FullAttentionSpec(block_size=32, **SHAPE)
    for local in (SlidingWindowSpec(block_size=32, sliding_window=64, **SHAPE),
                  ChunkedLocalAttentionSpec(block_size=32, attention_chunk_size=128, **SHAPE)):
        promoted = full_attention_spec(local, 32)
        # Exactly a full-attention layer's spec: it merges into the target's group, whose
        # manager keeps every block until the request ends.
        assert type(promoted) is FullAttentionSpec and promoted == full
    assert full_attention_spec(full, 32) is full
    assert full_attention_spec(SlidingWindowSpec(block_size=16, sliding_window=64, **SHAPE),
                               32).block_size == 32


def test_layers_are_changed_in_place_and_other_kinds_refused_naming_the_drafter():
    sliding = Layer(SlidingWindowSpec(block_size=32, sliding_window=64, **SHAPE))
    full = Layer(FullAttentionSpec(block_size=32, **SHAPE))
    changed = keep_kv_for_request_lifetime({"d.0": sliding, "d.1": full}, CONFIG, "sw")
    assert changed == ["d.0"]
    assert type(sliding.get_kv_cache_spec(CONFIG)) is FullAttentionSpec
    assert sliding.spec.sliding_window == 64  # the layer itself still attends over its window

    mamba = Layer(MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.float32,)))
    with pytest.raises(UnsupportedDrafterLayers,
                       match=r"drafter 'jamba-ish' has layers .* \(MambaSpec\).*\"placement\": "
                             r"\"process\""):
        keep_kv_for_request_lifetime({"d.0": full, "d.1": mamba}, CONFIG, "jamba-ish")
