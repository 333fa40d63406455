"""In-worker drafters on vLLM's draft-model machinery: lossless however the batch moves.

Every run here is the real vLLM CPU engine in float32 on the tiny models, compared token for token
(and in length) with a run of the same engine settings without speculation.
"""

import json
from pathlib import Path

import pytest

from smurfs_tools.jobs import Job, Result, divergences, run_job
from smurfs_tools.tiny_models import TINY_PROMPTS

from conftest import MAX_TOKENS, default_config, smurfs_config

pytestmark = pytest.mark.e2e

# Test-only instrumentation of the engine's process: records every in-worker draft.
DRAFT_RECORDER = str(Path(__file__).with_name("draft_recorder.py"))
DRAFTER_CONTEXT = 64  # max_model_len of the drafter that stops drafting past it

# A prompt longer than the step's token budget below: its prefill is split into chunks.
LONG_PROMPT = " ".join([TINY_PROMPTS[6]] * 8)
# A small engine: 3 requests at a time, 64 tokens per step, 32-token blocks, and a KV cache of
# 10 blocks (320 tokens; a token takes 1 KiB for the target and as much for each in-worker
# drafter): requests queue, join running batches, get preempted (recomputed) when the running
# ones grow, and the long prompt (240 tokens) is prefilled in chunks.
SMALL_MAX_MODEL_LEN = 288  # 9 blocks, and the one vLLM keeps empty


def small_engine(kib_per_token: int) -> dict:
    return {"max_num_seqs": 3, "max_num_batched_tokens": 64, "block_size": 32,
            "kv_cache_memory_bytes": 320 * kib_per_token * 1024}


# VLLM_CPU_KVCACHE_SPACE would override kv_cache_memory_bytes: unset it.
NO_KV_SPACE_ENV = {"VLLM_CPU_KVCACHE_SPACE": ""}


def run(spec, prompts=None, max_tokens=None, **job) -> Result:
    result = run_job(Job(target=job.pop("target"), prompts=prompts or list(TINY_PROMPTS),
                         speculative_config=spec, max_tokens=max_tokens or MAX_TOKENS, **job))
    stats = dict(result.smurfs_stats or {})
    stats.pop("controller", None)
    print(f"\nlengths={[len(t) for t in result.token_ids]} preemptions={result.num_preemptions} "
          f"mal={result.mean_acceptance_length} smurfs={json.dumps(stats)}")
    return result


def test_an_in_worker_drafter_drafts_what_vllms_draft_model_drafts(greedy_runs):
    # One in-worker drafter at vLLM draft_model's fixed lookahead: the same model on the same
    # machinery drafts the same tokens, so the target accepts the same ones at each position.
    reference, ours, vllms = greedy_runs("none"), greedy_runs("smurfs-one"), greedy_runs(
        "draft_model-0")
    assert divergences(reference.token_ids, ours.token_ids) == {}
    assert ours.num_drafts == vllms.num_drafts > 0
    assert ours.accepted_per_position == vllms.accepted_per_position
    assert ours.smurfs_stats["drafter_forwards"] > 0


def test_the_default_config_switches_model_drafting_mid_request_and_stays_lossless(family,
                                                                                   tmp_path):
    # Long outputs: the controller plans each step per request, drafting with the model drafter
    # where it pays and leaving it out where the n-gram chain or no draft is worth more.
    trace = tmp_path / "trace.jsonl"
    long_tokens = [400] * len(TINY_PROMPTS)
    reference = run(None, max_tokens=long_tokens, target=family.target)
    config = default_config(family, trace_file=str(trace))
    config["drafters"] = config["drafters"][-2:]  # one model drafter and the n-gram voter
    smurfs = run(config, max_tokens=long_tokens, target=family.target)
    assert divergences(reference.token_ids, smurfs.token_ids) == {}
    assert smurfs.num_drafts > 0 and smurfs.smurfs_stats["drafter_forwards"] > 0
    # Per request, whether the model drafter drafted for it in each verified step, in order.
    modes: dict[str, list[bool]] = {}
    for line in trace.read_text().splitlines():
        for request in json.loads(line)["requests"]:
            drafted = any(d is not None for d in request.get("drafts", []))
            modes.setdefault(request["req_id"], []).append(drafted)
    switched = [r for r, m in modes.items()
                if any(a and not b for a, b in zip(m, m[1:]))
                and any(not a and b for a, b in zip(m, m[1:]))]
    assert switched, f"no request had the models switched off and on again: {modes}"


def test_the_default_config_at_batch_1_is_lossless(family, greedy_runs):
    reference = greedy_runs("none")
    smurfs = run(default_config(family), target=family.target, one_at_a_time=True)
    assert smurfs.num_drafts > 0 and smurfs.smurfs_stats["drafter_forwards"] > 0
    assert divergences(reference.token_ids, smurfs.token_ids) == {}


def test_16_requests_some_past_a_drafters_context_are_lossless_and_not_drafted_by_it(
        family, tmp_path):
    # 16 requests of mixed lengths at once, the default config with one drafter's context limit
    # (64 tokens) below the longer requests' (at least one draft token per step, so that the
    # model drafters draft throughout: on tiny models the controller would rightly stop them).
    prompts = list(TINY_PROMPTS) * 2
    max_tokens = [8, 120, 16, 90, 3, 48, 150, 32, 70, 5, 100, 20, 60, 130, 40, 11]
    spec = default_config(family, lookahead={"min_tokens": 1})
    spec["drafters"][0] = {"model": family.drafts[0], "max_model_len": DRAFTER_CONTEXT}
    common = dict(target=family.target, prompts=prompts, max_tokens=max_tokens)
    reference = run(None, **common)
    log = tmp_path / "drafts.jsonl"
    smurfs = run(spec, preload=[DRAFT_RECORDER], env={"SMURFS_TEST_DRAFT_LOG": str(log)},
                 **common)
    assert smurfs.num_drafts > 0 and smurfs.smurfs_stats["drafter_forwards"] > 0
    assert divergences(reference.token_ids, smurfs.token_ids) == {}
    # Per (request, context length), i.e. per request and step: tokens each drafter drafted.
    drafted: dict[tuple[str, int], dict[str, int]] = {}
    for line in log.read_text().splitlines():
        call = json.loads(line)
        for req_id, context_len, n in call["requests"]:
            drafted.setdefault((req_id, context_len), {})[call["drafter"]] = n
    past = {key: per for key, per in drafted.items() if key[1] >= DRAFTER_CONTEXT}
    within = {key: per for key, per in drafted.items() if key[1] < DRAFTER_CONTEXT}
    # The others drafted for requests past draft-0's context ...
    assert sum(per.get("draft-1", 0) + per.get("draft-2", 0) for per in past.values()) > 0
    # ... while draft-0 drafted for the requests within it, and never for one past it.
    assert sum(per.get("draft-0", 0) for per in within.values()) > 0
    assert [key for key, per in past.items() if per.get("draft-0", 0)] == []


def test_a_trimmed_draft_vocabulary_drafts_the_texts_own_ids_beyond_it_losslessly(
        family, greedy_runs, tmp_path):
    # The tiny byte-level BPE lists its 256 bytes first, then its merges: at 300 ids most words
    # lie beyond the limit, and a drafter may draft them only where the texts it drafts for have
    # them.
    limit = 300
    spec = smurfs_config(family)
    spec["drafters"] = [{"model": d, "draft_vocab_size": limit} for d in family.drafts]
    log = tmp_path / "drafts.jsonl"
    smurfs = run(spec, target=family.target, preload=[DRAFT_RECORDER],
                 env={"SMURFS_TEST_DRAFT_LOG": str(log)})
    assert divergences(greedy_runs("none").token_ids, smurfs.token_ids) == {}
    drafted = [pair for line in log.read_text().splitlines()
               for request in json.loads(line)["drafts"] for pair in request]
    beyond = [in_text for token, in_text in drafted if token >= limit]
    assert len(drafted) > 100 and len(beyond) > 10
    assert all(beyond)  # every id beyond the limit is one of the texts'
    assert smurfs.num_accepted_tokens > 0


@pytest.mark.parametrize("placement", ["worker", "process"])
def test_preemption_chunked_prefill_and_requests_joining_stay_lossless(family, placement):
    prompts = [LONG_PROMPT] + list(TINY_PROMPTS)
    max_tokens = [40, 120, 30, 120, 60, 10, 120, 90, 40]  # the long prompt: 240 + 40 tokens
    # Requests arrive while others run; two join late.
    arrive_at = {7: 12, 8: 30}
    kib = 4 if placement == "worker" else 1  # process drafters keep their own KV caches
    common = dict(target=family.target, prompts=prompts, max_tokens=max_tokens,
                  engine_args=small_engine(kib), max_model_len=SMALL_MAX_MODEL_LEN,
                  arrive_at=arrive_at, env=NO_KV_SPACE_ENV)
    reference = run(None, **common)
    smurfs = run(smurfs_config(family, placement), **common)
    assert smurfs.num_preemptions > 0, "the run was meant to preempt requests"
    assert smurfs.num_drafts > 0 and smurfs.num_accepted_tokens > 0
    assert divergences(reference.token_ids, smurfs.token_ids) == {}


def test_aborted_requests_leave_the_others_identical(family):
    aborts = {1: 5, 3: 20, 6: 1}
    common = dict(target=family.target, abort_after=aborts, arrive_at={5: 3})
    reference = run(None, **common)
    smurfs = run(smurfs_config(family), **common)
    assert smurfs.aborted == sorted(aborts) == reference.aborted
    assert smurfs.num_drafts > 0
    for i, (ref, own) in enumerate(zip(reference.token_ids, smurfs.token_ids)):
        if i in aborts:
            # Cut where the abort landed: a speculative step can emit several tokens at once.
            n = min(len(ref), len(own))
            assert n >= aborts[i] and ref[:n] == own[:n]
        else:
            assert ref == own, f"prompt {i} diverged"


def test_a_failing_in_worker_drafter_is_left_out_and_output_unchanged(family, greedy_runs):
    spec = smurfs_config(family)
    result = run(spec, target=family.target,
                 env={"SMURFS_DRAFTER_FAULT": "draft-1=raise_after:10"})
    assert divergences(greedy_runs("none").token_ids, result.token_ids) == {}
    stats = {d["name"]: d for d in result.smurfs_stats["drafters"]}
    # It drafted in the measured run before its fault, and was left out at the fault: it drafted
    # for a fraction of the steps the others drafted for.
    assert stats["draft-1"]["engine_steps"] > 0 and stats["draft-1"]["drafted_tokens"] > 0
    assert stats["draft-1"]["alive"] is False
    assert stats["draft-0"]["alive"] and stats["draft-2"]["alive"]
    assert 2 * stats["draft-1"]["engine_steps"] < stats["draft-0"]["engine_steps"]
    assert result.num_accepted_tokens > 0  # the others kept speculating


def test_too_little_kv_cache_space_for_target_and_drafters_is_refused(family, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    # 1 MiB: two requests' worth of the target alone (1 KiB a token), a quarter of one request
    # for the target and its three drafters together.
    def config(placement: str):
        return EngineArgs(model=family.target, dtype="float32", max_model_len=500,
                          kv_cache_memory_bytes=2**20,
                          speculative_config=smurfs_config(family, placement)
                          ).create_engine_config()

    with pytest.raises(ValueError, match=r"drafters: the KV cache space .* holds 256 tokens of "
                                         r"the target and its in-worker drafters .* "
                                         r"max_model_len=500 needs"):
        config("worker")
    config("process")  # process drafters have caches of their own
