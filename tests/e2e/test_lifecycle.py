"""Request lifecycle on the real engine when vLLM skips ``propose``.

vLLM calls a custom proposer only from ``propose_draft_token_ids``, which it skips in steps with
no scheduled tokens (the step that carries the last finished requests before the engine goes
idle) and in every step with a request within num_speculative_tokens of ``max_model_len``.
Finished, preempted and resumed requests announced only in such steps left per-request state
behind, and drafts verified in them were scored against a later step. The runs here record, step
by step, what the runner saw and what reached the proposer (`step_probe.py`), on the real
vLLM CPU engine in float32.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from step_probe import group_steps, run_probe

from smurfs_tools.jobs import Job, divergences, run_job
from smurfs_tools.tiny_models import TINY_PROMPTS

pytestmark = pytest.mark.e2e

# Requests that all run into max_model_len (192 tokens), 6 at a time in a KV pool of 16 blocks of
# 32 tokens (a request needs up to 6): preemptions throughout, and steps without propose near the
# end of each request.
TIGHT = dict(prompts=[" ".join([p] * 2) for p in TINY_PROMPTS], max_tokens=[400] * 8,
             max_model_len=192,
             engine_args={"max_num_seqs": 6, "max_num_batched_tokens": 64, "block_size": 32,
                          "kv_cache_memory_bytes": 16 * 4 * 32 * 512})


def default_config(drafter: str, placement: str = "worker", **extra: Any) -> dict:
    """The default configuration (adaptive lookahead) with one model drafter and the n-gram
    voter."""
    return {"method": "smurfs", "num_speculative_tokens": 4,
            "drafters": [{"model": drafter, "placement": placement}, {"method": "ngram"}],
            **extra}


def skipped(step: dict) -> bool:
    return step["exec"]["tokens"] > 0 and step["propose"] is None


@pytest.fixture(scope="module")
def runs(family):
    @functools.cache
    def get(name: str) -> dict:
        if name == "tight":
            result = run_probe(family.target, default_config(family.drafts[0]), rounds=2,
                               **TIGHT)
        elif name == "tight-fixed":  # drafts every step: some always await their verification
            result = run_probe(family.target, default_config(
                family.drafts[0], lookahead={"policy": "fixed"}), rounds=1, **TIGHT)
        else:  # a process drafter: its client mirrors each request's path
            result = run_probe(family.target, default_config(family.drafts[0], "process"),
                               rounds=2, prompts=list(TINY_PROMPTS), max_tokens=[24] * 8,
                               max_model_len=512, engine_args={})
        grouped = group_steps(result)
        print(f"\n[{name}] steps={len(grouped)} skipped={sum(map(skipped, grouped))} "
              f"preemptions={result['preemptions']} "
              f"live={[r['live_state'] for r in result['rounds']]}")
        return result

    return get


@pytest.mark.parametrize("name", ["tight", "process"])
def test_generate_twice_leaves_no_request_state_anywhere(runs, name):
    for index, round_ in enumerate(runs(name)["rounds"]):
        # The proposer's requests and pending drafts, the planner's and the policy's acceptance
        # records, the in-worker drafter's catch-up positions, the process drafter's paths.
        assert set(round_["live_state"].values()) == {0}, (index, round_["live_state"])


def test_a_preemption_on_a_skipped_step_reaches_the_proposer_in_that_step(runs):
    grouped = group_steps(runs("tight"))
    landed = [s for s in grouped if skipped(s) and (s["exec"]["preempted"]
                                                     or s["exec"]["resumed"])]
    assert landed, "no preemption or resume landed on a step without propose"
    for s in grouped:
        restarted = set(s["exec"]["preempted"]) | set(s["exec"]["resumed"])
        # Forgotten in the step itself: the drafter's KV cache starts over with the request.
        assert restarted <= s["forgot"], (s["exec"], sorted(s["forgot"]))


def test_requests_ending_at_max_model_len_stay_lossless_and_drafts_are_scored_in_their_step(
        family, runs):
    result = runs("tight-fixed")
    reference = run_job(Job(target=family.target, env={"VLLM_CPU_KVCACHE_SPACE": ""}, **TIGHT))
    for round_ in result["rounds"]:
        assert divergences(reference.token_ids, round_["token_ids"]) == {}
        assert all(len(t) + n == TIGHT["max_model_len"]
                   for t, n in zip(round_["token_ids"], round_["prompt_lens"]))
    grouped = group_steps(result)
    after_skip = [b["propose"]["state"] for a, b in zip(grouped, grouped[1:])
                  if skipped(a) and b["propose"] is not None]
    assert after_skip, "no step without propose was followed by one with it"
    # The drafts sent for a skipped step were verified there: none awaits a later step's score.
    assert [s["pending_drafts"] for s in after_skip] == [0] * len(after_skip)
    for s in grouped:  # finished requests too, in their own step
        assert set(s["exec"]["finished"]) <= s["forgot"]
