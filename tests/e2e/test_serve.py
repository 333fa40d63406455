"""`vllm serve TARGET --speculative-config smurfs.json` answers like offline generation."""

import json

import pytest
import requests

from smurfs_tools.tiny_models import TINY_PROMPTS

from conftest import MAX_TOKENS
from serving import spec_counters, vllm_server

pytestmark = pytest.mark.e2e

PROMPT_INDEX = 1


@pytest.fixture(scope="module")
def server(family, tmp_path_factory):
    # Fixed lookahead: on tiny models (a target step of a millisecond) the adaptive policy
    # rightly finds little worth drafting, and this test is about the server path. Both kinds
    # of model drafter in one collective: one in the target's worker, one in its own process.
    config = {"method": "smurfs", "num_speculative_tokens": 4, "lookahead": {"policy": "fixed"},
              "drafters": [{"model": family.drafts[0]},
                           {"model": family.drafts[1], "placement": "process"},
                           {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}]}
    config_path = tmp_path_factory.mktemp("serve") / "smurfs.json"
    config_path.write_text(json.dumps(config))
    with vllm_server(family.target, config_path.parent / "server.log",
                     ["--speculative-config", str(config_path)]) as base:
        yield base


def test_serve_matches_offline_and_counts_speculation(server, family, greedy_runs):
    before = spec_counters(server)
    response = requests.post(f"{server}/v1/completions", timeout=300, json={
        "model": family.target, "prompt": TINY_PROMPTS[PROMPT_INDEX],
        "max_tokens": MAX_TOKENS[PROMPT_INDEX], "temperature": 0})
    response.raise_for_status()
    served_text = response.json()["choices"][0]["text"]
    offline_text = greedy_runs("none").texts[PROMPT_INDEX]
    assert served_text == offline_text
    after = spec_counters(server)
    print(f"\n/metrics before {before} after {after}")
    assert after["num_drafts"] > before["num_drafts"]
    assert after["num_draft_tokens"] > before["num_draft_tokens"]
    assert after["num_accepted_tokens"] > before["num_accepted_tokens"]
