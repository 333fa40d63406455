"""A drafter that cannot start, crashes or hangs costs speculation, never a request or a token."""

import shutil
from pathlib import Path

import pytest

from vllm_smurfs.runner import Job, divergences, run_job
from vllm_smurfs.tiny_models import TINY_PROMPTS

from conftest import MAX_TOKENS, smurfs_config

pytestmark = pytest.mark.e2e


def run_with(family, spec, env=None):
    result = run_job(Job(target=family.target, prompts=list(TINY_PROMPTS),
                         speculative_config=spec, max_tokens=MAX_TOKENS, env=env or {}))
    print(f"\n{result.smurfs_stats}")
    return result


def test_broken_drafter_is_left_out_and_output_unchanged(family, greedy_runs, tmp_path):
    # Same config and tokenizer as the target, so it passes the start-up checks, but no weights.
    broken = tmp_path / "broken-draft"
    broken.mkdir()
    for item in Path(family.target).iterdir():
        if not item.name.endswith(".safetensors"):
            shutil.copy(item, broken / item.name)
    spec = {"method": "smurfs", "num_speculative_tokens": 4,
            "drafters": [{"model": str(broken), "name": "broken"}, {"method": "ngram"}]}
    result = run_with(family, spec)
    assert divergences(greedy_runs("none").token_ids, result.token_ids) == {}
    broken_stats, ngram_stats = result.smurfs_stats["drafters"]
    assert broken_stats["name"] == "broken" and broken_stats["alive"] is False
    assert broken_stats["drafted_tokens"] == 0
    assert ngram_stats["alive"] is True


@pytest.mark.parametrize("fault", ["exit_after:3", "hang_after:3"])
def test_drafter_dying_mid_run_is_left_out_and_output_unchanged(family, greedy_runs, fault):
    spec = smurfs_config(family, draft_timeout_s=3.0)
    result = run_with(family, spec, env={"SMURFS_DRAFTER_FAULT": f"draft-1={fault}"})
    assert divergences(greedy_runs("none").token_ids, result.token_ids) == {}
    stats = {d["name"]: d for d in result.smurfs_stats["drafters"]}
    assert stats["draft-1"]["alive"] is False
    assert stats["draft-1"]["drafted_tokens"] > 0  # it did draft before the fault
    assert stats["draft-0"]["alive"] and stats["draft-2"]["alive"]
    assert result.num_accepted_tokens > 0  # the others kept speculating
