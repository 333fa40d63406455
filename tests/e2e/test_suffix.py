"""The suffix voter in the collective, on the real vLLM CPU engine in float32 (tiny models):
lossless at batch 1 and under a moving batch, and drafting from its global cache."""

import json

import pytest

from smurfs_tools.jobs import divergences
from smurfs_tools.tiny_models import TINY_PROMPTS

from conftest import LOOKAHEAD
from test_in_worker import LONG_PROMPT, NO_KV_SPACE_ENV, SMALL_MAX_MODEL_LEN, run

pytestmark = pytest.mark.e2e

SUFFIX = {"method": "suffix"}


def collective(family, **extra) -> dict:
    """One in-worker drafter, the n-gram voter and the suffix voter; the model drafts in every
    step (on tiny models the controller would rightly leave it out, leaving nothing to check)."""
    return {"method": "smurfs", "num_speculative_tokens": LOOKAHEAD,
            "drafters": [{"model": family.drafts[0]},
                         {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4},
                         SUFFIX],
            "lookahead": {"min_tokens": 1}, **extra}


def drafter(result, name: str) -> dict:
    return next(d for d in result.smurfs_stats["drafters"] if d["name"] == name)


def test_the_collective_with_the_suffix_voter_is_lossless_at_batch_1(family, greedy_runs):
    reference = greedy_runs("none")
    smurfs = run(collective(family), target=family.target, one_at_a_time=True)
    assert divergences(reference.token_ids, smurfs.token_ids) == {}
    suffix, model = drafter(smurfs, "suffix"), drafter(smurfs, "draft-0")
    assert suffix["drafted_tokens"] > 0 and suffix["accepted_tokens"] > 0, suffix
    assert model["drafted_tokens"] > 0 and smurfs.smurfs_stats["drafter_forwards"] > 0


def test_16_requests_aborted_preempted_and_joining_with_the_suffix_voter_are_lossless(family):
    # 16 requests (the tiny prompts twice, so that later ones repeat earlier answers, and a long
    # one prefilled in chunks) on a small engine: 4 at a time in a KV cache of 320 tokens, so that
    # requests queue, join running batches and are preempted; three are aborted, two join late.
    prompts = [LONG_PROMPT] + list(TINY_PROMPTS) + list(TINY_PROMPTS[:7])
    max_tokens = [40, 120, 30, 120, 60, 10, 120, 90, 40, 64, 16, 100, 48, 64, 30, 80]
    aborts = {2: 5, 9: 12, 13: 1}
    # The target and one in-worker drafter: 2 KiB of KV cache per token.
    engine = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "block_size": 32,
              "kv_cache_memory_bytes": 320 * 2 * 1024}
    common = dict(target=family.target, prompts=prompts, max_tokens=max_tokens,
                  engine_args=engine, max_model_len=SMALL_MAX_MODEL_LEN, env=NO_KV_SPACE_ENV,
                  abort_after=aborts, arrive_at={10: 8, 15: 30})
    reference = run(None, **common)
    smurfs = run(collective(family), **common)
    assert smurfs.num_preemptions > 0, "the run was meant to preempt requests"
    assert smurfs.aborted == sorted(aborts) == reference.aborted
    for i, (ref, own) in enumerate(zip(reference.token_ids, smurfs.token_ids, strict=True)):
        if i in aborts:
            # Cut where the abort landed: a speculative step can emit several tokens at once.
            n = min(len(ref), len(own))
            assert n >= aborts[i] and ref[:n] == own[:n], f"prompt {i} diverged"
        else:
            assert ref == own, f"prompt {i} diverged (lengths {len(ref)}, {len(own)})"
    suffix = drafter(smurfs, "suffix")
    assert suffix["drafted_tokens"] > 0 and suffix["accepted_tokens"] > 0, suffix


def _per_request(trace) -> list[tuple[int, int, int]]:
    """(steps, draft tokens verified, accepted) per request, in the order requests came."""
    out: dict[str, list[int]] = {}
    for line in trace.read_text().splitlines():
        for request in json.loads(line)["requests"]:
            entry = out.setdefault(request["req_id"], [0, 0, 0])
            entry[0] += 1
            entry[1] += request["k"]
            entry[2] += request["accepted"]
    return [tuple(v) for v in out.values()]


REPEATED_PROMPT = TINY_PROMPTS[2]


@pytest.fixture(scope="module")
def repeated_reference(family) -> list[int]:
    return run(None, target=family.target, prompts=[REPEATED_PROMPT], max_tokens=64).token_ids[0]


@pytest.mark.parametrize("cached", [10000, 0])
def test_a_request_repeating_an_earlier_answer_is_drafted_from_the_global_cache(
        family, repeated_reference, tmp_path, cached):
    # The same prompt twice, one request after the other: the second request's answer is the
    # first's, and only the global tree holds it (its prompt holds no part of the answer). With
    # the global tree off (0 cached requests) the second request is drafted as the first was.
    prompt = REPEATED_PROMPT
    trace = tmp_path / "trace.jsonl"
    spec = {"method": "smurfs", "num_speculative_tokens": LOOKAHEAD,
            "drafters": [{**SUFFIX, "suffix_decoding_max_cached_requests": cached}],
            "lookahead": {"policy": "fixed"}, "trace_file": str(trace)}
    smurfs = run(spec, target=family.target, prompts=[prompt, prompt], max_tokens=64,
                 one_at_a_time=True)
    assert smurfs.token_ids == [repeated_reference, repeated_reference]
    # The last two: the job's warm-up request (4 tokens) comes first.
    (steps1, _, accepted1), (steps2, _, accepted2) = _per_request(trace)[-2:]
    print(f"\ncached={cached}: first {accepted1} accepted in {steps1} steps, second "
          f"{accepted2} in {steps2}")
    if cached:
        # Near the lookahead: a draft is at most as long as its match (vLLM's max_spec_factor
        # 1), so the first steps of the second request draft 1, 2 tokens, then all 4.
        assert accepted2 >= 0.75 * LOOKAHEAD * steps2, (accepted2, steps2)
        assert accepted2 / steps2 > 2 * accepted1 / steps1
    else:
        assert (steps2, accepted2) == (steps1, accepted1)
