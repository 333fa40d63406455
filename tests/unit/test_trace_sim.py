"""Unit tests for vllm_smurfs.trace_sim: format, reconstruction, replay accounting, policies."""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_smurfs.length_controller import (
    AdaptiveLookahead,
    DraftTiming,
    FixedLookahead,
    RequestView,
    StepFeedback,
    StepTiming,
)
from vllm_smurfs.trace_report import compare, format_summary, format_table, main, summarize
from vllm_smurfs.trace_sim import (
    NoSpeculation,
    ReplayRequest,
    StepCostCurve,
    TraceFormatError,
    TraceRequest,
    TraceStep,
    acc_from_agreement,
    default_policies,
    fit_draft_cost,
    read_trace,
    reconstruct,
    replay,
    simulate,
    synthetic_trace,
    write_trace,
)


def _hinge(n: float) -> float:
    """Verification is free up to 16 tokens, then 0.5 ms per token."""
    return 0.010 + 0.0005 * max(0.0, n - 16)


def _linear(n: float) -> float:
    """Verification is expensive: every token costs 0.4 ms."""
    return 0.002 + 0.0004 * n


def _draft(num_positions: int, num_reqs: int) -> float:
    return 0.0005 + num_positions * (0.0003 + 0.00001 * num_reqs)


def _agreement(segments: Sequence[tuple[float, int]], rng: np.random.Generator) -> np.ndarray:
    """i.i.d. drafter agreement, ``(rate, length)`` per segment."""
    return np.concatenate([(rng.random(n) < p).astype(np.int8) for p, n in segments])


def _copy_then_free(num_requests: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Requests that copy text (acceptance 0.9) for 150 tokens, then generate (0.3) for 150."""
    rng = np.random.default_rng(seed)
    return {f"r{i}": _agreement([(0.9, 150), (0.3, 150)], rng) for i in range(num_requests)}


# ------------------------------------------------------------------------------------- format


def test_trace_step_json_round_trip(tmp_path: Path) -> None:
    step = TraceStep(3, 1.25, 0.02, 12, (TraceRequest("a", 7, 4, 2), TraceRequest("b", 0, 0, 0)),
                     (DraftTiming(1, 4, 0.003),))
    line = step.to_json()
    assert json.loads(line) == {
        "step": 3, "t": 1.25, "seconds": 0.02, "num_tokens": 12,
        "requests": [{"req_id": "a", "position": 7, "k": 4, "accepted": 2},
                     {"req_id": "b", "position": 0, "k": 0, "accepted": 0}],
        "drafts": [{"num_reqs": 1, "num_positions": 4, "seconds": 0.003}],
    }
    assert TraceStep.from_json(line) == step
    path = tmp_path / "t.jsonl"
    write_trace(path, [step, TraceStep(4, 2, 0.01, 3)])
    path.write_text(path.read_text() + "\n")  # a trailing blank line is fine
    assert read_trace(path) == [step, TraceStep(4, 2.0, 0.01, 3)]
    # The model drafters' mode, when recorded (a boolean, not 0/1).
    drafted = TraceStep(5, 3.0, 0.03, 4, drafting=False)
    assert json.loads(drafted.to_json())["drafting"] is False
    assert TraceStep.from_json(drafted.to_json()) == drafted


@pytest.mark.parametrize(("obj", "match"), [
    ({"t": 0, "seconds": 0.1, "num_tokens": 1}, "missing field 'step'"),
    ({"step": 0, "t": 0, "seconds": "x", "num_tokens": 1}, "seconds must be float"),
    ({"step": 0, "t": 0, "seconds": -1, "num_tokens": 1}, "seconds must be finite and >= 0"),
    ({"step": 0, "t": 0, "seconds": 0.1, "num_tokens": 1,
      "requests": [{"req_id": "a", "position": 0, "k": 2, "accepted": 3}]},
     r"requests\[0\]: accepted must be in \[0, k=2\]"),
    ({"step": 0, "t": 0, "seconds": 0.1, "num_tokens": 1,
      "drafts": [{"num_reqs": 1, "seconds": 0.1}]}, r"drafts\[0\]: missing field 'num_positions'"),
    ({"step": 0, "t": 0, "seconds": 0.1, "num_tokens": 1, "drafting": 1},
     "drafting must be bool"),
    ({"step": True, "t": 0, "seconds": 0.1, "num_tokens": 1}, "step must be int"),
])
def test_trace_format_errors_name_the_field(obj: dict[str, Any], match: str) -> None:
    with pytest.raises(TraceFormatError, match=match):
        TraceStep.from_dict(obj, "trace.jsonl:7")
    with pytest.raises(TraceFormatError, match="trace.jsonl:7"):
        TraceStep.from_dict(obj, "trace.jsonl:7")


def test_read_trace_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(TraceStep(0, 0.0, 0.01, 1).to_json() + "\n{not json\n")
    with pytest.raises(TraceFormatError, match=r"bad.jsonl:2: not JSON"):
        read_trace(path)


# ----------------------------------------------------------------------------- reconstruction


def _steps(*reqs: tuple[str, int, int, int]) -> list[TraceStep]:
    return [TraceStep(i, float(i), 0.01, 1 + k, (TraceRequest(rid, p, k, a),))
            for i, (rid, p, k, a) in enumerate(reqs)]


def test_reconstruction_arithmetic() -> None:
    # Position 100 is where the request's output starts (a context length: only differences
    # count). Step 1: k=4, a=2 at 0 -> agree 0,1; disagree 2. Step 2: k=3, a=3 at 3 -> agree
    # 3,4,5; 6 (the bonus position) unknown. Step 3: k=4, a=0 at 7 -> disagree 7.
    (req,) = reconstruct(_steps(("a", 100, 4, 2), ("a", 103, 3, 3), ("a", 107, 4, 0)))
    assert req.length == 8
    assert req.agree.tolist() == [1, 1, 0, 1, 1, 1, -1, 0]
    # Unknown bonus position 6: nearest known are 5 (agree) and 7 (disagree), the tie goes to
    # the later one.
    assert req.acc.tolist() == [2, 1, 0, 3, 2, 1, 0, 0]
    # The uncensored step: acc(p + j) = a - j for j <= a.
    assert [req.acc[0 + j] for j in range(3)] == [2 - j for j in range(3)]
    # The censored one: acc(p + j) >= k - j.
    assert all(req.acc[3 + j] >= 3 - j for j in range(3))
    assert req.conflicts == 0


def test_reconstruction_imputation_and_conflicts() -> None:
    # Censored runs: the bonus position 2 is between two agreements, the last one (5) has only
    # an agreement before it; both take it.
    (req,) = reconstruct(_steps(("a", 0, 2, 2), ("a", 3, 2, 2)))
    assert req.agree.tolist() == [1, 1, -1, 1, 1, -1]
    assert req.acc.tolist() == [6, 5, 4, 3, 2, 1]
    # Nothing drafted ever: assume every draft is rejected.
    (req,) = reconstruct(_steps(("a", 0, 0, 0), ("a", 1, 0, 0)))
    assert req.acc.tolist() == [0, 0]
    # Two observations that contradict each other (sampling, or a replayed preemption): the
    # first one is kept and the conflict counted.
    (req,) = reconstruct(_steps(("a", 0, 3, 1), ("a", 0, 3, 2)))
    assert req.agree.tolist()[:2] == [1, 0] and req.conflicts == 1


def test_acc_from_agreement() -> None:
    assert acc_from_agreement(np.array([1, 1, 0, 1, 0, 0, 1])).tolist() == [2, 1, 0, 1, 0, 0, 1]
    assert acc_from_agreement(np.array([], dtype=np.int8)).tolist() == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=60), min_size=1, max_size=4),
       st.integers(1, 8), st.integers(1, 3))
def test_reconstruction_recovers_the_ground_truth(
    truth: list[list[int]], record_k: int, concurrency: int
) -> None:
    agreement = {f"r{i}": bits for i, bits in enumerate(truth)}
    trace = synthetic_trace(agreement, record_k, concurrency, _hinge)
    recon = {r.req_id: r for r in reconstruct(trace)}
    for rid, bits in agreement.items():
        r = recon[rid]
        assert r.length == len(bits)
        known = r.agree >= 0
        assert np.array_equal(r.agree[known], np.asarray(bits)[known])
        true_acc = acc_from_agreement(np.asarray(bits))
        # Every recorded step replays exactly: a draft of the recorded length at the recorded
        # position gets the recorded number of tokens accepted.
        for s in trace:
            for q in s.requests:
                if q.req_id == rid:
                    assert min(q.k, int(r.acc[q.position])) == q.accepted
                    assert min(q.k, int(true_acc[q.position])) == q.accepted


# ------------------------------------------------------------------------------------- costs


def test_step_cost_curve_fits_the_trace() -> None:
    ns = [n for n in range(1, 41) for _ in range(3)]
    curve = StepCostCurve(ns, [_hinge(n) * (1.5 if i % 9 == 0 else 1.0)
                               for i, n in enumerate(ns)])
    for n in (1, 10, 16, 17, 30, 40):
        assert curve(n) == pytest.approx(_hinge(n))  # medians ignore the 1-in-3 outliers
    assert curve(60) == pytest.approx(_hinge(60), rel=0.02)  # extended with the top slope
    assert curve(0.5) == pytest.approx(0.010)
    assert curve.covers(40) and not curve.covers(41)
    with pytest.raises(ValueError, match="num_tokens >= 1"):
        StepCostCurve([0], [1.0])


def test_fit_draft_cost_from_trace() -> None:
    steps = [TraceStep(i, 0.0, 0.01, 1, (), (DraftTiming(r, p, _draft(p, r)),))
             for i, (p, r) in enumerate((p, r) for p in (1, 4, 8) for r in (1, 8, 32))]
    model = fit_draft_cost(steps)
    assert model is not None and model(5, 10) == pytest.approx(_draft(5, 10), rel=1e-3)
    assert fit_draft_cost([TraceStep(0, 0.0, 0.01, 1)]) is None


# ------------------------------------------------------------------------------------ replay


class _Recorder(FixedLookahead):
    """A fixed policy that records what it is told."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.timings: list[StepTiming] = []
        self.drafts: list[DraftTiming] = []
        self.feedback: list[list[StepFeedback]] = []
        self.forgotten: list[str] = []

    def observe(self, feedback: Sequence[StepFeedback]) -> None:
        super().observe(feedback)
        self.feedback.append(list(feedback))

    def observe_step(self, timing: StepTiming) -> None:
        self.timings.append(timing)

    def observe_draft(self, timing: DraftTiming) -> None:
        self.drafts.append(timing)

    def forget(self, req_ids: Any) -> None:
        self.forgotten.extend(req_ids)


def _requests(num: int, seed: int = 0) -> list[ReplayRequest]:
    return [ReplayRequest.from_agreement(rid, bits)
            for rid, bits in _copy_then_free(num, seed).items()]


def _stale(res: Any, reqs: Sequence[ReplayRequest]) -> set[tuple[int, str]]:
    """(step, req_id) of the pipelined steps whose request came with a stale path: the
    drafter's token after the accepted ones (drafted, or standing in after a restart) was not
    the target's, ``acc[position] == accepted``, in the request's previous step. Valid for
    policies drafting for every request in every step it has room in."""
    acc = {r.req_id: r.acc for r in reqs}
    stale, last = set(), {}
    for i, s in enumerate(res.steps):
        for q in s.requests:
            if last.get(q.req_id, False):
                stale.add((i, q.req_id))
            last[q.req_id] = bool(acc[q.req_id][q.position] == q.accepted)
    return stale


@pytest.mark.parametrize("concurrency", [1, 3, 16])
def test_no_speculation_gives_one_token_per_request_per_step(concurrency: int) -> None:
    reqs = _requests(5)
    res = replay(reqs, NoSpeculation, concurrency, True, _hinge, _draft)
    assert res.total_tokens == sum(r.length for r in reqs) == res.request_steps
    assert res.mean_accepted_length == 1.0 and res.drafted_tokens == 0
    assert all(s.num_tokens == len(s.requests) for s in res.steps)
    assert all(len(s.requests) <= concurrency for s in res.steps)
    assert res.total_seconds == pytest.approx(sum(_hinge(s.num_tokens) for s in res.steps))


@pytest.mark.parametrize("pipelined", [True, False])
def test_replay_accounting(pipelined: bool) -> None:
    reqs = _requests(4)
    pol = _Recorder(5)
    res = replay(reqs, lambda: pol, 2, pipelined, _hinge, _draft)
    # Tokens are conserved: every request runs exactly to its length.
    assert res.total_tokens == sum(r.length for r in reqs)
    assert res.total_tokens == res.accepted_tokens + res.request_steps
    assert sorted(pol.forgotten) == sorted(r.req_id for r in reqs)
    # The policy was told what happened, and only that.
    assert [t.num_tokens for t in pol.timings] == [s.num_tokens for s in res.steps]
    assert [t.seconds for t in pol.timings] == [s.seconds for s in res.steps]
    for fb, s in zip(pol.feedback, res.steps, strict=True):
        assert [(f.req_id, f.num_draft_tokens, f.num_accepted) for f in fb] == [
            (q.req_id, q.k, q.accepted) for q in s.requests if q.k]
    # Time: target steps plus the visible part of drafting.
    target = sum(_hinge(s.num_tokens) for s in res.steps)
    drafting = sum(d.seconds for s in res.steps for d in s.drafts)
    assert res.total_seconds == pytest.approx(target + res.waited_seconds)
    # The drafters stream: every record is one engine step, one position for every request
    # drafted for in the step (k chosen > 0, whatever was verified), costing draft_cost(1, R).
    length = {r.req_id: r.length for r in reqs}

    def chosen(q: TraceRequest) -> int:  # what the fixed policy chose: 5, or the room left
        return min(5, length[q.req_id] - q.position - 1)

    for s in res.steps:
        num_drafted = sum(1 for q in s.requests if chosen(q))
        assert all(d == DraftTiming(num_drafted, 1, _draft(1, num_drafted)) for d in s.drafts)
    if pipelined:
        # Only the first step waits, for all of its drafts: nothing was drafted before it, and
        # the first of the k + 1 drafter steps only stands in for the token the target produced
        # last (here, the prefill's). Later on a drafter step (0.82 ms) is so much shorter than
        # a target step (>= 10 ms) that every path grows past k + 1 tokens during it: a new one
        # by floor(10 / 0.82) - 1 = 11 > 5, a restarted one by 12 - 1 (the restart's step) - 1
        # (the stand-in for the restart step's token) = 10 > 5.
        # (Before streaming drafters, the first step waited for one 5-position call, 2.1 ms.)
        assert res.waited_seconds == pytest.approx(6 * _draft(1, 2))
        assert len(res.steps[0].drafts) == 6
        # Every draft is complete but those of the steps right after a rejection (or a wrong
        # stand-in token): the proposer learns of it only then, so that step has no draft from
        # the stale path (cut whole, not waited for) while the drafter restarts.
        stale = _stale(res, reqs)
        assert stale
        for i, s in enumerate(res.steps):
            for q in s.requests:
                assert q.k == (0 if (i, q.req_id) in stale else chosen(q))
        cuts = [(i, chosen(q)) for i, s in enumerate(res.steps) for q in s.requests
                if (i, q.req_id) in stale and chosen(q)]
        assert res.cut_tokens == sum(k for _, k in cuts)
        assert res.dropped_drafts == len({i for i, _ in cuts})
    else:
        # Synchronous: each step drafts its max k positions first, max k drafter steps.
        assert res.waited_seconds == pytest.approx(drafting)
        assert all(len(s.drafts) == max(q.k for q in s.requests) for s in res.steps)
    # Near the end of a request the draft never runs past its length.
    by_req = {r.req_id: r.length for r in reqs}
    for s in res.steps:
        for q in s.requests:
            assert q.position + q.k + 1 <= by_req[q.req_id]


@pytest.mark.parametrize("pipelined", [False, True])
def test_replay_of_a_recording_reproduces_it(pipelined: bool) -> None:
    if pipelined:
        # A pipelined replay also depends on agreements a recording does not show: the bonus
        # position of a fully accepted draft and the stand-in token of a restart (the step
        # after a rejection verifies nothing). With a wrong token every 5 positions no draft of
        # 8 is fully accepted, and the imputation of a restart's stand-in position (a tie
        # between the rejection before it and the next draft's first token) is right.
        agreement = {f"r{i}": [0 if (x + i) % 5 == 0 else 1 for x in range(300)]
                     for i in range(6)}
    else:
        agreement = _copy_then_free(6, seed=3)
    trace = synthetic_trace(agreement, 8, 3, _hinge, _draft, pipelined=pipelined)
    if pipelined:
        # Restarts recorded: steps without a draft where there was room for one.
        assert any(q.k == 0 and q.position + 1 < 300 for s in trace for q in s.requests)
    res = simulate(trace, lambda: FixedLookahead(8), 3, pipelined)
    got = [[(q.req_id, q.position, q.k, q.accepted) for q in s.requests] for s in res.steps]
    want = [[(q.req_id, q.position, q.k, q.accepted) for q in s.requests] for s in trace]
    assert got == want
    assert res.total_seconds == pytest.approx(trace[-1].t)


class _Waiter(FixedLookahead):
    """A fixed policy answering wait_bound with ``answer`` (None: all of ``max_wait_s``), or with
    the answers of ``choices`` in turn for choose(); records the questions."""

    def __init__(self, k: int, answer: float | None = None,
                 choices: Sequence[int] | None = None) -> None:
        super().__init__(k)
        self.answer = answer
        self.choices = choices
        self.questions: list[tuple[list[int], float]] = []  # (ready, max_wait_s) per question
        self.asked_at: list[int] = []  # the step of each question
        self.chosen: list[list[int]] = []  # the lookaheads of each step
        self._calls = 0

    def choose(self, requests: Sequence[RequestView], max_lookahead: int) -> list[int]:
        ks = super().choose(requests, max_lookahead)
        if self.choices is not None:
            k = self.choices[self._calls % len(self.choices)]
            ks = [min(k, cap) for cap in ks]
        self._calls += 1
        self.chosen.append(ks)
        return ks

    def wait_bound(self, requests: Sequence[RequestView], ready: Sequence[int],
                   max_wait_s: float) -> float:
        self.questions.append((list(ready), max_wait_s))
        self.asked_at.append(self._calls - 1)
        return max_wait_s if self.answer is None else min(self.answer, max_wait_s)


def _flat(n: float) -> float:
    return 0.010


def _streaming(num_positions: int, num_reqs: int) -> float:
    """A drafter step of 2.5 ms: floor(10 ms / 2.5 ms) = 4 tokens per target step of _flat."""
    return 0.0025 * num_positions


def _one(agree: Sequence[int]) -> list[ReplayRequest]:
    return [ReplayRequest.from_agreement("a", agree)]


def _ks(res: Any) -> list[int]:
    return [q.k for s in res.steps for q in s.requests]


def _waits(res: Any) -> list[float]:
    ends = [0.0] + [s.t for s in res.steps]
    return [t1 - t0 - s.seconds for t0, t1, s in zip(ends, ends[1:], res.steps)]


def test_streaming_paths_grow_during_the_target_step_and_restart_on_rejection() -> None:
    # Never waiting (max_wait_s=0), drafts are what the drafter streamed during the previous
    # target step: 4 tokens, the first of them standing in for the target's bonus token (or
    # correction). A lookahead alternating 1 and 6 shows what is left of a path: of 3 ready, a
    # draft of 1 uses 2 (1 accepted, 1 standing in for the bonus), so 1 + 4 are ready next time.
    pol = _Waiter(6, choices=[1, 6])
    res = replay(_one([1] * 40), lambda: pol, 1, True, _flat, _streaming, max_wait_s=0.0)
    # Step 0: nothing drafted yet. Step 1: a new path, 4 - 1 = 3. Step 2: k=1 of 3 ready.
    # Step 3: 3 - 1 - 1 = 1 left + 4 = 5 (not capped by k=6). Then the same again.
    assert _ks(res)[:8] == [0, 3, 1, 5, 1, 5, 1, 5]
    assert pol.questions == []  # no wait budget: nothing to ask
    assert res.waited_seconds == 0.0
    assert res.total_seconds == pytest.approx(0.010 * res.num_steps)
    assert [len(s.drafts) for s in res.steps[:3]] == [0, 4, 4]  # drafter steps since the last
    assert res.steps[1].drafts[0] == DraftTiming(1, 1, 0.0025)
    # Drafts cut to what was ready are counted: steps 0 (1 of 1), 1 (3 of 6), 3, 5, 7 (1 of 6).
    cut = [ks[0] - q.k for ks, s in zip(pol.chosen, res.steps, strict=True) for q in s.requests]
    assert cut[:8] == [1, 3, 0, 1, 0, 1, 0, 1]
    assert res.cut_tokens == sum(cut) and res.dropped_drafts == sum(1 for c in cut if c)

    # Restarts. Lookaheads 1, 6, 1, then 6. The proposer learns that a path is stale at the
    # start of the step after the one that showed it: that step has no draft from it (cut to
    # 0, all of its k counted as cut, not waited for), and the drafter restarts from the text
    # at its start while the target runs it: one drafter step for the restart, then
    # floor(10 / 2.5) - 1 = 3 tokens past the restart point. The first of them stands in for
    # the one token the target produced in the step without a draft: when it is the target's,
    # the next step has 3 - 1 = 2 ready; when not, the path is stale again.
    def restarts(agree: list[int]) -> tuple[list[tuple[int, int, int]], list[int], Any]:
        pol = _Waiter(6, choices=[1, 6, 1] + [6] * 50)
        res = replay(_one(agree), lambda: pol, 1, True, _flat, _streaming, max_wait_s=0.0)
        steps = [(q.position, q.k, q.accepted) for s in res.steps for q in s.requests]
        cut = [ks[0] - q.k for ks, s in zip(pol.chosen, res.steps, strict=True)
               for q in s.requests]
        assert res.cut_tokens == sum(cut)
        return steps, cut, res

    # The drafter's token at position 6 is wrong. Step 0 (position 0): nothing grown yet.
    # Step 1 (1): a new path, 4 - 1 = 3 ready, all accepted, 3 - 3 - 1 = -1 left (the drafter
    # owes the bonus position 4). Step 2 (5): -1 + 4 = 3, k=1: accepted, and the drafter's
    # token at 6, the bonus position, is not the target's: stale. Step 3 (7): no draft (6 of 6
    # cut); restart; the stand-in token at 7 is right: -1 - 1 = -2. Step 4 (8): -2 + 4 = 2.
    # Step 5 (11): 2 - 2 - 1 = -1 left + 4 = 3. (Before: step 3 had 4 - 1 = 3 ready at once.)
    agree = [1] * 40
    agree[6] = 0
    steps, cut, _ = restarts(agree)
    assert steps[:6] == [(0, 0, 0), (1, 3, 3), (5, 1, 1), (7, 0, 0), (8, 2, 2), (11, 3, 3)]
    assert cut[:6] == [1, 3, 0, 6, 4, 3]
    # A draft token rejected (position 5): the same restart, a token earlier.
    agree = [1] * 40
    agree[5] = 0
    steps, cut, _ = restarts(agree)
    assert steps[:5] == [(0, 0, 0), (1, 3, 3), (5, 1, 0), (6, 0, 0), (7, 2, 2)]
    assert cut[:5] == [1, 3, 0, 6, 4]
    # The restart's stand-in token wrong too (position 6): stale again, a second restart at
    # step 4 (7), whose stand-in (7) is right: 2 ready at step 5 (8).
    agree = [1] * 40
    agree[5] = agree[6] = 0
    steps, cut, res = restarts(agree)
    assert steps[:6] == [(0, 0, 0), (1, 3, 3), (5, 1, 0), (6, 0, 0), (7, 0, 0), (8, 2, 2)]
    assert cut[:6] == [1, 3, 0, 6, 6, 4]
    assert res.dropped_drafts == sum(1 for c in cut if c)
    # The restarted request is drafted for: its steps count it in the drafter's batch.
    assert res.steps[3].drafts == (DraftTiming(1, 1, 0.0025),) * 4

    # Unlimited patience does not wait for a stale path. Lookaheads 1, 6, 1, 6 and a wrong
    # token at 5. Step 0 (0): waits 2 drafter steps for 1 token (-1 + 2 = 1), accepted, the
    # bonus (1) right: -1 left. Step 1 (2): -1 + 4 = 3, waits 3 more steps for 6; 3 accepted,
    # the fourth (5) rejected: stale. Step 2 (6): no draft and no wait; restart, stand-in (6)
    # right: -2. Step 3 (7): -2 + 4 = 2, waits 4 steps for 6.
    agree = [1] * 40
    agree[5] = 0
    pol = _Waiter(6, choices=[1, 6])
    res = replay(_one(agree), lambda: pol, 1, True, _flat, _streaming)
    assert [(q.position, q.k, q.accepted) for s in res.steps[:4] for q in s.requests] == [
        (0, 1, 1), (2, 6, 3), (6, 0, 0), (7, 6, 6)]
    assert _waits(res)[:4] == pytest.approx([0.005, 0.0075, 0.0, 0.010])
    assert pol.asked_at[:3] == [0, 1, 3] and pol.questions[2] == ([2], math.inf)


def test_waits_ask_the_policy_again_after_each_wait() -> None:
    # Unlimited patience: step 0 waits for all 4 + 1 drafter steps, then every step for the one
    # token the previous target step did not bring (3 ready of 4).
    pol = _Waiter(4)
    res = replay(_one([1] * 30), lambda: pol, 1, True, _flat, _streaming)
    assert set(_ks(res)[:-1]) == {4}
    assert _waits(res)[:4] == pytest.approx([0.0125, 0.0025, 0.0025, 0.0025])
    assert pol.questions[:3] == [([0], math.inf), ([3], math.inf), ([3], math.inf)]
    assert res.dropped_drafts == 0
    assert [len(s.drafts) for s in res.steps[:2]] == [5, 4 + 1]
    # A budget of 4 ms: step 0 gets one drafter step (the stand-in token) and goes on without a
    # draft; afterwards the one missing token comes within the budget. A wait never runs past
    # the moment the drafts are complete (2.5 ms, not 4).
    pol = _Waiter(4)
    res = replay(_one([1] * 30), lambda: pol, 1, True, _flat, _streaming, max_wait_s=0.004)
    assert _ks(res)[:3] == [0, 4, 4]
    assert _waits(res)[:3] == pytest.approx([0.004, 0.0025, 0.0025])
    assert pol.questions[:2] == [([0], 0.004), ([3], 0.004)]
    assert res.dropped_drafts == 1 and res.cut_tokens == 4
    # A policy waiting 1 ms at a time is asked again and again: 3 questions for a 2.5 ms step.
    pol = _Waiter(4, answer=0.001)
    res = replay(_one([1] * 30), lambda: pol, 1, True, _flat, _streaming)
    assert _waits(res)[1] == pytest.approx(0.0025)
    assert _ks(res)[:2] == [4, 4]
    step1 = [q for q, step in zip(pol.questions, pol.asked_at, strict=True) if step == 1]
    assert step1 == [([3], math.inf)] * 3


def test_late_drafts_are_cut_to_what_is_ready() -> None:
    def slow_draft(num_positions: int, num_reqs: int) -> float:
        return 0.05 * num_positions  # a drafter step longer than any target step

    # (This replaces a test of the former all-or-nothing model, where a draft not complete
    # within one wait_bound was dropped whole: streamed drafts are cut to what is ready.)
    reqs = _requests(2)
    # Never waiting, a drafter slower than the target never has anything ready: every step
    # that chose a draft (all but the last of each request, which has no room) goes on without.
    never = replay(reqs, lambda: _Waiter(4, answer=0.0), 2, True, _hinge, slow_draft)
    assert never.drafted_tokens == 0 and never.waited_seconds == 0.0
    assert never.dropped_drafts >= never.num_steps - 2
    assert never.total_tokens == never.request_steps  # no speculation, in effect
    # With 120 ms per step: 2 drafter steps, the first standing in for the last target token,
    # so one token per request.
    budget = replay(reqs, lambda: _Waiter(4), 2, True, _hinge, slow_draft, max_wait_s=0.12)
    assert set(_ks(budget)) <= {0, 1} and budget.drafted_tokens > 0
    assert max(_waits(budget)) == pytest.approx(0.12)
    assert budget.dropped_drafts >= budget.num_steps - 2
    # Unlimited patience: every draft complete, but after a rejection (or a wrong stand-in
    # token) the stale path gives nothing to wait for: those steps go on without a draft.
    patient = replay(reqs, lambda: FixedLookahead(4), 2, True, _hinge, slow_draft)
    length = {r.req_id: r.length for r in reqs}
    stale = _stale(patient, reqs)
    assert stale and patient.drafted_tokens > budget.drafted_tokens
    for i, s in enumerate(patient.steps):
        for q in s.requests:
            full = min(4, length[q.req_id] - q.position - 1)
            assert q.k == (0 if (i, q.req_id) in stale else full)


def test_adaptive_waits_one_drafter_step_at_a_time() -> None:
    answers: list[float] = []

    class Recording(AdaptiveLookahead):
        def wait_bound(self, requests: Sequence[RequestView], ready: Sequence[int],
                       max_wait_s: float) -> float:
            w = super().wait_bound(requests, ready, max_wait_s)
            answers.append(w)
            return w

    # A drafter step of 4 ms against a target step of 10 ms: a draft of k needs k + 1 steps.
    res = replay(_requests(2), lambda: Recording(8), 2, True, _hinge,
                 lambda p, r: 0.004 * p, max_wait_s=0.05)
    assert answers[0] == 0.05  # the drafter's speed not measured yet
    # Then one drafter step at a time, as the policy estimates it (early on, from steps of 2
    # requests only, its guess for 1 request can be off), or 0 when the next token is not worth
    # it; it is asked again after every wait.
    later = answers[1:]
    assert later and all(w == 0.0 or 0.002 < w <= 0.004 + 1e-9 for w in later)
    assert 0.0 in later and any(w > 0 for w in later)  # it waits, and stops waiting
    assert all(w <= 0.05 + 1e-12 for w in _waits(res))
    assert res.total_tokens == sum(r.length for r in _requests(2))


def test_replay_rejects_bad_policies_and_settings() -> None:
    class Greedy(FixedLookahead):
        def choose(self, requests: Sequence[RequestView], max_lookahead: int) -> list[int]:
            return [max_lookahead] * len(requests)  # ignores the room left

    with pytest.raises(ValueError, match="policy chose"):
        replay(_requests(1), lambda: Greedy(8), 1, True, _hinge)
    with pytest.raises(ValueError, match="concurrency"):
        replay(_requests(1), NoSpeculation, 0, True, _hinge)
    with pytest.raises(ValueError, match="noise"):
        replay(_requests(1), NoSpeculation, 1, True, _hinge, noise=-1)


# ----------------------------------------------------------------------------------- policies


def _rates(trace: list[TraceStep], names: Sequence[str], concurrency: int,
           pipelined: bool = True) -> dict[str, float]:
    pols = default_policies(8, pipelined)
    rows = compare(trace, {n: pols[n] for n in names}, [concurrency], pipelined)
    return {r["policy"]: r["tokens_per_s"] for r in rows}


@pytest.mark.parametrize("concurrency", [1, 4])
def test_adaptive_near_best_fixed_when_verification_is_free(concurrency: int) -> None:
    # Flat cost up to 16 tokens: at batch 1 every k is free (best: k=8); at 4 requests the knee
    # is at k=3, beyond which every token costs 5% of the step.
    trace = synthetic_trace(_copy_then_free(8), 8, 4, _hinge, _draft,
                            calibration_tokens=range(1, 300))
    names = ["adaptive"] + [f"k={k}" for k in range(1, 9)]
    rates = _rates(trace, names, concurrency)
    best_fixed = max(v for k, v in rates.items() if k != "adaptive")
    assert rates["adaptive"] >= 0.95 * best_fixed


def test_adaptive_not_below_no_speculation_when_verification_is_expensive() -> None:
    # 32 requests, 0.4 ms per verified token, acceptance 0.3: every draft token loses time.
    rng = np.random.default_rng(1)
    agreement = {f"r{i}": _agreement([(0.3, 200)], rng) for i in range(96)}
    trace = synthetic_trace(agreement, 8, 32, _linear, _draft, calibration_tokens=range(1, 300))
    rates = _rates(trace, ["adaptive", "k=0", "k=1", "k=8"], 32)
    # The scenario is what it claims. (Pipelined, a path is stale after most steps, and a
    # restart's stand-in token is right only 30% of the time: k=1 gets a draft verified in
    # about a quarter of the steps, which limits its loss; long drafts lose plainly.)
    assert rates["k=1"] < rates["k=0"] and rates["k=8"] < 0.8 * rates["k=0"]
    assert rates["adaptive"] >= 0.98 * rates["k=0"]


def test_adaptive_adapts_within_a_few_steps_after_a_change_of_character() -> None:
    # Batch 1, synchronous drafting at 1.5 ms per position against a 10 ms step: long drafts
    # pay while copying (acceptance 0.9), one or two tokens once the text is free (0.3).
    requests = _requests(3, seed=0)
    res = replay(requests, lambda: AdaptiveLookahead(8, pipelined=False), 1, False,
                 lambda n: 0.010, lambda p, r: 0.0015 * p)
    for rid in ("r1", "r2"):  # r0 also pays for the exploration of the cost curve
        ks = [(q.position, q.k) for s in res.steps for q in s.requests if q.req_id == rid]
        switch = next(i for i, (pos, _) in enumerate(ks) if pos >= 150)
        before = [k for _, k in ks[switch - 10:switch]]
        # Copying: long drafts (the rate is flat near the optimum: k=5 is within 4% of k=8).
        assert sum(before) / len(before) >= 4
        assert min(k for _, k in ks[switch:switch + 6]) <= 2  # adapted within 6 steps
        free = [k for _, k in ks[switch + 10:]]
        assert sum(free) / len(free) <= 2  # free text: mostly k=1
    fixed = {k: replay(requests, lambda k=k: FixedLookahead(k), 1, False, lambda n: 0.010,
                       lambda p, r: 0.0015 * p).tokens_per_second for k in range(1, 9)}
    assert res.tokens_per_second > max(fixed.values())  # per-phase lengths beat any single k


def test_compare_table_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(2)
    agreement = {f"r{i}": _agreement([(0.9, 40), (0.3, 40)], rng) for i in range(3)}
    trace = synthetic_trace(agreement, 4, 2, _hinge, _draft, calibration_tokens=range(1, 40))
    rows = compare(trace, default_policies(4), [1, 2])
    assert {r["policy"] for r in rows} == {"adaptive", "k=0", "k=1", "k=2", "k=3", "k=4"}
    assert all(r["tokens"] == 240 for r in rows)  # 3 requests x 80 tokens, whatever the policy
    assert all(r["speedup"] == pytest.approx(1.0) for r in rows if r["policy"] == "k=0")
    table = format_table(rows)
    assert table.splitlines()[0].startswith("| policy | c=1")
    assert table.count("**") >= 4  # the best cell of each column (ties are all marked)
    path = tmp_path / "trace.jsonl"
    write_trace(path, trace)
    assert main([str(path), "--concurrency", "1,2", "--max-lookahead", "3"]) == 0
    out = capsys.readouterr().out
    assert "| adaptive |" in out and "| k=3 |" in out and "| k=4 |" not in out
    with pytest.raises(SystemExit):
        main([str(path), "--concurrency", "0"])
    assert math.isfinite(rows[0]["tokens_per_s"])


def test_summary_splits_the_time_by_mode_and_prefill(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    def req(rid: str, k: int, a: int) -> TraceRequest:
        return TraceRequest(rid, 0, k, a)

    trace = [
        # Model drafting, decodes only: a drafted 4 (2 accepted), b none.
        TraceStep(0, 1.0, 0.3, 6, (req("a", 4, 2), req("b", 0, 0)), drafting=True),
        # Without, a 100-token prompt chunk beside a's 2-token draft (accepted 1).
        TraceStep(1, 2.0, 0.6, 103, (req("a", 2, 1),), drafting=False),
        TraceStep(2, 3.0, 0.1, 2, (req("a", 0, 0), req("b", 0, 0)), drafting=False),
        TraceStep(3, 4.0, 0.2, 50, ()),  # an old trace: not recorded, prefill only
    ]
    rows = summarize(trace)
    assert [(r["models"], r["prefill"]) for r in rows] == [
        (True, False), (False, False), (False, True), (None, True)]
    first, free, free_prefill, unknown = rows
    assert (first["steps"], first["output_tokens"], first["drafted"], first["accepted"]) == (
        1, 4, 4, 2)
    assert first["output_tokens_per_s"] == pytest.approx(4 / 0.3)
    assert first["tokens_per_request_step"] == pytest.approx(2.0)
    assert first["share"] == pytest.approx(0.3 / 1.2)
    assert (free["output_tokens"], free["prefill_tokens"]) == (2, 0)
    assert (free_prefill["prefill_tokens"], free_prefill["output_tokens"]) == (100, 2)
    assert unknown["tokens_per_request_step"] is None and unknown["prefill_tokens"] == 50
    table = format_summary(rows)
    assert len(table.splitlines()) == 2 + 4 and "| with model drafters | no | 1 |" in table
    path = tmp_path / "trace.jsonl"
    write_trace(path, trace)
    assert main([str(path), str(path), "--summary"]) == 0  # two traces: drafting kept
    out = capsys.readouterr().out
    assert out.startswith("8 steps, 2.4 s") and "| with model drafters | no | 2 |" in out


def test_module_imports_no_engine() -> None:
    # The simulator must run where vllm/torch are not installed: stdlib, numpy and the pure
    # controller modules and trace format only.
    import vllm_smurfs.trace_sim as mod

    tree = ast.parse(Path(mod.__file__).read_text())
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            roots.add(node.module or "")
    allowed = {"numpy", "__future__", "vllm_smurfs.length_controller", "vllm_smurfs.step_costs",
               "vllm_smurfs.trace", "vllm_smurfs.trace_reconstruct",
               "vllm_smurfs.trace_report"}  # the CLI, under __main__
    assert {r for r in roots if r.split(".")[0] not in sys.stdlib_module_names} <= allowed


def test_the_runtime_does_not_import_the_simulator() -> None:
    # The proposer writes traces (`trace`); replaying them is offline work, never the engine's.
    code = ("import sys, vllm_smurfs.proposer; "
            "print(sorted(m for m in sys.modules if m.startswith('vllm_smurfs.trace')))")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=env)
    assert out.stdout.strip() == "['vllm_smurfs.trace']"


def test_no_speculation_is_a_lookahead_policy() -> None:
    from vllm_smurfs.length_controller import LookaheadPolicy

    assert isinstance(NoSpeculation(), LookaheadPolicy) and not NoSpeculation().models_on


def test_model_free_steps_are_reconstructed_apart_and_replayed() -> None:
    from vllm_smurfs.length_controller import AdaptiveLookahead

    # Recorded: model steps (rejected at once) and model-free steps (2 of 3 accepted).
    trace = [TraceStep(0, 0.1, 0.1, 4, (TraceRequest("a", 0, 3, 0),), drafting=True),
             TraceStep(1, 0.2, 0.01, 4, (TraceRequest("a", 1, 3, 2),), drafting=False)]
    (req,) = reconstruct(trace)
    assert req.free_len is not None and req.free_acc is not None
    assert list(req.free_len) == [3, 3, 3, 3] and list(req.free_acc[1:3]) == [2, 1]
    assert list(req.acc) == [0, 0, 0, 0]  # the model drafts' agreement, not the voters'
    # The real policy, free to leave the model drafters out: they never pay here.
    length = 300
    reqs = [ReplayRequest(f"r{i}", np.zeros(length, dtype=np.int64), None, 0,
                          np.full(length, 3), acc_from_agreement(np.ones(length)))
            for i in range(4)]
    res = replay(reqs, lambda: AdaptiveLookahead(4, model_free_mode=True), 4, True, _hinge,
                 _draft, max_lookahead=4, step_cost_model_free=lambda n: 0.5 * _hinge(n))
    modes = [s.drafting for s in res.steps]
    assert modes.count(False) > 0.8 * len(modes)  # settled without the model drafters
    assert res.accepted_tokens > 2 * len(modes)  # the voters' drafts were verified
    assert res.final_snapshot["free_mode"] is True and res.final_snapshot["retries"] >= 0
