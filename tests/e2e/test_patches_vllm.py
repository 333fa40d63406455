"""The patches against the real vLLM symbols they replace."""

import pytest
import torch

pytestmark = pytest.mark.e2e


def test_register_is_idempotent_and_patches_targets():
    from importlib.metadata import entry_points

    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_smurfs import patches, plugin
    from vllm_smurfs.patches import _patching

    (entry,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "smurfs"]
    assert entry.load() is plugin.register
    plugin.register()
    plugin.register()
    assert patches.apply_all() == []  # everything already applied, nothing stacked twice
    assert _patching.is_patched(EngineArgs, "create_speculative_config")
    assert _patching.is_patched(EngineArgs, "add_cli_args")
    assert _patching.is_patched(GPUModelRunner, "propose_draft_token_ids")
    assert _patching.is_patched(GPUModelRunner, "execute_model")
    assert _patching.is_patched(GPUModelRunner, "initialize_metadata_builders")
    assert _patching.is_patched(rejection_sampler, "expand_batch_to_tokens")  # CPU machine
    assert _patching.is_patched(rejection_sampler, "apply_sampling_constraints")


def test_lookahead_slots_are_reserved_for_in_worker_drafters_only():
    """If vLLM reserved slots for every custom proposer, the patch could go (the first line)."""
    from types import SimpleNamespace

    from vllm.config import VllmConfig

    from vllm_smurfs import plugin
    from vllm_smurfs.patches import _patching

    plugin.register()
    vllm_answer = _patching.original(VllmConfig, "num_lookahead_tokens").fget

    def config(drafters, method="custom_class"):
        return SimpleNamespace(
            speculative_config=SimpleNamespace(method=method, num_speculative_tokens=5,
                                               use_eagle=lambda: False,
                                               uses_draft_model=lambda: False,
                                               use_dflash=lambda: False,
                                               use_dspark=lambda: False),
            additional_config={"smurfs": {"drafters": drafters}}, num_speculative_tokens=5)

    in_worker = config([{"model": "/m"}, {"method": "ngram"}])
    assert vllm_answer(in_worker) == 0  # what vLLM reserves for a custom proposer
    assert VllmConfig.num_lookahead_tokens.fget(in_worker) == 5
    assert VllmConfig.num_lookahead_tokens.fget(
        config([{"model": "/m", "placement": "process"}, {"method": "ngram"}])) == 0
    assert VllmConfig.num_lookahead_tokens.fget(config([{"method": "ngram"}])) == 0


def test_the_runner_method_that_initialises_drafter_attention_still_takes_the_kv_config():
    """The patch calls vLLM's body with (kv_cache_config, kernel_block_sizes): a changed
    signature means the patch must change."""
    import inspect

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_smurfs import plugin
    from vllm_smurfs.patches import _patching

    plugin.register()
    original = _patching.original(GPUModelRunner, "initialize_metadata_builders")
    assert list(inspect.signature(original).parameters) == [
        "self", "kv_cache_config", "kernel_block_sizes"]


def test_prompt_tokens_of_a_step_are_what_is_neither_next_token_nor_draft():
    from types import SimpleNamespace

    from vllm_smurfs.patches.model_runner_execute import prompt_tokens

    # "a" decodes with 3 draft tokens, "b" decodes without, "c" is a 100-token prompt chunk.
    out = SimpleNamespace(num_scheduled_tokens={"a": 4, "b": 1, "c": 100},
                          total_num_scheduled_tokens=105,
                          scheduled_spec_decode_tokens={"a": [1, 2, 3]})
    assert prompt_tokens(out) == 99
    out.num_scheduled_tokens, out.total_num_scheduled_tokens = {"a": 4, "b": 1}, 5
    assert prompt_tokens(out) == 0


def test_vllm_cpu_expand_is_still_broken_and_ours_is_right():
    """If the first assertion fails, vLLM fixed its CPU kernel: the patch can go."""
    import vllm._custom_ops  # noqa: F401 - loads the C++ kernels
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    from vllm_smurfs.patches import _patching
    from vllm_smurfs.patches.rejection_sampler_expand import expand_batch_to_tokens

    temperature = torch.tensor([1.0, 0.7, 0.0, 2.5])  # 0.0 = greedy request
    cu_num_tokens = torch.tensor([2, 3, 5, 6], dtype=torch.int32)
    expected = torch.tensor([1.0, 1.0, 0.7, 1.0, 1.0, 2.5])
    current_platform.register_triton_kernel_overrides()
    vllm_version = _patching.original(rejection_sampler, "expand_batch_to_tokens")
    vllm_result = vllm_version(temperature, cu_num_tokens, 6, replace_from=0, replace_to=1)
    assert not torch.equal(vllm_result, expected), "vLLM's CPU expand works now: drop the patch"
    ours = expand_batch_to_tokens(temperature, cu_num_tokens, 6, replace_from=0, replace_to=1)
    assert torch.equal(ours, expected)
    top_k = torch.tensor([5, 0, 7], dtype=torch.int32)
    assert expand_batch_to_tokens(top_k, torch.tensor([1, 3, 4]), 4).tolist() == [5, 0, 0, 7]


def test_vllm_sampling_constraints_still_fail_on_zero_drafts_with_top_k_and_ours_do_not():
    """If the first assertion fails, vLLM handles a step without drafts under top-k: the patch
    can go."""
    from types import SimpleNamespace

    from vllm.v1.sample import rejection_sampler

    from vllm_smurfs import plugin
    from vllm_smurfs.patches import _patching
    from vllm_smurfs.patches.rejection_sampler_constraints import apply_sampling_constraints

    plugin.register()
    metadata = SimpleNamespace(all_greedy=False, temperature=torch.tensor([1.0]),
                               top_k=torch.tensor([20], dtype=torch.int32), top_p=None)
    empty, cu = torch.zeros((0, 600)), torch.tensor([0], dtype=torch.int32)
    vllm_version = _patching.original(rejection_sampler, "apply_sampling_constraints")
    with pytest.raises(RuntimeError, match="numel"):
        vllm_version(empty.clone(), cu, metadata)
    assert apply_sampling_constraints(empty, cu, metadata).shape == (0, 600)
    # With draft positions, vLLM's own: the top 20 of each row are kept.
    logits = torch.randn(2, 600)
    out = apply_sampling_constraints(logits.clone(), torch.tensor([2], dtype=torch.int32),
                                     metadata)
    assert (out > -float("inf")).sum(dim=1).tolist() == [20, 20]


def test_our_log_records_go_where_vllms_do():
    import logging

    from vllm_smurfs import plugin

    plugin.register()
    plugin.route_logs_like_vllm()  # idempotent: one forwarding handler
    # (pytest's caplog may have added its own handlers to the logger: count ours only.)
    assert sum(isinstance(h, plugin._ToVllmLogger)
               for h in logging.getLogger("vllm_smurfs").handlers) == 1
    seen: list[logging.LogRecord] = []
    collector = logging.Handler()
    collector.emit = seen.append
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.addHandler(collector)
    try:
        # INFO, like the periodic per-drafter line: printed by vLLM's handlers, not dropped.
        logging.getLogger("vllm_smurfs.proposer").info("Smurfs drafters: %s", "{}")
    finally:
        vllm_logger.removeHandler(collector)
    assert [r.getMessage() for r in seen] == ["Smurfs drafters: {}"]
