"""Weighted prefix-tree vote over several drafters' drafts, and the drafters' weight updates.

Collective speculative decoding lets N drafters each propose a chain of tokens; the chain that is
sent to the target model for verification is chosen by a weighted vote. The drafts are merged into
a prefix tree, each node carrying the summed weight of the drafters whose draft passes through it,
and the voted chain is the heaviest root-to-leaf path. After the target has verified the chain,
every drafter is scored on how much of *its own* draft the target agreed with, and its weight is
updated multiplicatively, so drafters that are right on the current text gain influence.

For sampled drafts (temperature > 0) the vote cannot pick a sampled token after seeing it; the
mixture rule at the end of this module (`mixture_step`, derivation above it) picks a drafter by
weight at each position and verifies against the weighted mixture of the drafters still on the
chain (proven lossless by exact enumeration in the tests). The proposer picks sampling requests'
chains with it; `drafters.sampling` builds the mixture q that vLLM's rejection sampler verifies
against.

This module is pure (stdlib and numpy, no vllm/torch) so it can be unit-tested and reused
outside the engine; it runs per request per step, on drafts of ~16 tokens from <= ~8 drafters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "DrafterWeights",
    "MixtureChain",
    "MixtureStep",
    "VoteResult",
    "WeightUpdateRule",
    "matched_prefix_len",
    "mixture_members",
    "mixture_shares",
    "mixture_step",
    "pick_mixture_chain",
    "sample_mixture_chain",
    "sampled_chain",
    "score_draft",
    "weighted_prefix_vote",
]


@dataclass(frozen=True)
class VoteResult:
    """Outcome of :func:`weighted_prefix_vote`.

    Attributes:
        tokens: the voted chain (possibly empty).
        winner: the lowest index among drafters whose draft has ``tokens`` as a prefix; -1 when
            ``tokens`` is empty.
        support: ``support[j]`` is the summed weight of the drafters whose draft passes through the
            chosen node at depth ``j``; non-increasing, ``len(support) == len(tokens)``.
    """

    tokens: list[int]
    winner: int
    support: list[float]


def _validate_weights(weights: Sequence[float], n: int) -> None:
    if len(weights) != n:
        raise ValueError(f"weights has {len(weights)} entries but there are {n} drafts")
    for i, w in enumerate(weights):
        # `not w > 0` also rejects NaN; an infinite weight would make every sum infinite and
        # turn the vote into a tie-break, so it is rejected too.
        if not (w > 0 and math.isfinite(w)):
            raise ValueError(f"weights[{i}] must be finite and > 0, got {w!r}")


def weighted_prefix_vote(
    drafts: Sequence[Sequence[int]],
    weights: Sequence[float],
    max_len: int | None = None,
) -> VoteResult:
    """Pick the heaviest path through the prefix tree of ``drafts``.

    A node's weight is the sum of ``weights[i]`` over the drafters ``i`` whose draft passes through
    it. From the root, the heaviest child is taken at each depth until no remaining drafter
    continues, or ``max_len`` tokens have been taken. Empty drafts contribute nothing.

    Tie-break: among children of exactly equal weight, the one whose lowest-index supporting
    drafter is smallest wins, i.e. drafters earlier in config order have priority. Weights are
    compared exactly; in practice exact ties only arise with equal (e.g. initial) weights, where
    the sums are exact.

    Because the walk only stops when no drafter that agreed so far continues, the chain equals the
    full draft of ``drafts[winner]`` (truncated to ``max_len``).

    Raises:
        ValueError: when ``len(weights) != len(drafts)``, a weight is not finite and > 0, or
            ``max_len`` is negative.
    """
    n = len(drafts)
    _validate_weights(weights, n)
    if max_len is not None and max_len < 0:
        raise ValueError(f"max_len must be >= 0 or None, got {max_len}")

    # Rather than building the tree, walk it depth by depth with the set of drafters that agree
    # with the chain so far ("alive"). Kept in index order, so the first drafter seen for a token
    # is that child's lowest-index supporter, which is what the tie-break needs.
    alive = [i for i in range(n) if len(drafts[i]) > 0]
    limit = max(len(d) for d in drafts) if n else 0
    if max_len is not None:
        limit = min(limit, max_len)

    tokens: list[int] = []
    support: list[float] = []
    depth = 0
    while depth < limit:
        # token -> summed weight; dict insertion order == order of lowest supporting index.
        child_weight: dict[int, float] = {}
        for i in alive:
            draft = drafts[i]
            if len(draft) > depth:
                tok = int(draft[depth])
                child_weight[tok] = child_weight.get(tok, 0.0) + weights[i]
        if not child_weight:
            break
        best_tok = -1
        best_w = -math.inf
        for tok, w in child_weight.items():
            # Strict `>` keeps the earlier-inserted child on an exact tie.
            if w > best_w:
                best_tok, best_w = tok, w
        alive = [i for i in alive if len(drafts[i]) > depth and int(drafts[i][depth]) == best_tok]
        tokens.append(best_tok)
        support.append(best_w)
        depth += 1

    # `alive` now holds exactly the drafters whose draft has `tokens` as a prefix.
    winner = alive[0] if tokens else -1
    return VoteResult(tokens=tokens, winner=winner, support=support)


def matched_prefix_len(draft: Sequence[int], target: Sequence[int]) -> int:
    """Length of the common prefix of ``draft`` and ``target``."""
    m = 0
    for a, b in zip(draft, target, strict=False):
        if a != b:
            break
        m += 1
    return m


def score_draft(draft: Sequence[int], target_tokens: Sequence[int]) -> float | None:
    """Acceptance of one drafter's draft against what the target emitted for the step.

    ``target_tokens`` are the tokens the target produced after verification: the accepted draft
    tokens followed by the bonus/corrected token. Only the first ``min(len(draft),
    len(target_tokens))`` positions can be judged (beyond the target's output we do not know what
    it would have said), so the score is the matched prefix over that many positions, in [0, 1].

    Returns None when nothing can be judged (empty draft or empty target output): "no evidence"
    must leave the weight alone rather than count as a rejection.
    """
    evaluable = min(len(draft), len(target_tokens))
    if evaluable == 0:
        return None
    return matched_prefix_len(draft[:evaluable], target_tokens[:evaluable]) / evaluable


# Default constants of the multiplicative weight update (with forgetting):
#
#     log w  <-  (1 - forgetting) * log w  +  learning_rate * (score - threshold)
#
# Each step multiplies the weight by exp(learning_rate * (score - threshold)) (reward above the
# threshold, penalty below: the paper's rule) and by w^-forgetting, which pulls it back towards 1.
# Plain multiplicative weights (forgetting = 0) turn the noise of per-step scores into a random
# walk: equally good drafters drift apart until one outvotes the others and the majority is lost.
# With forgetting the log-weight is an exponential average of the last ~1/forgetting = 10
# verified steps, settling at learning_rate/forgetting * (mean score - threshold): 2*(a - 0.5) for
# a drafter of acceptance a, so a always-right drafter weighs e^1 = 2.7, an always-wrong one
# e^-1 = 0.37 (a 7.4x range), and equally good drafters weigh about the same, so agreement of
# several of them decides. Within a request the weights follow a change of task within a few steps.
# Tuned on recorded drafts of three noisy copies of a tiny target (mean accepted length of the
# vote, k=4): plain MW eta=0.5 2.84, eta=0.1 2.93, equal weights 2.96, this rule 2.99, best single
# drafter 2.85.
_DEFAULT_LEARNING_RATE = 0.2
_DEFAULT_FORGETTING = 0.1
_DEFAULT_THRESHOLD = 0.5
# Weights are also clipped to [0.05, 20], a guard for user-given prior weights and for rules with
# little forgetting: no drafter can be silenced for good, and none can bank unbounded credit.
_DEFAULT_MIN_WEIGHT = 0.05
_DEFAULT_MAX_WEIGHT = 20.0


@dataclass(frozen=True)
class WeightUpdateRule:
    """Multiplicative weight update with forgetting, clipped to bounds.

    ``log w <- (1 - forgetting) * log w + learning_rate * (score - threshold)``.

    See the comments on the default constants above for why these values.
    """

    learning_rate: float = _DEFAULT_LEARNING_RATE
    forgetting: float = _DEFAULT_FORGETTING
    threshold: float = _DEFAULT_THRESHOLD
    min_weight: float = _DEFAULT_MIN_WEIGHT
    max_weight: float = _DEFAULT_MAX_WEIGHT

    def __post_init__(self) -> None:
        if not (math.isfinite(self.learning_rate) and self.learning_rate >= 0):
            raise ValueError(f"learning_rate must be finite and >= 0, got {self.learning_rate!r}")
        if not (0.0 <= self.forgetting <= 1.0):
            raise ValueError(f"forgetting must be in [0, 1], got {self.forgetting!r}")
        if not (0.0 <= self.threshold <= 1.0):
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold!r}")
        if not (math.isfinite(self.min_weight) and self.min_weight > 0):
            raise ValueError(f"min_weight must be finite and > 0, got {self.min_weight!r}")
        if not (math.isfinite(self.max_weight) and self.max_weight >= self.min_weight):
            raise ValueError(
                f"max_weight must be finite and >= min_weight ({self.min_weight!r}), "
                f"got {self.max_weight!r}"
            )

    def clip(self, weight: float) -> float:
        """``weight`` clipped into ``[min_weight, max_weight]``."""
        return min(max(weight, self.min_weight), self.max_weight)

    def updated(self, weight: float, score: float | None) -> float:
        """The weight after one step with acceptance ``score``; unchanged when ``score`` is None.

        Raises:
            ValueError: when ``weight`` is not finite and > 0 or ``score`` is outside [0, 1].
        """
        if score is None:
            return weight
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"weight must be finite and > 0, got {weight!r}")
        if not (0.0 <= score <= 1.0):
            raise ValueError(f"score must be in [0, 1] or None, got {score!r}")
        # Clip in log space so a large learning_rate cannot overflow math.exp.
        log_new = (1.0 - self.forgetting) * math.log(weight) + self.learning_rate * (
            score - self.threshold
        )
        if log_new >= math.log(self.max_weight):
            return self.max_weight
        if log_new <= math.log(self.min_weight):
            return self.min_weight
        return self.clip(math.exp(log_new))


class DrafterWeights:
    """Multiplicative weights of N drafters."""

    def __init__(
        self, initial: Sequence[float], rule: WeightUpdateRule = WeightUpdateRule()
    ) -> None:
        """Start from ``initial`` (one weight per drafter, each > 0), clipped into the bounds.

        Raises:
            ValueError: when an initial weight is not finite and > 0.
        """
        for i, w in enumerate(initial):
            if not (w > 0 and math.isfinite(w)):
                raise ValueError(f"initial[{i}] must be finite and > 0, got {w!r}")
        self._rule = rule
        self._weights = [rule.clip(float(w)) for w in initial]

    @property
    def rule(self) -> WeightUpdateRule:
        return self._rule

    @property
    def weights(self) -> list[float]:
        """A copy of the current weights, in drafter order."""
        return list(self._weights)

    def __len__(self) -> int:
        return len(self._weights)

    def update(self, scores: Sequence[float | None]) -> None:
        """Apply one step's scores, one per drafter (None leaves that drafter's weight alone).

        Raises:
            ValueError: when ``len(scores)`` differs from the number of drafters or a score is
                outside [0, 1]. Nothing is changed in that case.
        """
        if len(scores) != len(self._weights):
            raise ValueError(f"got {len(scores)} scores for {len(self._weights)} drafters")
        # Compute into a new list first so a bad score leaves the weights untouched.
        new = [self._rule.updated(w, s) for w, s in zip(self._weights, scores, strict=True)]
        self._weights = new

    def copy(self) -> DrafterWeights:
        """An independent copy (same rule, same current weights)."""
        other = DrafterWeights.__new__(DrafterWeights)
        other._rule = self._rule
        other._weights = list(self._weights)
        return other

    def __repr__(self) -> str:
        return f"DrafterWeights({self._weights!r}, rule={self._rule!r})"


# -------------------------------------------------------------------- sampling: the mixture rule
#
# At temperature > 0 a voted chain must be verified against the distribution it was drawn from,
# or the output is not the target's distribution. The rule here (for the collective's sampled
# drafts; greedy drafts keep the vote above):
#
# Drafter i has sampled its own draft d_i autoregressively from its distribution q_i (a model
# drafter at the request's sampling settings; a model-free voter is a point mass on its token).
# Position j of the chain x, given x_<j:
#   1. The members S_j are the drafters whose draft continues x_<j: len(d_i) > j and
#      d_i[:j] == x_<j. Their d_i[j] ~ q_i( . | x_<j), drawn independently of the target. (The
#      chain stops where S_j is empty, or where a rule that looks only at x_<j and S_j says so.)
#   2. Pick a member I with probability w_I / W, W = sum of w_i over S_j (fresh randomness), and
#      set x_j = d_I[j].
#   3. Verify x_j against the mixture q_j = sum_{i in S_j} (w_i / W) q_i( . | x_<j): accept with
#      probability min(1, p(x_j) / q_j(x_j)); on rejection emit a token drawn from
#      max(0, p - q_j) normalised, and stop.
#
# Why lossless. Given x_<j (accepted) and S_j, the law of x_j is exactly q_j: member i is picked
# with probability w_i / W and its token is a fresh draw from q_i( . | x_<j), independent of how
# S_j came about (S_j depends on the members' tokens at positions < j only). Step 3 is then the
# standard speculative sampling test, whose output at position j has law
#   q_j(y) min(1, p(y)/q_j(y)) + (1 - sum_z min(p(z), q_j(z))) * max(0, p(y) - q_j(y)) / Z = p(y)
# with Z = sum_z max(0, p(z) - q_j(z)) = 1 - sum_z min(p(z), q_j(z)). Conditioning on the
# output so far (x_<j accepted) and on any S_j, position j is p( . | x_<j); by induction over the
# positions (and the target's own bonus token after the last), the whole output is the target's.
# What is not lossless: letting the vote pick the heaviest token after seeing the members' tokens
# (x_j is then not drawn from q_j, nor from the winner's q_i). The test suite enumerates both.
#
# What it accepts: sum_y min(p(y), q_j(y)) >= sum_i (w_i / W) sum_y min(p(y), q_i(y)) (min(p, .)
# is concave), so the mixture accepts at least the weighted average of its members, and as much
# as the best member when the weights favour it.
#
# Which drafters are members at all may be decided by anything but the tokens drawn at or after
# the position (`mixture_members`): where a drafter that sampled its draft (a model, with its
# q_i) drafted for the request, the point masses of the model-free voters are left out. At
# temperature 0.7 on Spec-Bench a model's sampled drafts alone were accepted at 0.72-0.79 at
# the first position, the mixture with the n-gram and suffix voters' point masses at 0.13-0.17
# (their tokens matched the output at 0.14-0.27): a point mass is accepted with probability
# p(x) only, and its share of q_j lowers min(1, p/q_j) for the model's tokens too. Whether the
# model drafted is settled by the plan before any token is drawn, so the derivation above holds
# unchanged; the controller chooses between the model's chain and the model-free chain alone.
#
# Where only point masses draft (no sampling drafter drafted for the request), nothing is drawn:
# every member's token is a function of the text so far, and so are the weights (of the scores
# of earlier, emitted steps). The chain may then be any function of them, verified as a point
# mass on its own tokens: the heaviest path of the vote (`sampled_chain`), as for a greedy
# request; speculative sampling against q = one-hot(x_j) accepts x_j with probability p(x_j) and
# otherwise emits from p without x_j, renormalised: the target's law. The mixture would instead
# accept sum over distinct tokens of min(share, p): with the n-gram voter right (p = 0.8) and the
# suffix voter wrong at equal shares, 0.5 where the vote, following the weights, gets 0.8.


def mixture_shares(drafts: Sequence[Sequence[int]], weights: Sequence[float],
                   chain: Sequence[int]) -> dict[int, float]:
    """The members S_j at position ``j = len(chain)`` (the drafters whose draft continues
    ``chain``) and each one's share w_i / W of the mixture, in drafter order; empty when no
    drafter continues the chain. Validates nothing (callers do)."""
    j = len(chain)
    members = [i for i, d in enumerate(drafts)
               if len(d) > j and all(d[t] == chain[t] for t in range(j))]
    total = sum(weights[i] for i in members)
    return {i: weights[i] / total for i in members}


def mixture_members(drafts: Sequence[Sequence[int]],
                    sampled: Sequence[bool]) -> list[Sequence[int]]:
    """The drafts that enter a sampling request's mixture (see above): where a drafter that
    sampled its draft (``sampled[i]``: it keeps its distribution q_i) has drafted, only those;
    else all (the model-free voters' point masses). A left-out drafter's draft is empty."""
    if _a_sampler_drafted(drafts, sampled):
        return [d if s else [] for d, s in zip(drafts, sampled, strict=True)]
    return list(drafts)


def _a_sampler_drafted(drafts: Sequence[Sequence[int]], sampled: Sequence[bool]) -> bool:
    if len(sampled) != len(drafts):
        raise ValueError(f"sampled has {len(sampled)} entries but there are {len(drafts)} drafts")
    return any(s and len(d) > 0 for d, s in zip(drafts, sampled, strict=True))


@dataclass(frozen=True)
class MixtureChain:
    """A sampled chain under the mixture rule: ``tokens[j]`` was drawn from the mixture whose
    members and shares are ``shares[j]`` (drafter -> w_i / W); what it is verified against is
    ``q_j = sum_i shares[j][i] * q_i(. | tokens[:j])``."""

    tokens: list[int]
    shares: list[dict[int, float]]


def pick_mixture_chain(drafts: Sequence[Sequence[int]], weights: Sequence[float], max_len: int,
                       uniforms: Sequence[float]) -> MixtureChain:
    """Steps 1-2 of the rule: at each position j (up to ``max_len``), pick a member by its share
    with ``uniforms[j]`` in [0, 1) (fresh randomness, one per position) and take its token.

    Raises:
        ValueError: on bad weights, or fewer uniforms than the chain needs.
    """
    _validate_weights(weights, len(drafts))
    tokens: list[int] = []
    shares: list[dict[int, float]] = []
    while len(tokens) < max_len:
        members = mixture_shares(drafts, weights, tokens)
        if not members:
            break
        if len(tokens) >= len(uniforms):
            raise ValueError(f"{len(uniforms)} uniforms for a chain of more tokens")
        u, cumulative, picked = uniforms[len(tokens)], 0.0, -1
        for picked, share in members.items():
            cumulative += share
            if u < cumulative:
                break
        tokens.append(int(drafts[picked][len(tokens)]))
        shares.append(members)
    return MixtureChain(tokens, shares)


def sampled_chain(drafts: Sequence[Sequence[int]], sampled: Sequence[bool],
                  weights: Sequence[float], max_len: int,
                  draw: Callable[[int], Sequence[float]]) -> MixtureChain:
    """A sampling request's chain (see above): where a drafter that sampled has drafted, the
    mixture rule over the sampling drafters (`mixture_members`, `pick_mixture_chain` with
    ``draw(n)``: ``n`` fresh uniforms in [0, 1), one per position the members' drafts reach,
    called once); else the vote over the point masses, each position verified as a point mass
    on its token (shares ``{winner: 1.0}``; nothing is drawn)."""
    if _a_sampler_drafted(drafts, sampled):
        members = mixture_members(drafts, sampled)
        longest = min(max_len, max(len(d) for d in members))
        return pick_mixture_chain(members, weights, max_len, draw(longest))
    vote = weighted_prefix_vote(drafts, weights, max_len=max_len)
    return MixtureChain(vote.tokens, [{vote.winner: 1.0} for _ in vote.tokens])


@dataclass(frozen=True)
class MixtureStep:
    """Position j of a sampled chain under the mixture rule (see above)."""

    members: tuple[int, ...]  # drafters whose draft continues the chain so far (S_j)
    proposal: dict[int, float]  # law of x_j given the drafts: token -> probability
    q: np.ndarray  # [vocab_size] the mixture q_j, what x_j is verified against


def mixture_step(drafts: Sequence[Sequence[int]],
                 dists: Sequence[Sequence[Sequence[float]] | None],
                 weights: Sequence[float], chain: Sequence[int], vocab_size: int
                 ) -> MixtureStep | None:
    """The members, the law of the next chain token and the mixture q at position len(chain).

    ``drafts[i]``: drafter i's own sampled draft; ``dists[i][j]``: its distribution q_i at its
    position j (over the vocabulary), or ``dists[i] is None`` for a model-free voter (a point
    mass on its token). None when no drafter continues the chain.

    Raises:
        ValueError: on mismatched lengths, bad weights, or a distribution of the wrong size.
    """
    n = len(drafts)
    _validate_weights(weights, n)
    if len(dists) != n:
        raise ValueError(f"dists has {len(dists)} entries but there are {n} drafts")
    j = len(chain)
    shares = mixture_shares(drafts, weights, chain)
    if not shares:
        return None
    q = np.zeros(vocab_size)
    proposal: dict[int, float] = {}
    for i, share in shares.items():
        token = drafts[i][j]
        proposal[token] = proposal.get(token, 0.0) + share
        dist = dists[i]
        if dist is None:
            q[token] += share
            continue
        row = np.asarray(dist[j], dtype=np.float64)
        if row.shape != (vocab_size,):
            raise ValueError(f"dists[{i}][{j}] has shape {row.shape}, expected ({vocab_size},)")
        q += share * row
    return MixtureStep(tuple(shares), proposal, q)


def sample_mixture_chain(drafts: Sequence[Sequence[int]],
                         dists: Sequence[Sequence[Sequence[float]] | None],
                         weights: Sequence[float], max_len: int, vocab_size: int,
                         uniforms: Sequence[float]) -> tuple[list[int], list[np.ndarray]]:
    """The chain (up to ``max_len`` tokens) and each position's mixture q, picking the member at
    position j by ``uniforms[j]`` in [0, 1) (`pick_mixture_chain`; the engine builds the same
    q on its device)."""
    picked = pick_mixture_chain(drafts, weights, max_len, uniforms)
    qs = []
    for chain_len in range(len(picked.tokens)):
        step = mixture_step(drafts, dists, weights, picked.tokens[:chain_len], vocab_size)
        assert step is not None
        qs.append(step.q)
    return picked.tokens, qs
