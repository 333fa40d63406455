"""Patch `EngineArgs.create_speculative_config`: accept ``{"method": "smurfs", ...}``.

Why: vLLM's `SpeculativeConfig` forbids unknown methods and keys (``drafters``, ``vote``...), and
a ``custom_class`` proposer only receives the `VllmConfig`.
How: when the user's dict says ``method: smurfs``, validate it as a `SmurfsConfig`, check the
drafters against the target (paths, tokenizer, what vLLM can host in the target's worker and
its KV cache space; `engine_setup`), default the target to every core on CPU, store it in ``additional_config["smurfs"]``
(vLLM's channel for plugin settings; it reaches every worker and enters the config hash), and
hand vLLM the equivalent ``custom_class`` config. Every other config passes through untouched.
Refuses vLLM's V2 model runner (the patches target the V1 runner).
When it can go: when vLLM lets plugins register speculative methods with their own config.
"""

from __future__ import annotations

from typing import Any

from vllm.engine.arg_utils import EngineArgs

from vllm_smurfs import engine_setup
from vllm_smurfs.config import ADDITIONAL_CONFIG_KEY, PROPOSER_CLASS, SmurfsConfig
from vllm_smurfs.patches._patching import original, replace_attribute

TARGET = EngineArgs
NAME = "create_speculative_config"


def translate(engine_args: Any, target_model_config: Any,
              target_parallel_config: Any = None) -> None:
    """Rewrite ``engine_args`` in place if it carries a Smurfs config."""
    spec = engine_args.speculative_config
    if not isinstance(spec, dict) or spec.get("method") != "smurfs":
        return
    smurfs = SmurfsConfig.from_user_dict({k.replace("-", "_"): v for k, v in spec.items()})
    if getattr(engine_args, "async_scheduling", None):
        # vLLM would refuse it for any custom proposer, without saying why; say it here.
        raise ValueError(
            "async_scheduling (--async-scheduling): speculative_config method 'smurfs' needs "
            "the tokens each step sampled before it drafts the next (it scores every drafter "
            "against them); async scheduling hands the proposer placeholders instead. Leave "
            "async_scheduling unset or false.")
    engine_setup.check_model_runner()
    smurfs.check_against_target(
        target_model_config.model,
        target_model_config.get_vocab_size(),
        trust_remote_code=target_model_config.trust_remote_code,
        target_tokenizer=getattr(target_model_config, "tokenizer", None),
    )
    engine_setup.check_parallelism(smurfs, target_parallel_config)
    engine_setup.check_in_worker_drafters(smurfs, target_model_config,
                                          engine_setup.kv_cache_space_bytes(engine_args),
                                          getattr(engine_args, "block_size", None))
    engine_setup.default_to_all_cores()
    additional = engine_args.additional_config
    if additional is None:
        additional = {}
    if not isinstance(additional, dict):
        raise ValueError(
            "additional_config must be a dict when speculative_config.method is 'smurfs'"
        )
    engine_args.additional_config = {**additional, ADDITIONAL_CONFIG_KEY: smurfs.model_dump()}
    engine_args.speculative_config = {
        "method": "custom_class",
        "model": PROPOSER_CLASS,
        "num_speculative_tokens": smurfs.num_speculative_tokens,
    }


def _create_speculative_config(self: EngineArgs, target_model_config, target_parallel_config):
    translate(self, target_model_config, target_parallel_config)
    return original(TARGET, NAME)(self, target_model_config, target_parallel_config)


def apply() -> bool:
    return replace_attribute(TARGET, NAME, _create_speculative_config)
