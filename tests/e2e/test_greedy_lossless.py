"""Greedy Smurfs output is the target's own, token for token and in length."""

import pytest

from smurfs_tools.jobs import divergences

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("mode", ["smurfs", "smurfs-adaptive", "smurfs-process",
                                  "smurfs-process-sync", "smurfs-process-adaptive"])
def test_smurfs_greedy_identical_to_no_speculation(greedy_runs, mode):
    reference, smurfs = greedy_runs("none"), greedy_runs(mode)
    lengths = [len(t) for t in reference.token_ids]
    # The batch must really mix requests that stop early with ones that keep going.
    assert min(lengths) < max(lengths)
    assert smurfs.num_drafts > 0, "Smurfs proposed no draft at all: nothing was tested"
    # The model drafters drafted, and where they run in the worker they ran forwards.
    stats = smurfs.smurfs_stats
    models = [d for d in stats["drafters"] if d["name"].startswith("draft-")]
    assert len(models) == 3 and sum(d["drafted_tokens"] for d in models) > 0, stats["drafters"]
    if "process" not in mode:
        assert stats["drafter_forwards"] > 0
    else:
        assert all(d["engine_steps"] > 0 for d in models), stats["drafters"]
    # Some drafted tokens were accepted and some rejected: the target's own token replaced a
    # rejected draft token (the correction path ran), and the output is still its own.
    assert smurfs.num_draft_tokens > smurfs.num_accepted_tokens > 0
    assert divergences(reference.token_ids, smurfs.token_ids) == {}


def test_the_default_config_is_lossless_whatever_the_controller_chooses(greedy_runs):
    # What a user writes (three drafters, an n-gram voter, the adaptive controller). The tiny
    # drafts cost as much as the target, so three of them never pay and the controller leaves
    # them out after its experiments ('smurfs-adaptive' makes them draft on the same path); the
    # n-gram voter's chains still reach the verifier.
    reference, smurfs = greedy_runs("none"), greedy_runs("smurfs-default")
    stats = smurfs.smurfs_stats
    assert stats["controller"]["policy"] == "adaptive"
    assert smurfs.num_drafts > 0 and smurfs.num_draft_tokens > 0, stats
    assert stats["verified_drafts"] == smurfs.num_drafts
    assert divergences(reference.token_ids, smurfs.token_ids) == {}


def test_smurfs_beats_worst_single_draft(greedy_runs):
    # In-worker drafters at a fixed lookahead: every step verifies a complete vote of the three
    # drafts at the same lookahead as draft_model.
    smurfs = greedy_runs("smurfs")
    singles = [greedy_runs(f"draft_model-{i}") for i in range(3)]
    figures = {f"draft_model-{i}": r.mean_acceptance_length for i, r in enumerate(singles)}
    figures["smurfs"] = smurfs.mean_acceptance_length
    figures["smurfs-process (pipelined)"] = greedy_runs("smurfs-process").mean_acceptance_length
    print(f"\nmean acceptance length: {figures}")
    for single in singles:  # vLLM's own method is lossless in float32 too
        assert divergences(greedy_runs("none").token_ids, single.token_ids) == {}
    assert smurfs.mean_acceptance_length > min(r.mean_acceptance_length for r in singles)
    stats = smurfs.smurfs_stats
    assert stats is not None and len(stats["drafters"]) == 3
    assert sum(d["vote_wins"] for d in stats["drafters"]) == stats["proposed_drafts"]
    # The proposer's own count agrees with vLLM's acceptance counters.
    assert stats["verified_drafts"] == smurfs.num_drafts
    assert stats["accepted_tokens"] == smurfs.num_accepted_tokens
