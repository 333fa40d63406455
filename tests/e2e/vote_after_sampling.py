"""TEST-ONLY: a lossy rule for sampled drafts, for the sampling test's control run.

Run in a generation job's process before its engine starts (`Job(preload=[this file])`; never
imported by the plugin). A request that samples gets the chain of the greedy vote over its
drafters' sampled drafts (the heaviest path, chosen after seeing the tokens), verified against
the q of the drafter that won it: the rule `vote_sampler` names as not lossless (its tokens are
not drawn from the q they are verified against: agreeing drafters pull the chain towards their
common, likelier tokens).
"""

from __future__ import annotations

from vllm_smurfs.proposer import SmurfsProposer
from vllm_smurfs.vote_sampler import weighted_prefix_vote


def _vote_then_winners_q(self, req_id, row, k, per_drafter, sampled, proposals, generator):
    state = self._state(req_id)
    vote = weighted_prefix_vote(per_drafter, state.weights.weights, max_len=k)
    state.drafts, state.voted = per_drafter, vote.tokens
    state.shares = [{vote.winner: 1.0} for _ in vote.tokens]
    proposals[row] = vote.tokens
    return vote.tokens


SmurfsProposer._mixture = _vote_then_winners_q
print("[vote_after_sampling] TEST-ONLY lossy rule installed: vote, then the winner's q")
