"""A drafter that cannot start, crashes or hangs costs speculation, never a request or a token.

(An in-worker drafter failing mid-run: tests/e2e/test_in_worker.py.)
"""

import shutil
from pathlib import Path

import pytest

from smurfs_tools.jobs import Job, divergences, run_job
from smurfs_tools.tiny_models import TINY_PROMPTS

from conftest import MAX_TOKENS, divergence_report, smurfs_config

pytestmark = pytest.mark.e2e

# The mid-run faults need a run that outlasts the hang timeout by many steps (a pipelined step
# never waits for the hung drafter, so the short runs of the other tests take ~1.5 s in all).
FAULT_MAX_TOKENS = 200
HANG_TIMEOUT_S = 1.0
# Engine steps (one token per drafting request each) a drafter runs before its fault: the
# runner's warm-up request takes a dozen, the measured prompts several hundred.
FAULT_AFTER_STEPS = 60


def run_with(family, spec, max_tokens=MAX_TOKENS, env=None):
    result = run_job(Job(target=family.target, prompts=list(TINY_PROMPTS),
                         speculative_config=spec, max_tokens=max_tokens, env=env or {}))
    print(f"\nelapsed {result.elapsed_s:.2f} s, {result.smurfs_stats}")
    return result


@pytest.fixture(scope="module")
def long_reference(family):
    return run_with(family, None, max_tokens=FAULT_MAX_TOKENS)


@pytest.mark.parametrize("placement", ["worker", "process"])
def test_broken_drafter_is_left_out_and_output_unchanged(family, greedy_runs, tmp_path,
                                                         placement):
    # Same config and tokenizer as the target, so it passes the start-up checks, but no weights.
    broken = tmp_path / "broken-draft"
    broken.mkdir()
    for item in Path(family.target).iterdir():
        if not item.name.endswith(".safetensors"):
            shutil.copy(item, broken / item.name)
    spec = {"method": "smurfs", "num_speculative_tokens": 4,
            "drafters": [{"model": str(broken), "name": "broken", "placement": placement},
                         {"method": "ngram"}]}
    result = run_with(family, spec)
    assert divergences(greedy_runs("none").token_ids, result.token_ids) == {}
    broken_stats, ngram_stats = result.smurfs_stats["drafters"]
    assert broken_stats["name"] == "broken" and broken_stats["alive"] is False
    assert broken_stats["drafted_tokens"] == 0
    assert ngram_stats["alive"] is True


# A hang costs most in synchronous mode, where a step waits for the drafters.
@pytest.mark.parametrize(("fault", "pipeline"),
                         [("exit_after", True), ("hang_after", True), ("hang_after", False)],
                         ids=["exit-pipelined", "hang-pipelined", "hang-sync"])
def test_drafter_dying_mid_run_is_left_out_and_output_unchanged(family, long_reference, fault,
                                                                 pipeline):
    spec = smurfs_config(family, "process", draft_timeout_s=HANG_TIMEOUT_S, pipeline=pipeline)
    result = run_with(family, spec, max_tokens=FAULT_MAX_TOKENS,
                      env={"SMURFS_DRAFTER_FAULT": f"draft-1={fault}:{FAULT_AFTER_STEPS}"})
    assert result.elapsed_s > 2 * HANG_TIMEOUT_S, "the run ended before a hang could be seen"
    report = divergence_report(long_reference.token_ids, result.token_ids,
                               lambda: run_with(family, None, max_tokens=FAULT_MAX_TOKENS),
                               family.target, list(TINY_PROMPTS))
    if report:
        pytest.fail(report)
    stats = {d["name"]: d for d in result.smurfs_stats["drafters"]}
    assert stats["draft-1"]["alive"] is False
    assert stats["draft-1"]["drafted_tokens"] > 0  # it did draft in the measured run first
    assert stats["draft-0"]["alive"] and stats["draft-2"]["alive"]
    # Left out early in the run: it drafted for a fraction of the steps the others drafted for.
    assert 2 * stats["draft-1"]["drafted_tokens"] < stats["draft-0"]["drafted_tokens"]
    assert result.num_accepted_tokens > 0  # the others kept speculating
