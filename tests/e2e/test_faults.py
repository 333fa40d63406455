"""A drafter that cannot start costs speculation, never a request or a token."""

import shutil
from pathlib import Path

import pytest

from vllm_smurfs.runner import Job, divergences, run_job
from vllm_smurfs.tiny_models import TINY_PROMPTS

from conftest import MAX_TOKENS

pytestmark = pytest.mark.e2e


def test_broken_drafter_is_left_out_and_output_unchanged(family, greedy_runs, tmp_path):
    # Same config and tokenizer as the target, so it passes the start-up checks, but no weights.
    broken = tmp_path / "broken-draft"
    broken.mkdir()
    for item in Path(family.target).iterdir():
        if not item.name.endswith(".safetensors"):
            shutil.copy(item, broken / item.name)
    spec = {"method": "smurfs", "num_speculative_tokens": 4,
            "drafters": [{"model": str(broken), "name": "broken"}, {"method": "ngram"}]}
    result = run_job(Job(target=family.target, prompts=list(TINY_PROMPTS),
                         speculative_config=spec, max_tokens=MAX_TOKENS))
    assert divergences(greedy_runs("none").token_ids, result.token_ids) == {}
    broken_stats, ngram_stats = result.smurfs_stats["drafters"]
    print(f"\nwith a broken drafter: {result.smurfs_stats}")
    assert broken_stats["name"] == "broken" and broken_stats["alive"] is False
    assert broken_stats["drafted_tokens"] == 0
    assert ngram_stats["alive"] is True
