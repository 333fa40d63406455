"""The suffix voter (vllm_smurfs.drafters.model_free.SuffixVoter) against Arctic's cache driven the
way vLLM's own ``suffix`` proposer drives it, its global cache, and its config."""

from __future__ import annotations

import random

import numpy as np
import pytest
from arctic_inference.suffix_decoding import SuffixDecodingCache

from vllm_smurfs import config as config_module
from vllm_smurfs.config import SmurfsConfig, SuffixDrafterConfig
from vllm_smurfs.drafters.model_free import SuffixVoter
from vllm_smurfs.multi_draft_worker import DrafterPool, DraftRequest

DEPTH, SPEC_FACTOR, MIN_PROB = 24, 1.0, 0.1


class VllmSuffixReference:
    """`vllm.v1.spec_decode.suffix_decoding.SuffixDecodingProposer.propose` (vLLM 0.32.0) written
    out for one request at a time: a request new to the cache starts from its prompt (an old
    cached output of the same id evicted), each step's sampled tokens are added, the pattern is
    the text's last ``max_tree_depth`` tokens, and requests absent from a step are stopped."""

    def __init__(self, max_cached_requests: int = 10000) -> None:
        self.cache = SuffixDecodingCache(max_tree_depth=DEPTH,
                                         max_cached_requests=max_cached_requests)

    def step(self, batch: dict[str, tuple[list[int], int, list[int]]], k: int
             ) -> dict[str, list[int]]:
        """batch: req_id -> (text, prompt length, tokens sampled this step)."""
        out = {}
        for req_id, (text, num_prompt, sampled) in batch.items():
            if req_id not in self.cache.active_requests:
                if req_id in self.cache.cached_requests:
                    self.cache.evict_cached_response(req_id)
                self.cache.start_request(req_id, np.asarray(text[:num_prompt], np.int32))
            self.cache.add_active_response(req_id, sampled)
            pattern = np.asarray(text[max(0, len(text) - DEPTH):], np.int32)
            draft = self.cache.speculate(req_id, pattern, max_spec_tokens=k,
                                         max_spec_factor=SPEC_FACTOR, min_token_prob=MIN_PROB)
            out[req_id] = list(draft.token_ids)
        for req_id in set(self.cache.active_requests) - batch.keys():
            self.cache.stop_request(req_id)
        return out


def _phrase_stream(rng: random.Random, length: int) -> list[int]:
    """Text made of a few recurring phrases (so that suffixes match) with some noise."""
    phrases = [[rng.randrange(50) for _ in range(rng.randint(3, 8))] for _ in range(6)]
    out: list[int] = []
    while len(out) < length:
        out.extend(rng.choice(phrases) if rng.random() < 0.8 else [rng.randrange(50)])
    return out[:length]


@pytest.mark.parametrize("seed", range(6))
def test_drafts_are_those_of_vllms_suffix_proposer_on_the_same_token_streams(seed):
    rng = random.Random(seed)
    voter, reference = SuffixVoter(DEPTH, 10000, SPEC_FACTOR, MIN_PROB), VllmSuffixReference()
    # Requests run in overlapping waves: each has a prompt and an output stream; every step each
    # running request gains 1 to 4 tokens (accepted drafts plus the bonus token).
    pending = [(f"r{i}", rng.randint(5, 40), _phrase_stream(rng, 160)) for i in range(12)]
    # req_id -> [stream, prompt length, text length now, text length at its last step]
    running: dict[str, list] = {}
    compared = nonempty = 0
    while pending or running:
        while pending and (not running or len(running) < 4 and rng.random() < 0.5):
            req_id, num_prompt, stream = pending.pop(0)
            running[req_id] = [stream, num_prompt, num_prompt + 1, num_prompt]  # prefill's token
        batch = {req_id: (stream[:now], num_prompt, stream[last:now])
                 for req_id, (stream, num_prompt, now, last) in running.items()}
        k = rng.randint(1, 8)
        expected = reference.step(batch, k)
        for req_id, (text, num_prompt, _) in batch.items():
            got = voter.propose(req_id, np.asarray(text, np.int64), k, num_prompt)
            assert got == expected[req_id], (seed, req_id, len(text))
            compared += 1
            nonempty += bool(got)
        for req_id, state in list(running.items()):
            stream, _, now, _ = state
            if now >= len(stream) or rng.random() < 0.01:  # finished or aborted
                del running[req_id]
                voter.forget([req_id])
            else:
                state[2:] = [min(len(stream), now + rng.randint(1, 4)), now]
    assert compared > 200 and nonempty > compared // 4, (compared, nonempty)


def test_a_repeated_answer_is_drafted_from_the_global_cache_without_a_hint_in_the_prompt():
    rng = random.Random(7)
    answer = rng.sample(range(1000, 2000), 60)  # no token repeats within it
    voter = SuffixVoter()
    first = [1, 2, 3, 4, 5]
    for n in range(1, len(answer) + 1):  # the first request writes the answer token by token
        voter.propose("first", np.asarray(first + answer[:n]), 4, len(first))
    voter.forget(["first"])
    second = [7, 8, 9]  # another prompt, sharing no token with the answer
    drafts = [voter.propose("second", np.asarray(second + answer[:n]), 4, len(second))
              for n in range(1, len(answer) - 4)]
    # Every draft continues the answer, as long as the part written so far (vLLM's default
    # max_spec_factor 1) up to the four tokens asked for.
    assert drafts == [answer[n:n + min(n, 4)] for n in range(1, len(answer) - 4)]
    # Without the global tree the same text gets no draft: the hint was the cache, not the prompt.
    local_only = SuffixVoter(max_cached_requests=0)
    for n in range(1, len(answer) + 1):
        local_only.propose("first", np.asarray(first + answer[:n]), 4, len(first))
    local_only.forget(["first"])
    assert all(local_only.propose("second", np.asarray(second + answer[:n]), 4, len(second)) == []
               for n in range(1, len(answer) - 4))


def test_a_preempted_request_resumes_with_its_output_cached_once():
    voter = SuffixVoter()
    prompt, output = [1, 2, 3], list(range(100, 140))
    voter.propose("a", np.asarray(prompt + output[:20]), 4, len(prompt))
    voter.forget(["a"])  # preempted: its partial output stays cached
    assert voter.active == 0 and list(voter.cache.cached_requests) == ["a"]
    voter.propose("a", np.asarray(prompt + output[:30]), 4, len(prompt))  # resumed, recomputed
    assert voter.active == 1 and list(voter.cache.cached_requests) == ["a"]
    voter.forget(["a"])
    # Its whole output, before and after the preemption, is in the global tree, once: a new
    # request writing it is drafted all along, and exactly (a duplicate would not change the
    # draft; a lost first half would leave positions 3-19 undrafted).
    drafts = [voter.propose("b", np.asarray([9] + output[:n]), 3, 1) for n in range(3, 27)]
    assert drafts == [output[n:n + 3] for n in range(3, 27)]


def test_asking_for_no_tokens_still_feeds_the_cache_and_unknown_requests_are_harmless():
    voter = SuffixVoter()
    voter.forget(["never-seen"])
    answer = list(range(500, 540))
    for n in range(1, 41):
        assert voter.propose("a", np.asarray([1] + answer[:n]), 0, 1) == []
    voter.forget(["a", "a"])
    assert voter.propose("b", np.asarray([2] + answer[:5]), 3, 1) == answer[5:8]


def test_the_whole_first_context_is_the_prompt_when_its_length_is_unknown():
    voter = SuffixVoter()
    voter.propose("a", np.asarray([1, 2, 3, 4]), 2)  # no prompt length: all of it is prompt
    voter.propose("a", np.asarray([1, 2, 3, 4, 5, 6]), 2)
    voter.forget(["a"])
    # Only [5, 6] went to the global tree as output: [3, 4] leads nowhere for another request.
    assert voter.propose("b", np.asarray([9, 3, 4]), 2, 1) == []
    assert voter.propose("c", np.asarray([9, 5]), 1, 1) == [6]


@pytest.mark.parametrize("key, value, message", [
    ("suffix_decoding_max_tree_depth", 0, "suffix_decoding_max_tree_depth"),
    ("suffix_decoding_max_cached_requests", -1, "suffix_decoding_max_cached_requests"),
    ("suffix_decoding_max_spec_factor", -0.5, "suffix_decoding_max_spec_factor"),
    ("suffix_decoding_min_token_prob", 1.5, "suffix_decoding_min_token_prob"),
])
def test_bad_settings_are_refused_naming_the_key(key, value, message):
    with pytest.raises(ValueError, match=message):
        SmurfsConfig.from_user_dict({"method": "smurfs", "num_speculative_tokens": 4,
                                     "drafters": [{"method": "suffix", key: value}]})
    with pytest.raises(ValueError, match=message):
        SuffixVoter(**{key.removeprefix("suffix_decoding_"): value})


def test_the_config_takes_vllms_settings_and_refuses_unknown_keys():
    config = SmurfsConfig.from_user_dict({"method": "smurfs", "num_speculative_tokens": 4,
                                          "drafters": [{"method": "suffix"}]})
    drafter = config.drafters[0]
    assert isinstance(drafter, SuffixDrafterConfig) and drafter.display_name == "suffix"
    # vLLM's defaults (vllm/config/speculative.py, 0.32.0).
    assert (drafter.suffix_decoding_max_tree_depth, drafter.suffix_decoding_max_cached_requests,
            drafter.suffix_decoding_max_spec_factor,
            drafter.suffix_decoding_min_token_prob) == (24, 10000, 1.0, 0.1)
    with pytest.raises(ValueError, match=r"drafters\[0\]\.max_depth: unknown key; allowed keys: "
                                         r"method, name, weight, suffix_decoding_max_tree_depth"):
        SmurfsConfig.from_user_dict({"method": "smurfs", "num_speculative_tokens": 4,
                                     "drafters": [{"method": "suffix", "max_depth": 3}]})
    with pytest.raises(ValueError, match="expected 'draft_model' \\(or omit it\\), 'ngram' or "
                                         "'suffix'"):
        SmurfsConfig.from_user_dict({"method": "smurfs", "num_speculative_tokens": 4,
                                     "drafters": [{"method": "eagle"}]})


def test_without_arctic_inference_the_config_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(config_module, "suffix_available", lambda: False)
    with pytest.raises(ValueError, match=r"drafters\[0\].*method 'suffix'.*not installed: pip "
                                         r"install \"vllm-smurfs\[suffix\]\""):
        SmurfsConfig.from_user_dict({"method": "smurfs", "num_speculative_tokens": 4,
                                     "drafters": [{"method": "suffix"}]})


def test_the_pool_drafts_with_it_as_a_model_free_voter_and_tells_it_of_ended_requests():
    config = SmurfsConfig.from_user_dict({"method": "smurfs", "num_speculative_tokens": 4,
                                          "drafters": [{"method": "ngram"}, {"method": "suffix"}]})
    pool = DrafterPool(config, "float32", 1024, 4)
    assert pool.model_free_indices == [0, 1] and pool.names == ["ngram[2,4]", "suffix"]
    answer = list(range(300, 330))
    for n in range(1, 31):
        pool.model_free_drafts([DraftRequest("a", np.asarray([1, 2] + answer[:n]), 4, 2)])
    pool.forget(["a"])  # ended: the suffix voter moves its output to the global tree only
    suffix = pool.drafters[1]._suffix
    assert suffix is not None and suffix.active == 0 and "a" in suffix.cache.cached_requests
    drafts = pool.model_free_drafts([DraftRequest("b", np.asarray([7] + answer[:4]), 4, 1)])
    assert drafts == [[[], answer[4:8]]]  # the n-gram voter has nothing in b's own text
