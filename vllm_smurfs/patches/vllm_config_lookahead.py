"""Patch `VllmConfig.num_lookahead_tokens`: reserve KV slots for in-worker drafters' drafts.

Why: an in-worker drafter writes KV past the tokens the target is scheduled for: the token the
target just sampled, and each draft token it feeds back to draft the next. vLLM reserves these
slots (``num_lookahead_tokens = num_speculative_tokens``) for its own draft models and EAGLE only;
for a ``custom_class`` proposer it reserves none, and a drafter would write into blocks the
request does not own.
How: when the speculative config is Smurfs' (``custom_class`` with ``additional_config["smurfs"]``)
and it has an in-worker drafter, the property answers ``num_speculative_tokens``, as for vLLM's
``draft_model``; everything else gets vLLM's answer. The scheduler and the worker's warm-up both
read this property.
When it can go: when a custom proposer can declare the lookahead slots it needs.
"""

from __future__ import annotations

from typing import Any

from vllm.config import VllmConfig

from vllm_smurfs.config import ADDITIONAL_CONFIG_KEY
from vllm_smurfs.patches._patching import original, replace_attribute

TARGET = VllmConfig
NAME = "num_lookahead_tokens"


def has_in_worker_drafters(vllm_config: Any) -> bool:
    spec = vllm_config.speculative_config
    additional = vllm_config.additional_config
    if spec is None or spec.method != "custom_class" or not isinstance(additional, dict):
        return False
    smurfs = additional.get(ADDITIONAL_CONFIG_KEY)
    if not isinstance(smurfs, dict):
        return False
    return any(d.get("method", "draft_model") == "draft_model"
               and d.get("placement", "worker") == "worker" for d in smurfs.get("drafters", ()))


def _num_lookahead_tokens(self: VllmConfig) -> int:
    tokens = original(TARGET, NAME).fget(self)
    if has_in_worker_drafters(self):
        return max(tokens, self.speculative_config.num_speculative_tokens)
    return tokens


def apply() -> bool:
    return replace_attribute(TARGET, NAME, property(_num_lookahead_tokens))
