"""Sampled drafts (`drafters.sampling`) and the mixture rule's member picks (`vote_sampler`):
the drafters' sampling at a request's settings, the mixture q the engine builds on its device
(the same as the pure rule's), the picks' law, and acceptance learnt per temperature band."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_smurfs.control.acceptance import temperature_band
from vllm_smurfs.control.feedback import StepTiming
from vllm_smurfs.control.plan import PlanRequest, RequestOutcome
from vllm_smurfs.drafters.sampling import (
    RowSampling,
    member_uniforms,
    mixture_rows,
    sample_draft_rows,
)
from vllm_smurfs.length_controller import LengthController
from vllm_smurfs.vote_sampler import mixture_shares, mixture_step, pick_mixture_chain

V = 6


def settings(temperature, top_k=None, top_p=None, generators=None) -> RowSampling:
    n = len(temperature)
    return RowSampling(np.asarray(temperature, dtype=np.float64),
                       np.asarray(top_k if top_k is not None else [V] * n, dtype=np.int64),
                       np.asarray(top_p if top_p is not None else [1.0] * n, dtype=np.float64),
                       generators or {})


LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def test_greedy_rows_take_the_argmax_and_sampled_rows_keep_their_q():
    logits = torch.cat([LOGITS, LOGITS.flip(1)])
    tokens, conf, q = sample_draft_rows(logits.clone(), settings([0.0, 0.5]))
    assert tokens[0].item() == 0  # greedy: the argmax
    assert torch.allclose(q[1], torch.softmax(logits[1] / 0.5, dim=-1))
    assert conf[1].item() == pytest.approx(q[1, tokens[1]].item())


def test_top_k_and_top_p_shape_q_as_the_target_is_shaped():
    _, _, q = sample_draft_rows(LOGITS.repeat(2, 1), settings([1.0, 1.0], top_k=[2, V],
                                                               top_p=[1.0, 0.8]))
    top2 = torch.softmax(LOGITS[0, :2], dim=-1)
    assert torch.allclose(q[0, :2], top2) and q[0, 2:].sum().item() == 0.0
    full = torch.softmax(LOGITS[0], dim=-1)
    kept = q[1] > 0
    # top-p keeps the smallest head of mass >= 0.8, renormalised
    assert full[kept].sum().item() >= 0.8 > full[kept][:-1].sum().item()
    assert torch.allclose(q[1][kept], full[kept] / full[kept].sum())


def test_sampled_tokens_follow_q():
    n = 20000
    tokens, _, q = sample_draft_rows(LOGITS.repeat(n, 1), settings([0.8] * n))
    freq = torch.bincount(tokens, minlength=V).double() / n
    # 5 standard errors of a frequency at most 0.5: 0.018
    assert torch.allclose(freq, q[0].double(), atol=0.018), (freq, q[0])


def test_a_seeded_request_draws_from_its_own_generator():
    def draw(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        tokens, _, _ = sample_draft_rows(LOGITS.repeat(3, 1), settings([1.0] * 3,
                                                                       generators={1: gen}))
        return tokens.tolist()

    runs = [draw(7)[1] for _ in range(5)] + [draw(7)[1]]
    assert len(set(runs)) == 1  # row 1 repeats; rows 0 and 2 use the default stream
    assert len({draw(s)[1] for s in range(40)}) > 1
    gen = torch.Generator().manual_seed(3)
    first = member_uniforms(4, gen)
    assert first == member_uniforms(4, torch.Generator().manual_seed(3))
    assert all(0.0 <= u < 1.0 for u in first + member_uniforms(4, None))


def test_settings_are_read_from_the_input_batch_rows():
    gen = torch.Generator()
    batch = SimpleNamespace(temperature_cpu=np.array([0.0, 0.7, 0.0, 1.0]),
                            top_k_cpu=np.array([V, 20, V, V]),
                            top_p_cpu=np.array([1.0, 1.0, 0.9, 1.0]),
                            generators={3: gen})
    assert RowSampling.from_input_batch(batch, [0, 2]) is None  # all greedy: nothing changes
    rows = RowSampling.from_input_batch(batch, [1, 3])
    assert rows is not None and list(rows.sampled) == [True, True]
    assert list(rows.top_k) == [20, V] and rows.generators == {1: gen}
    sub = rows.take([1])
    assert list(sub.temperature) == [1.0] and sub.generators == {0: gen}


def test_the_device_mixture_is_the_pure_rules_q():
    rng = np.random.default_rng(0)
    drafts = [[1, 2, 3], [1, 2], [1, 4]]  # a sampling drafter, a point mass, another sampler
    dists = [rng.dirichlet([1.0] * V, size=3), None, rng.dirichlet([1.0] * V, size=2)]
    weights = [1.0, 2.0, 0.5]
    picked = pick_mixture_chain(drafts, weights, 3, [0.1, 0.1, 0.1])
    assert picked.tokens == [1, 2, 3]
    out = torch.zeros((3, V))
    mixture_rows(picked.shares, drafts, [None if d is None else torch.tensor(d) for d in dists],
                 out)
    for j in range(3):
        step = mixture_step(drafts, [None if d is None else d.tolist() for d in dists], weights,
                            picked.tokens[:j], V)
        assert np.allclose(out[j].numpy(), step.q), j
        assert out[j].sum().item() == pytest.approx(1.0)


def test_the_picks_law_is_the_proposal():
    drafts = [[0, 1], [0, 2], [3], [0, 1]]
    weights = [1.0, 2.0, 3.0, 0.5]
    grid = 10000
    counts: dict[int, int] = {}
    for m in range(grid):
        token = pick_mixture_chain(drafts, weights, 1, [(m + 0.5) / grid]).tokens[0]
        counts[token] = counts.get(token, 0) + 1
    proposal = mixture_step(drafts, [None] * 4, weights, [], V).proposal
    assert {t: c / grid for t, c in counts.items()} == pytest.approx(proposal, abs=1e-3)
    assert mixture_shares(drafts, weights, [0]) == pytest.approx({0: 1 / 3.5, 1: 2 / 3.5,
                                                                  3: 0.5 / 3.5})
    with pytest.raises(ValueError, match="uniforms"):
        pick_mixture_chain(drafts, weights, 2, [0.1])


def test_temperature_bands():
    assert [temperature_band(t) for t in (0.0, 1e-6, 0.3, 0.55, 0.7, 0.9, 1.0, 1.1, 1.5)] == \
        [0, 0, 1, 1, 2, 2, 3, 3, 4]


def test_acceptance_is_learnt_per_temperature_band():
    # A greedy request's drafts are accepted at ~0.9, a hot one's at ~0.2: each band's new
    # requests start from their own band's estimate.
    c = LengthController(4, 1)
    for n in range(1, 40):
        c.observe_step(StepTiming(1, n, 0.14))
        c.observe_pass(0, n, 0.05)
    rng = random.Random(0)
    for step in range(60):
        outcomes = []
        for band, p in ((0, 0.9), (3, 0.2)):
            a = 0
            while a < 4 and rng.random() < p:
                a += 1
            outcomes.append(RequestOutcome(f"r{band}-{step % 3}", voted=(4, a), models=True,
                                           band=band))
        c.observe(outcomes)
    assert c.band(0).models[False].global_acceptance()[0] > 0.8
    assert c.band(3).models[False].global_acceptance()[0] < 0.35
    assert c.acceptance_models is c.band(0).models  # the snapshot's (greedy) view
    greedy = c.plan([PlanRequest("new-g", 100, 4096, catch_up=(3,), band=0)], 4)
    hot = c.plan([PlanRequest("new-h", 100, 4096, catch_up=(3,), band=3)], 4)
    assert greedy.lookaheads[0] > hot.lookaheads[0]
    assert hot.bands == [3]
    assert 3 in c.snapshot()["bands"]


def test_a_sampling_band_learns_model_drafts_in_one_context_with_a_free_chain_or_not():
    # A sampling request's model chain leaves the model-free chain out (mixture_members), so a
    # free chain in hand is no context for its acceptance there; for greedy requests it is.
    c = LengthController(4, 1)
    for band in (0, 2):
        c.observe([RequestOutcome(f"r{band}-{i}", voted=(4, 0), models=True, with_free=True,
                                  band=band) for i in range(20)])
    assert c.band(0).models[True].global_acceptance()[0] < 0.1  # greedy: its own context
    assert c.band(0).models[False].global_trials()[0] == 0.0
    assert c.band(2).models[True].global_trials()[0] == 0.0  # sampling: the one context
    assert c.band(2).models[False].global_acceptance()[0] < 0.1
    # ... which plans read for a request with a free chain in hand as well.
    with_chain = PlanRequest("new", 100, 4096, free_len=3, catch_up=(3,), band=2)
    assert c._models_acceptance(with_chain) is c.band(2).models[False]
    assert "acceptance_models_with_free" not in c.snapshot()["bands"][2]
