"""SmurfsProposer's per-request bookkeeping, with a scripted drafter runtime (no engine).

The proposer imports no vLLM: the worker runtime is swapped for a fake that returns scripted
drafts, so request-id keyed state, freeing, learning and lookahead caps are tested in
milliseconds. The real drafters are exercised end to end in tests/e2e.
"""

from types import SimpleNamespace

import numpy as np
import pytest

from vllm_smurfs import proposer as proposer_module
from vllm_smurfs.control.plan import Plan
from vllm_smurfs.proposer import SmurfsProposer
from vllm_smurfs.runner_hooks import StepContext

K = 4


class ScriptedWorker:
    """Model drafter d proposes ``script[d](context, k)``; records what it was asked. Model-free
    voters (ngram entries of the config) draft ``free[i]`` tokens for request i."""

    def __init__(self, config, **_):
        self.names = [f"d{i}" for i in range(len(config.drafters))]
        self.script = [lambda ctx, k: [7] * k, lambda ctx, k: [7, 8, 9][:k]]
        self.asked: list = []
        self.ahead: list = []
        self.forgotten: list = []
        self.models_alive = True
        self.free: list[int] | None = None  # model-free draft lengths (default: none ready)
        self.models_used: list[bool] = []
        self.model_free_indices = [i for i, d in enumerate(config.drafters)
                                   if getattr(d, "method", "") == "ngram"]
        self.model_indices = [i for i in range(len(self.names))
                              if i not in self.model_free_indices]
        self.in_worker_indices: list[int] = []
        self.lends_cores = False

    def start(self):
        pass

    def poll(self):
        pass

    def late(self, requests):
        return []

    def wait(self, requests, timeout_s):
        return True

    def ready(self, requests, models=True, free=None):
        self.asked.append([(r.req_id, len(r.context), r.k) for r in requests])
        out = []
        for i, r in enumerate(requests):
            per = [[] for _ in self.names]
            for d in self.model_indices:
                per[d] = self.script[d](r.context, r.k) if models else []
            for d in self.model_free_indices:
                per[d] = free[i][d][: r.k] if free is not None else []
            out.append(per)
        return out

    def model_free_drafts(self, requests):
        lens = self.free if self.free is not None else [0] * len(requests)
        out = []
        for f, _ in zip(lens, requests):
            per = [[] for _ in self.names]
            for d in self.model_free_indices:
                per[d] = [1] * f
            out.append(per)
        return out

    def use_models(self, on):
        self.models_used.append(on)

    def track(self, requests, chains, max_lead):
        self.ahead.append([(r.req_id, list(chain)) for r, chain in zip(requests, chains)])

    def step_timings(self):
        return []

    def forget(self, req_ids):
        self.forgotten.extend(req_ids)

    def health(self):
        return [SimpleNamespace(alive=True, steps_late=0, steps_answered=0, busy_s=0.0,
                                extra={}) for _ in self.names]


def make_proposer(monkeypatch, **extra):
    monkeypatch.setattr(proposer_module, "DrafterPool", ScriptedWorker)
    smurfs = {"method": "smurfs", "num_speculative_tokens": K, "log_stats_interval_s": 0,
              "lookahead": {"policy": "fixed"},
              "drafters": [{"model": "/a", "placement": "process"},
                           {"model": "/b", "placement": "process"}], **extra}
    vllm_config = SimpleNamespace(
        additional_config={"smurfs": smurfs},
        model_config=SimpleNamespace(max_model_len=64, dtype="float32",
                                     trust_remote_code=False),
        scheduler_config=SimpleNamespace(max_num_seqs=8))
    p = SmurfsProposer(vllm_config)
    p.load_model(None)
    return p


@pytest.fixture
def proposer(monkeypatch):
    return make_proposer(monkeypatch)


def step(p, req_ids, sampled, lengths, finished=(), restarted=(), max_spec=K, scheduled=0):
    tokens = np.zeros((8, 64), dtype=np.int32)
    p.begin_step(StepContext(list(req_ids), frozenset(finished), frozenset(restarted), max_spec,
                             num_scheduled_tokens=scheduled))
    return p.propose(sampled, np.array(lengths + [0] * (8 - len(lengths))), tokens)


def test_requires_step_context(proposer):
    with pytest.raises(RuntimeError, match="patch of GPUModelRunner.propose_draft_token_ids"):
        proposer.propose([[1]], np.array([3]), np.zeros((1, 64), dtype=np.int32))


def test_vote_per_request_and_state_follows_request_ids(proposer):
    # Equal weights, drafters disagree at depth 1: tie goes to the first drafter.
    out = step(proposer, ["a", "b"], [[5], [6]], [10, 20])
    assert out == [[7, 7, 7, 7], [7, 7, 7, 7]]
    # Rows swap; the target produced 7,8,9,... for "a": drafter 1 was right, drafter 0 was not.
    out = step(proposer, ["b", "a"], [[1], [7, 8, 9]], [21, 13])
    state_a, state_b = proposer._states["a"], proposer._states["b"]
    assert state_a.weights.weights[1] > state_a.weights.weights[0]
    assert state_b.weights.weights == pytest.approx(state_b.weights.weights[::-1])
    # "a" now follows drafter 1 (its weight outgrew drafter 0's); "b" still the tie-break.
    assert out == [[7, 7, 7, 7], [7, 8, 9]]
    assert proposer.stats.verified_drafts == 2


def test_partial_prefill_rows_get_no_draft_and_lookahead_is_capped(proposer):
    out = step(proposer, ["a", "b", "c"], [[], [3], [4]], [10, 62, 10], max_spec=2)
    # "a" sampled nothing (still prefilling); "b" has room for 1 draft token under
    # max_model_len 64 (62 tokens + 1 draft + 1 bonus); "c" gets the scheduler's cap of 2.
    assert proposer.worker.asked[-1] == [("b", 62, 1), ("c", 10, 2)]
    assert out == [[], [7], [7, 7]]


def test_finished_and_restarted_requests_are_freed(proposer):
    step(proposer, ["a", "b", "c"], [[1], [1], [1]], [5, 5, 5])
    assert set(proposer._states) == {"a", "b", "c"}
    step(proposer, ["b"], [[1]], [6], finished={"a"}, restarted={"c"})
    assert set(proposer._states) == {"b"}
    assert sorted(proposer.worker.forgotten) == ["a", "c"]  # the drafters drop them too


def test_pipelined_proposer_drafts_ahead_past_the_voted_chain(proposer):
    out = step(proposer, ["a", "b"], [[], [3]], [10, 12])
    assert proposer.worker.ahead[-1] == [("b", out[1])]


def test_trace_file_records_verified_drafts_for_the_simulator(monkeypatch, tmp_path):
    from vllm_smurfs.trace.format import read_trace

    path = tmp_path / "trace.jsonl"
    p = make_proposer(monkeypatch, trace_file=str(path))
    step(p, ["a", "b"], [[5], [6]], [10, 20])  # first step: no timing yet, not traced
    # The target accepted 7, 7 of a's draft [7, 7, 7, 7] (then produced 1); b had none accepted.
    step(p, ["a", "b"], [[7, 7, 1], [2]], [13, 21])
    (traced,) = read_trace(path)
    assert traced.seconds >= 0 and traced.step == 1
    assert traced.drafting is True  # the step the trace times drafted with the model drafters
    assert [(r.req_id, r.position, r.k, r.accepted) for r in traced.requests] == [
        ("a", 10, 4, 2), ("b", 20, 4, 0)]


class _ScriptedController:
    """A controller answering fixed lookaheads and streaming, recording what it is told."""

    def __init__(self, k, streaming):
        self.k, self.streaming = k, streaming
        self.outcomes, self.timings, self.requests = [], [], []

    def plan(self, requests, max_lookahead, *, prompt_pending=False):
        self.requests.append(list(requests))
        ks = [min(self.k, r.cap) if self.streaming else min(self.k, r.free_len)
              for r in requests]
        return Plan(lookaheads=ks, model_rows=[], streaming=self.streaming, mode="scripted")

    def observe(self, outcomes):
        self.outcomes.extend(outcomes)

    def observe_step(self, timing):
        self.timings.append(timing)

    def observe_draft(self, timing):
        pass

    def observe_pass(self, drafter, num_tokens, seconds):
        pass

    def wait_s(self, plan, late, max_wait_s):
        return 0.0

    def forget(self, req_ids):
        pass

    def snapshot(self):
        return {}


def with_voter(monkeypatch):
    return make_proposer(monkeypatch, drafters=[
        {"model": "/a", "placement": "process"}, {"model": "/b", "placement": "process"},
        {"method": "ngram"}])


def test_a_step_without_streaming_pauses_the_drafters_and_drafts_model_free_only(monkeypatch):
    proposer = with_voter(monkeypatch)
    proposer.controller = _ScriptedController(2, streaming=False)
    proposer.worker.free = [3, 0]
    out = step(proposer, ["a", "b"], [[5], [6]], [10, 12])
    # The controller saw what the voters have ready.
    assert [r.free_len for r in proposer.controller.requests[0]] == [3, 0]
    assert proposer.worker.models_used == []  # nothing to pause: the target keeps its cores
    assert proposer.worker.ahead == []  # nothing tracked: no model drafter works this step
    assert out == [[1, 1], []]  # the n-gram chain, cut to the plan's lookahead
    assert proposer.stats.steps_without_models == 1
    stats = proposer.stats  # "a" had an n-gram chain, "b" none
    assert (stats.request_steps, stats.request_steps_without_models_free_chain,
            stats.request_steps_without_models_no_chain) == (2, 1, 1)
    # The next step's timing is filed under "no model drafting".
    step(proposer, ["a", "b"], [[5], [6]], [11, 13])
    assert proposer.controller.timings[-1].drafting is False
    proposer.controller.streaming = True
    step(proposer, ["a", "b"], [[5], [6]], [12, 14])
    assert proposer.worker.models_used == [True]  # the drafters get work and the shared cores
    assert proposer.controller.timings[-1].drafting is False
    proposer.controller.streaming = False
    step(proposer, ["a", "b"], [[5], [6]], [13, 15])
    assert proposer.worker.models_used == [True, False]
    assert proposer.controller.timings[-1].drafting is True


def test_the_controller_learns_the_model_free_chain_and_the_voted_chain(monkeypatch):
    proposer = with_voter(monkeypatch)
    proposer.controller = _ScriptedController(3, streaming=True)
    proposer.worker.free = [3]
    step(proposer, ["a"], [[5]], [10])
    # The vote took drafter 0's [7, 7, 7]; the target produced 7, 1: one accepted. The
    # model-free chain [1, 1, 1] matched nothing.
    step(proposer, ["a"], [[7, 1]], [12])
    (outcome,) = proposer.controller.outcomes
    assert outcome.voted == (3, 1) and outcome.models and outcome.with_free
    assert outcome.free is not None and (outcome.free.tokens, outcome.free.matched) == (3, 0)


def test_a_step_timing_carries_its_prompt_tokens_and_the_proposer_time(proposer):
    proposer.controller = _ScriptedController(2, streaming=True)
    step(proposer, ["a"], [[5]], [10])
    first = proposer.stats.proposer_s
    proposer.before_forward(6)  # the scheduler put 6 prompt tokens into the step
    proposer.begin_step(StepContext(["a"], frozenset(), frozenset(), K,
                                    num_scheduled_tokens=9))
    proposer.propose([[5]], np.array([11] + [0] * 7), np.zeros((8, 64), dtype=np.int32))
    second = proposer.stats.proposer_s - first
    step(proposer, ["a"], [[5]], [12])
    # Each step's timing carries the call that drafted for it: the one just before it.
    timings = proposer.controller.timings
    assert [t.overhead_s for t in timings] == pytest.approx([first, second], abs=1e-3)
    assert (timings[0].num_tokens, timings[0].prompt_tokens) == (9, 6)
    assert timings[1].prompt_tokens == 0  # a step with no prompt chunk


@pytest.mark.parametrize("lends_cores", [True, False])
def test_a_step_with_prompt_chunks_gets_the_lent_cores_back(proposer, lends_cores):
    # A GEMM created while cores are lent keeps fewer threads: a step that brings new token
    # counts (prompt chunks) runs with the drafters paused and the cores back.
    proposer.worker.lends_cores = lends_cores
    proposer.controller = _ScriptedController(2, streaming=True)
    step(proposer, ["a"], [[5]], [10])  # the model drafters draft for step 2
    assert proposer.worker.models_used == [True]
    proposer.before_forward(0)  # decodes only: nothing changes
    assert proposer.worker.models_used == [True]
    proposer.before_forward(256)
    assert proposer.worker.models_used == ([True, False] if lends_cores else [True])
    assert proposer.stats.prefill_takebacks == int(lends_cores)
    step(proposer, ["a"], [[5]], [11])
    # The step ran without the model drafters; the next one gets them (and the cores) again.
    assert [t.drafting for t in proposer.controller.timings] == [not lends_cores]
    assert proposer.worker.models_used == ([True, False, True] if lends_cores else [True])


def test_the_first_drafting_step_lends_the_shared_cores(proposer):
    step(proposer, ["a"], [[5]], [10])  # fixed policy: every step drafts with the models
    step(proposer, ["a"], [[5]], [11])
    assert proposer.worker.models_used == [True]


def test_no_draft_past_max_tokens(monkeypatch):
    # The adaptive controller hears each request's max_tokens left from the runner (the fixed
    # policy drafts k tokens as vLLM's methods do).
    p = make_proposer(monkeypatch, pipeline=False, lookahead={"policy": "adaptive"})
    runner = SimpleNamespace(requests={"a": SimpleNamespace(
        sampling_params=SimpleNamespace(max_tokens=5), output_token_ids=[1, 2, 3])})
    tokens = np.zeros((8, 64), dtype=np.int32)
    outs = []
    for length in (10, 11):  # the first step drafts only what is in hand; then an experiment
        p.begin_step(StepContext(["a"], frozenset(), frozenset(), K, runner=runner,
                                 num_scheduled_tokens=1))
        outs.append(p.propose([[5]], np.array([length] + [0] * 7), tokens))
    assert outs == [[[]], [[7]]]  # 2 tokens left: one draft and the target's own


def test_synchronous_process_drafters_draft_the_plans_rows(monkeypatch):
    p = make_proposer(monkeypatch, pipeline=False, lookahead={"policy": "adaptive"})
    # The first step, before any timing, drafts only what is in hand (nothing here).
    assert step(p, ["a", "b"], [[5], [6]], [10, 20], scheduled=2) == [[], []]
    # Then the controller's first experiment: the drafters draft for the requests exactly the
    # lookaheads planned (two tokens), and the proposer waits for them (nothing tracked ahead).
    out = step(p, ["a", "b"], [[5], [6]], [11, 21], scheduled=2)
    assert out == [[7, 7], [7, 7]]
    assert p.worker.ahead[-1] == [("a", []), ("b", [])]
    assert p.get_stats()["controller"]["last_plan"]["mode"] == "explore"


def test_prompt_heavy_steps_take_the_cores_back_through_the_one_record(monkeypatch):
    p = make_proposer(monkeypatch, lookahead={"policy": "adaptive"})
    p.worker.lends_cores = True
    step(p, ["a"], [[1]], [10])
    assert p.model_drafting.on and p.worker.models_used == [True]
    p.before_forward(0)  # no prompt chunk: nothing to take back
    assert p.model_drafting.on
    p.before_forward(32)
    # The pool is told through the one record.
    assert not p.model_drafting.on and p.worker.models_used == [True, False]
    assert p.stats.prefill_takebacks == 1
