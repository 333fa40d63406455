"""Drafters a user may bring: sliding-window and hybrid attention, vocabularies padded apart,
another tokenizer. Each either runs losslessly or is refused at start-up with a clear error.

Every run is the real vLLM CPU engine in float32 on tiny models derived from the tiny target
(`smurfs_tools.tiny_models`), compared token for token (and in length) with the same engine
without speculation.

Why the sliding-window case is the hard one: vLLM 0.32.0 gives a sliding-window drafter a KV
cache group of its own, laid over the same bytes as the target's group, whose manager frees each
block leaving the window; the runner's block table keeps the freed ids, and vLLM hands a freed
block to the next allocation at once. An in-worker drafter catches up lazily (after a chunked
prompt, after sitting out steps, after a preemption: from the start), so without a full-attention
cache of its own it wrote its KV over other requests' target KV: every request diverged.
"""

from __future__ import annotations

import json
import os
import random

import pytest
from vllm.engine.arg_utils import EngineArgs

from smurfs_tools.jobs import Job, Result, divergences, run_job
from smurfs_tools.tiny_models import (
    TINY_PROMPTS,
    build_llama_drafter,
    build_other_tokenizer_drafter,
    build_padded_model,
)

from conftest import MAX_TOKENS
from step_probe import group_steps, run_probe

pytestmark = pytest.mark.e2e

WINDOW = 32  # tokens: far below the prompts, so blocks leave the window while requests run


@pytest.fixture(scope="module")
def kinds(family, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafter-kinds")
    return {
        "sliding": build_llama_drafter(family.target, root / "sliding",
                                       ["sliding_attention"] * 2, WINDOW),
        "hybrid": build_llama_drafter(family.target, root / "hybrid",
                                      ["sliding_attention", "full_attention"], WINDOW),
        "padded-target": build_padded_model(family.target, root / "padded-target", 640),
        "padded-drafter": build_padded_model(family.target, root / "padded-drafter", 640,
                                             shifted_head=True),
        "other-tokenizer": build_other_tokenizer_drafter(family.target, root / "other-tok"),
    }


def long_prompts(n: int = 8) -> list[str]:
    """Prompts of about 300 to 700 tokens, each a different mix of the tiny prompts."""
    rng = random.Random(0)
    prompts = []
    for i in range(n):
        words: list[str] = []
        while len(words) < 300 + 20 * i:
            words += rng.choice(TINY_PROMPTS).split()
        prompts.append(" ".join(words))
    return prompts


# Long prompts prefilled in chunks of 64 tokens, 8 requests at once, and a KV pool of 100
# blocks of 32 tokens (about 3,200 tokens for 8 requests of 340 to 780): requests are preempted
# and blocks change hands all the time.
LONG = dict(prompts=long_prompts(), max_tokens=[40, 60, 30, 80, 50, 70, 45, 65],
            max_model_len=1024, env={"VLLM_CPU_KVCACHE_SPACE": ""},
            engine_args={"max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size": 32,
                         "kv_cache_memory_bytes": 100 * 32 * 1024})


def run(spec, **job) -> Result:
    result = run_job(Job(speculative_config=spec, **job))
    stats = dict(result.smurfs_stats or {})
    stats.pop("controller", None)
    print(f"\nlengths={[len(t) for t in result.token_ids]} preemptions={result.num_preemptions} "
          f"drafts={result.num_drafts} accepted={result.num_accepted_tokens} "
          f"smurfs={json.dumps(stats)}")
    return result


def one_drafter(model: str, policy: str = "fixed", **drafter) -> dict:
    spec = {"method": "smurfs", "num_speculative_tokens": 3,
            "drafters": [{"model": model, **drafter}], "lookahead": {"policy": policy}}
    if policy == "adaptive":
        spec["drafters"].append({"method": "ngram"})  # free drafts: the drafter sits steps out
    return spec


@pytest.fixture(scope="module")
def long_reference(family):
    return run(None, target=family.target, **LONG)


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_a_sliding_window_drafter_in_the_worker_is_lossless(family, kinds, long_reference,
                                                           policy):
    # 'fixed': the drafter drafts every step, catching up from 0 after each chunked prompt and
    # each preemption; 'adaptive': it also sits steps out and catches up after them.
    smurfs = run(one_drafter(kinds["sliding"], policy), target=family.target, **LONG)
    assert divergences(long_reference.token_ids, smurfs.token_ids) == {}
    assert smurfs.smurfs_stats["drafter_forwards"] > 0
    assert smurfs.num_preemptions > 0, "the run was meant to preempt requests"
    if policy == "adaptive":
        assert smurfs.smurfs_stats["steps_without_models"] > 0, "the drafter never sat out"


def test_a_hybrid_drafter_runs_in_the_worker_losslessly(family, kinds):
    # Sliding and full layers (Gemma-2/3 style): vLLM's draft-model machinery asserted that all
    # of a drafter's layers share one KV cache group; here they all keep a full-attention cache.
    common = dict(target=family.target, prompts=long_prompts(4), max_tokens=[30, 50, 20, 40],
                  max_model_len=1024)
    reference = run(None, **common)
    smurfs = run(one_drafter(kinds["hybrid"]), **common)
    assert divergences(reference.token_ids, smurfs.token_ids) == {}
    assert smurfs.smurfs_stats["drafter_forwards"] > 0 and smurfs.num_accepted_tokens > 0


def test_a_sliding_window_drafter_in_a_process_is_lossless(family, kinds):
    # Its own engine manages its sliding-window cache as vLLM means to. Synchronous drafting:
    # pipelined, a step only has this drafter's draft when its guess at the target's last token
    # was right, and this drafter (a 32-token window over prompts of 300 and more) is nearly
    # never right, so its drafts would be verified in one step of a hundred or none (CI saw 0).
    common = dict(target=family.target, prompts=long_prompts(4), max_tokens=[30, 50, 20, 40],
                  max_model_len=1024)
    reference = run(None, **common)
    smurfs = run({**one_drafter(kinds["sliding"], placement="process"), "pipeline": False},
                 **common)
    assert divergences(reference.token_ids, smurfs.token_ids) == {}
    stats = smurfs.smurfs_stats
    # Every request step drafts and waits for its draft (a hung drafter would be left out).
    assert stats["drafters"][0]["alive"]
    assert stats["proposed_drafts"] == stats["requests_drafted"] > 0
    assert stats["verified_drafts"] > 0


def test_a_target_padded_past_its_drafters_runs_losslessly(family, kinds):
    # One tokenizer (600 tokens), embeddings of 640 rows for the target and 600 for the drafters
    # (Qwen2.5-7B over Qwen2.5-0.5B): a check of embedding sizes refused the pair.
    common = dict(target=kinds["padded-target"], prompts=list(TINY_PROMPTS), max_tokens=32)
    reference = run(None, **common)
    smurfs = run(one_drafter(family.drafts[0]), **common)
    assert divergences(reference.token_ids, smurfs.token_ids) == {}
    assert smurfs.num_accepted_tokens > 0


def test_a_drafter_padded_past_the_target_drafts_only_ids_the_target_has(family, kinds,
                                                                        greedy_runs):
    # The drafter prefers ids 600 to 639, which its tokenizer (the target's) does not have and
    # the target has no row for: what reaches vLLM's verifier must stop before them. (On CPU
    # vLLM's rejection sampler reads such an id's probability out of bounds without failing;
    # on a GPU it is an out-of-bounds access.) In the worker it drafts its best ids below the
    # target's size instead.
    result = run_probe(family.target, one_drafter(kinds["padded-drafter"]), rounds=1,
                       prompts=list(TINY_PROMPTS), max_tokens=MAX_TOKENS, max_model_len=512,
                       engine_args={})
    assert divergences(greedy_runs("none").token_ids, result["rounds"][0]["token_ids"]) == {}
    proposes = [s["propose"] for s in group_steps(result) if s["propose"] is not None]
    assert sum(p["draft_tokens"] for p in proposes) > 0
    assert max(p["max_draft_id"] for p in proposes) < 600


def engine_config(target: str, spec: dict) -> None:
    EngineArgs(model=target, dtype="float32", max_model_len=256,
               speculative_config=spec).create_engine_config()


def test_a_drafter_with_another_tokenizer_of_the_same_size_is_refused(family, kinds):
    with pytest.raises(ValueError) as info:
        engine_config(family.target, one_drafter(kinds["other-tokenizer"]))
    message = str(info.value)
    assert kinds["other-tokenizer"] in message and family.target in message
    assert "another tokenizer" in message and "600 tokens against 600" in message


def layered_model(family, tmp_path, name: str, **config) -> str:
    """The tiny target's config with ``config`` changes and its tokenizer (no weights: the
    checks at start-up read the config)."""
    folder = tmp_path / name
    folder.mkdir()
    base = json.loads(open(os.path.join(family.target, "config.json")).read())
    base.pop("layer_types")  # Qwen2's; other architectures derive theirs
    (folder / "config.json").write_text(json.dumps({**base, **config}))
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (folder / file).write_bytes(open(os.path.join(family.target, file), "rb").read())
    return str(folder)


@pytest.mark.parametrize("kind", ["mamba-hybrid", "linear-attention"])
def test_drafters_with_layers_the_worker_cannot_keep_are_refused(family, tmp_path, kind):
    if kind == "mamba-hybrid":  # Jamba-like: attention and Mamba layers
        model = layered_model(family, tmp_path, kind, architectures=["JambaForCausalLM"],
                              model_type="jamba")
        what = "a recurrent state"
    else:  # Qwen3-Next-like layer kinds
        model = layered_model(family, tmp_path, kind,
                              layer_types=["linear_attention", "full_attention"])
        what = r"layers of kind \['linear_attention'\]"
    with pytest.raises(ValueError, match=rf"drafters\[0\]\.model: drafter '{kind}' .* has "
                                         rf"{what}.*\"placement\": \"process\""):
        engine_config(family.target, one_drafter(model))
    # In a process of its own it passes the start-up checks.
    engine_config(family.target, one_drafter(model, placement="process"))


def test_the_v2_model_runner_is_refused_naming_the_variable(family, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match=r"VLLM_USE_V2_MODEL_RUNNER=1: .* V1 model runner"):
        engine_config(family.target, one_drafter(family.drafts[0]))
