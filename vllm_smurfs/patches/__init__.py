"""Every change this plugin makes to vLLM 0.32.0, in one ledger. One module per target.

| module | target (vLLM symbol) | why | how | when it can go |
| --- | --- | --- | --- | --- |
| engine_args_speculative | `vllm.engine.arg_utils.EngineArgs.create_speculative_config` | `SpeculativeConfig` refuses `method: smurfs` and its keys | validate a `SmurfsConfig`, store it in `additional_config["smurfs"]`, pass vLLM the equivalent `custom_class` config | vLLM lets plugins register speculative methods |
| cli_speculative_config | `vllm.engine.arg_utils.EngineArgs.add_cli_args` | `--speculative-config` takes inline JSON only | the option's `type` also reads a JSON file path | vLLM accepts a path there |
| rejection_sampler_expand | `vllm.v1.sample.rejection_sampler.expand_batch_to_tokens` (CPU only) | the CPU kernel wrapper never writes float outputs: verification at temperature > 0 divides logits by uninitialised memory, lossy for every method | a `torch.repeat_interleave` version on CPU | the CPU wrapper writes float outputs back |
| rejection_sampler_constraints | `vllm.v1.sample.rejection_sampler.apply_sampling_constraints` | vLLM runs the rejection sampler on steps without any draft too; with zero draft positions and a request's `top_k`, CPU's `apply_top_k_only` takes `max()` of an empty tensor: the engine dies at the first such step, for every speculative method | zero draft positions: return the (empty) logits; otherwise vLLM's own | `apply_top_k_only` or the rejection sampler handles zero rows |
| model_runner_propose | `vllm.v1.worker.gpu_model_runner.GPUModelRunner.propose_draft_token_ids` | custom proposers get no request ids, lifecycle events or prompt lengths, and their draft probabilities are never read (a sampled chain must be verified against its q); a drafter whose embedding is padded past the target's could draft an id the target has no row for | hand the proposer a `StepContext` (req ids, finished, preempted/resumed, lookahead, prompt lengths, the runner) before vLLM's body and mark the step's propose as come; after it, set the runner's `_draft_probs` from the proposer's `take_last_draft_probs()` (as vLLM does for its own proposers) and cut each draft before its first id >= the target's vocabulary size | vLLM passes them to custom proposers, reads `take_last_draft_probs` of them, and bounds custom drafts |
| model_runner_kv_cache | `vllm.v1.worker.gpu_model_runner.GPUModelRunner.initialize_metadata_builders` | the runner initialises the attention groups of vLLM's own draft models only: in-worker drafters (vLLM `DraftModelProposer`s inside a `custom_class` proposer) would have a KV cache and no way to address it | after vLLM's body, the Smurfs proposer initialises each in-worker drafter's attention groups (vLLM's own method); the runner binds their KV cache through the proposer's `draft_attn_groups` as for its own drafters | vLLM initialises the attention backend of every proposer that has one |
| vllm_config_lookahead | `vllm.config.VllmConfig.num_lookahead_tokens` (property) | in-worker drafters write KV for the sampled token and their draft tokens, past the target's scheduled tokens; vLLM reserves those slots for its own draft models only | with a Smurfs config that has an in-worker drafter, answer `num_speculative_tokens` (what vLLM answers for `draft_model`) | a custom proposer can declare its lookahead slots |
| model_runner_execute | `vllm.v1.worker.gpu_model_runner.GPUModelRunner.execute_model` | vLLM skips `propose` in steps with no scheduled tokens and in steps with a request near `max_model_len`: finished, preempted and resumed requests seen only there leave per-request state behind, and drafts verified there get scored against a later step; and a CPU GEMM primitive keeps the thread count it was created with (a prompt chunk computed while a drafter borrows a core slows every later step of its size, 2048-token steps 2x) | before vLLM's body: tell the proposer of a skipped propose (`propose_skipped`), make it `forget` the step's finished, preempted and resumed requests, and tell it the step's prompt tokens (it takes the cores back first) | vLLM hands custom proposers every step's request events; vLLM's CPU GEMM cache keys on the thread count |

Each patch records the original (see `_patching`), refuses to patch twice, and is tested in
``tests/unit/test_patches.py``.

Not a patch of a vLLM class, but a change to what vLLM sees: `drafters.in_worker_kv` replaces
``get_kv_cache_spec`` on the attention layer objects of an in-worker drafter (instances the
drafter owns) whose attention is local (sliding window, chunked): they declare the full-attention
KV cache of their shape, so vLLM keeps their blocks for the request's whole life (a lazy catch-up
writes old positions; vLLM's sliding-window manager would free those blocks and hand them to other
requests). It can go when vLLM's draft-model machinery catches up lazily itself, or an in-worker
drafter keeps a cache of its own.
"""

from __future__ import annotations

import importlib

PATCH_MODULES = (
    "vllm_smurfs.patches.engine_args_speculative",
    "vllm_smurfs.patches.cli_speculative_config",
    "vllm_smurfs.patches.model_runner_propose",
    "vllm_smurfs.patches.model_runner_execute",
    "vllm_smurfs.patches.model_runner_kv_cache",
    "vllm_smurfs.patches.vllm_config_lookahead",
    "vllm_smurfs.patches.rejection_sampler_expand",
    "vllm_smurfs.patches.rejection_sampler_constraints",
)


def apply_all() -> list[str]:
    """Apply every patch; return the modules that were newly applied (idempotent)."""
    applied = []
    for name in PATCH_MODULES:
        if importlib.import_module(name).apply():
            applied.append(name)
    return applied
