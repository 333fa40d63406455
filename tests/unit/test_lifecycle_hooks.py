"""Request lifecycle when vLLM skips ``propose``: the runner hooks and the proposer's side of it,
with scripted scheduler outputs and the scripted drafter runtime (no engine). The real engine is
in tests/e2e/test_lifecycle.py."""

from __future__ import annotations

from types import SimpleNamespace

from test_proposer_state import make_proposer, step

from vllm_smurfs.runner_hooks import deliver_lifecycle, mark_proposed, within_vocabulary


def output(tokens: int, finished=(), preempted=(), resumed=()):
    return SimpleNamespace(total_num_scheduled_tokens=tokens, finished_req_ids=set(finished),
                           preempted_req_ids=set(preempted),
                           scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=list(resumed)))


class Listener:
    def __init__(self) -> None:
        self.events: list = []

    def forget(self, req_ids) -> None:
        self.events.append(("forget", sorted(req_ids)))

    def propose_skipped(self) -> None:
        self.events.append(("skipped",))


def test_every_step_delivers_its_ended_requests_and_skipped_proposes():
    runner, listener = SimpleNamespace(), Listener()
    deliver_lifecycle(runner, listener, output(8))
    mark_proposed(runner)  # vLLM proposed after that step
    deliver_lifecycle(runner, listener, output(9, preempted={"b"}, resumed={"c"}))
    # No propose after it (a request near max_model_len): the next step says so first.
    deliver_lifecycle(runner, listener, output(0, finished={"a"}))
    # A step without tokens has no propose to miss; the idle engine's next step is clean.
    deliver_lifecycle(runner, listener, output(4))
    assert listener.events == [("forget", ["b", "c"]), ("skipped",), ("forget", ["a"])]


def test_drafts_are_cut_before_an_id_the_target_has_no_row_for():
    assert within_vocabulary([[1, 2, 3], [5, 640, 7], [700], []], 640) == [
        [1, 2, 3], [5], [], []]
    assert within_vocabulary(None, 640) is None


def test_a_skipped_propose_voids_the_pending_drafts_and_the_step_timer(monkeypatch):
    proposer = make_proposer(monkeypatch)
    step(proposer, ["a", "b"], [[5], [6]], [10, 20])
    assert proposer.live_request_state()["pending_drafts"] == 2
    proposer.propose_skipped()
    assert proposer.live_request_state()["pending_drafts"] == 0
    # The next propose scores nothing (those drafts were verified in the skipped step) and
    # does not time a step from its last return.
    step(proposer, ["a", "b"], [[9, 9, 9], [1]], [14, 22])
    assert proposer.stats.verified_drafts == 0
    assert proposer.stats.target_step_s == 0.0


def test_live_request_state_counts_what_requests_leave_behind(monkeypatch):
    proposer = make_proposer(monkeypatch)
    step(proposer, ["a", "b"], [[5], [6]], [10, 20])
    state = proposer.live_request_state()
    assert state["requests"] == 2 and state["pending_drafts"] == 2
    proposer.forget(["a", "b"])
    assert set(proposer.live_request_state().values()) == {0}
