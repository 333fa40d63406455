"""The mixture rule of sampled collective drafts (vote_sampler: `mixture_step`,
`sample_mixture_chain`): lossless by exact enumeration on small distributions, and a control
(the vote picking the token after seeing the drafts, verified against the winner's q) that is
not."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import pytest

from vllm_smurfs.vote_sampler import (
    mixture_members,
    mixture_step,
    pick_mixture_chain,
    sample_mixture_chain,
    sampled_chain,
)

V = 3  # vocabulary
K = 2  # lookahead
L = 3  # output positions compared (past the lookahead: the bonus token and one more)


class Model:
    """A distribution over V tokens for every prefix, drawn once per prefix (seeded)."""

    def __init__(self, seed: int, concentration: float = 1.0) -> None:
        self.rng = np.random.default_rng(seed)
        self.concentration = concentration
        self.table: dict[tuple[int, ...], np.ndarray] = {}

    def __call__(self, prefix: Sequence[int]) -> np.ndarray:
        key = tuple(prefix)
        if key not in self.table:
            self.table[key] = self.rng.dirichlet([self.concentration] * V)
        return self.table[key]


def _drafts(model: Model) -> list[tuple[list[int], float, list[np.ndarray]]]:
    """Every draft of K tokens a drafter can sample: (tokens, probability, its q rows)."""
    out = []
    for tokens in itertools.product(range(V), repeat=K):
        rows = [model(tokens[:j]) for j in range(K)]
        out.append((list(tokens), float(np.prod([rows[j][t] for j, t in enumerate(tokens)])),
                    rows))
    return out


def _finish(target: Model, law: dict[tuple[int, ...], float], out: list[int],
            prob: float) -> None:
    """Add to ``law`` the target's own continuations of ``out`` to L tokens (past the step)."""
    if len(out) >= L:
        law[tuple(out[:L])] += prob
        return
    for y, py in enumerate(target(out)):
        _finish(target, law, out + [y], prob * py)


def output_law(target: Model, models: list[Model], voter: list[int], weights: list[float],
               control: bool = False, members: bool = False) -> dict[tuple[int, ...], float]:
    """Exact law of the first L output tokens: every drafter sample, every member pick, every
    accept/reject outcome and residual token, then the target's own tokens past the step.
    ``members``: the drafts pass through `mixture_members` first (the engine's rule)."""
    law: dict[tuple[int, ...], float] = defaultdict(float)

    def finish(out: list[int], prob: float) -> None:
        _finish(target, law, out, prob)

    def explore(drafts, dists, chain: list[int], prob: float) -> None:
        step = mixture_step(drafts, dists, weights, chain, V) if len(chain) < K else None
        if step is None:
            finish(chain, prob)  # the bonus token and on: the target's own
            return
        p = target(chain)
        if control:
            # The vote sees the tokens, takes the heaviest, and verifies it against the q of the
            # first member that drafted it.
            token = max(step.proposal, key=lambda t: (step.proposal[t], -t))
            winner = next(i for i in step.members if drafts[i][len(chain)] == token)
            q = (np.eye(V)[token] if dists[winner] is None else dists[winner][len(chain)])
            picks = {token: 1.0}
        else:
            q, picks = np.asarray(step.q), step.proposal
        for x, px in picks.items():
            accept = min(1.0, p[x] / q[x])
            explore(drafts, dists, chain + [x], prob * px * accept)
            residual = np.maximum(0.0, p - q)
            if accept < 1.0:
                residual = residual / residual.sum()
                for y, ry in enumerate(residual):
                    if ry:
                        finish(chain + [y], prob * px * (1.0 - accept) * ry)

    for combo in itertools.product(*[_drafts(m) for m in models]):
        drafts = [c[0] for c in combo] + [voter]
        dists = [c[2] for c in combo] + [None]
        if members:
            drafts = mixture_members(drafts, [d is not None for d in dists])
        explore(drafts, dists, [], float(np.prod([c[1] for c in combo])))
    return law


def target_law(target: Model) -> dict[tuple[int, ...], float]:
    return {seq: float(np.prod([target(seq[:j])[t] for j, t in enumerate(seq)]))
            for seq in itertools.product(range(V), repeat=L)}


def _tv(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


@pytest.mark.parametrize("members", [False, True])  # True: point masses out (the engine's)
@pytest.mark.parametrize("seed", range(4))
def test_the_mixture_rule_keeps_the_targets_distribution_exactly(seed, members):
    target = Model(100 + seed)
    drafters = [Model(200 + seed, 0.5), Model(300 + seed, 2.0)]  # peaked and flat
    law = output_law(target, drafters, voter=[seed % V, (seed + 1) % V],
                     weights=[1.0, 2.5, 0.7], members=members)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
    assert _tv(law, target_law(target)) < 1e-12


def test_mixture_members_leave_point_masses_out_only_where_a_sampling_drafter_drafted():
    voter, model = [4, 5], [7, 8, 9]
    # The model sampled a draft: the voter's point mass leaves the mixture.
    assert mixture_members([model, voter], [True, False]) == [model, []]
    # The model did not draft for the request: the voter's chain is the mixture.
    assert mixture_members([[], voter], [True, False]) == [[], voter]
    # Only deterministic drafters (greedy process drafters, voters): all stay.
    assert mixture_members([model, voter], [False, False]) == [model, voter]
    chain = pick_mixture_chain(mixture_members([model, voter], [True, False]), [0.1, 20.0], 3,
                               [0.99, 0.99, 0.99])
    assert chain.tokens == model and chain.shares == [{0: 1.0}] * 3
    with pytest.raises(ValueError, match="sampled has 1 entries but there are 2 drafts"):
        mixture_members([model, voter], [True])


def point_mass_law(target: Model, chain: list[int]) -> dict[tuple[int, ...], float]:
    """Exact output law when ``chain`` (a function of the text: no draw) is verified as a point
    mass on its tokens: x_j accepted with probability p(x_j), else a token from p without x_j."""
    law: dict[tuple[int, ...], float] = defaultdict(float)

    def finish(out: list[int], prob: float) -> None:
        _finish(target, law, out, prob)

    out: list[int] = []
    prob = 1.0
    for x in chain:
        p = target(out)
        residual = p.copy()
        residual[x] = 0.0
        if p[x] < 1.0:
            for y, ry in enumerate(residual / residual.sum()):
                if ry:
                    finish(out + [y], prob * (1.0 - p[x]) * ry)
        out, prob = out + [x], prob * p[x]
    finish(out, prob)
    return law


class Draws:
    """A draw function that records its calls and hands out fixed uniforms."""

    def __init__(self, value: float) -> None:
        self.value, self.calls = value, []

    def __call__(self, n: int) -> list[float]:
        self.calls.append(n)
        return [self.value] * n


@pytest.mark.parametrize("seed", range(3))
def test_point_masses_alone_take_the_vote_verified_as_a_point_mass_losslessly(seed):
    target = Model(100 + seed)
    drafts = [[seed % V, (seed + 1) % V], [(seed + 2) % V, seed % V], [seed % V, (seed + 2) % V]]
    weights = [1.0, 2.5, 0.7]
    draws = Draws(0.0)
    picked = sampled_chain(drafts, [False] * 3, weights, K, draws)
    # The heaviest path (drafter 1 outweighs 0 and 2 together), and nothing is drawn for it.
    assert picked.tokens == drafts[1]
    assert draws.calls == []
    assert picked.shares == [{1: 1.0}] * K  # q: a point mass on the chain's own tokens
    assert _tv(point_mass_law(target, picked.tokens), target_law(target)) < 1e-12


def test_a_sampling_drafter_that_drafted_takes_the_mixture_over_the_sampling_drafters():
    drafts = [[0, 1, 1], [2, 2], [1, 0]]  # drafter 0 sampled; 1 and 2 are point masses
    draws = Draws(0.99)
    picked = sampled_chain(drafts, [True, False, False], [0.1, 5.0, 5.0], K, draws)
    assert picked.tokens == [0, 1] and picked.shares == [{0: 1.0}] * K
    assert draws.calls == [K]  # one uniform per position the members' drafts reach, up to K
    # Drafter 0 drafted nothing for this request: the vote over the point masses, no draw.
    draws = Draws(0.99)
    picked = sampled_chain([[], [2, 2], [1, 0]], [True, False, False], [0.1, 5.0, 5.0], K,
                           draws)
    assert picked.tokens == [2, 2] and picked.shares == [{1: 1.0}] * K
    assert draws.calls == []


@pytest.mark.parametrize("seed", range(4))
def test_the_vote_picking_after_seeing_the_tokens_is_not_lossless(seed):
    # The control: same drafts, same weights, but the heaviest token is taken and verified
    # against its drafter's own q. Its output law is measurably not the target's.
    target = Model(100 + seed)
    drafters = [Model(200 + seed, 0.5), Model(300 + seed, 2.0)]
    law = output_law(target, drafters, voter=[seed % V, (seed + 1) % V],
                     weights=[1.0, 2.5, 0.7], control=True)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
    assert _tv(law, target_law(target)) > 1e-3


def test_point_mass_voters_alone_are_verified_as_point_masses():
    # Model-free voters only: q is one-hot on each token they propose (with their weights), as
    # vLLM verifies drafts without probabilities when they agree.
    step = mixture_step([[2, 0], [2, 1]], [None, None], [1.0, 3.0], [], V)
    assert step is not None and step.members == (0, 1)
    assert step.proposal == {2: 1.0} and list(step.q) == [0.0, 0.0, 1.0]
    step = mixture_step([[2, 0], [2, 1]], [None, None], [1.0, 3.0], [2], V)
    assert step.proposal == {0: 0.25, 1: 0.75} and list(step.q) == [0.25, 0.75, 0.0]
    assert mixture_step([[2, 0], [2, 1]], [None, None], [1.0, 3.0], [2, 1], V) is None


def test_the_mixture_accepts_at_least_its_members_weighted_average():
    rng = np.random.default_rng(0)
    for _ in range(200):
        p, q1, q2 = rng.dirichlet([0.7] * V, size=3)
        w = rng.uniform(0.1, 5.0, size=2)
        step = mixture_step([[0], [1]], [[list(q1)], [list(q2)]], list(w), [], V)
        mixed = np.minimum(p, step.q).sum()
        average = (w[0] * np.minimum(p, q1).sum() + w[1] * np.minimum(p, q2).sum()) / w.sum()
        assert mixed >= average - 1e-12


def test_sampling_a_chain_follows_the_proposal_and_stops_where_no_member_continues():
    drafts = [[0, 1, 2], [0, 2], [1]]
    dists = [None, None, None]
    # u < 2/3 picks token 0 (members 0 and 1, weight 2 of 3) at position 0; then among members
    # 0 and 1 (weights 1, 1): u < 0.5 picks member 0's token 1, else member 1's token 2.
    chain, qs = sample_mixture_chain(drafts, dists, [1.0, 1.0, 1.0], 3, V, [0.1, 0.2, 0.0])
    assert chain == [0, 1, 2] and len(qs) == 3
    chain, _ = sample_mixture_chain(drafts, dists, [1.0, 1.0, 1.0], 3, V, [0.1, 0.7, 0.0])
    assert chain == [0, 2]  # member 1's draft ends there
    chain, _ = sample_mixture_chain(drafts, dists, [1.0, 1.0, 1.0], 3, V, [0.9, 0.0, 0.0])
    assert chain == [1]
    with pytest.raises(ValueError, match=r"expected \(3,\)"):
        mixture_step([[0]], [[[0.5, 0.5]]], [1.0], [], V)
