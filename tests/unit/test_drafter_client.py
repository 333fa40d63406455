"""The streaming drafter's two ends, without processes or engines.

`PathDrafter` (the server's state) runs on a scripted engine whose "model" continues any text by
a fixed rule; `ModelDrafterClient` (the proposer's end) talks to a scripted server over a pipe.
"""

import time
from multiprocessing import Pipe

import numpy as np
import pytest

from vllm_smurfs.config import ModelDrafterConfig, SmurfsConfig
from vllm_smurfs.drafters.channel import Channel, frame
from vllm_smurfs.drafters.process_client import MAX_MESSAGES_IN_FLIGHT, ModelDrafterClient
from vllm_smurfs.drafters.process_server import PathDrafter
from vllm_smurfs.drafters.protocol import Forget, Pause, StepFailed, Track, Update
from vllm_smurfs.multi_draft_worker import DrafterPool, DraftRequest


def ctx(*tokens):
    return np.array(tokens, dtype=np.int32)


class ScriptedEngine:
    """Greedy "model": the next token is the previous one plus one."""

    def __init__(self):
        self.live: dict[str, list] = {}  # engine_id -> [tokens so far, tokens left]
        self.added: list[tuple[str, list[int], int]] = []
        self.aborted: list[str] = []

    def add(self, engine_id, prompt, max_tokens):
        self.added.append((engine_id, list(prompt), max_tokens))
        self.live[engine_id] = [list(prompt), max_tokens]

    def abort(self, engine_id):
        self.aborted.append(engine_id)
        self.live.pop(engine_id)

    def busy(self):
        return bool(self.live)

    def step(self):
        moved = []
        for engine_id, state in list(self.live.items()):
            tokens, left = state
            tokens.append(tokens[-1] + 1)
            state[1] = left - 1
            moved.append((engine_id, [tokens[-1]], state[1] == 0))
            if state[1] == 0:
                del self.live[engine_id]
        return moved


@pytest.fixture
def drafter():
    return PathDrafter(ScriptedEngine(), max_model_len=64)


def run(drafter, steps):
    for _ in range(steps):
        drafter.step()
    return drafter.take_records()


def test_path_streams_and_pauses_at_the_lead(drafter):
    drafter.track("r", ctx(1, 2), max_lead=4)
    assert drafter.engine.added == [("r#1", [1, 2], 4)]
    records = run(drafter, 6)
    assert records[0][:2] == ("r", "reset") and records[0][2].tolist() == [1, 2]
    assert [(p[0], p[1].tolist()) for _, kind, p in records if kind == "extend"] == [
        (2, [3]), (3, [4]), (4, [5]), (5, [6])]
    assert records[-1] == ("r", "stop", None)  # 4 tokens ahead: paused
    assert drafter.tracks["r"].path.tolist() == [1, 2, 3, 4, 5, 6]
    assert not drafter.engine.busy()


def test_accepted_text_keeps_the_path_and_resumes_at_half_lead(drafter):
    drafter.track("r", ctx(1, 2), max_lead=4)
    run(drafter, 4)
    drafter.track("r", ctx(1, 2, 3), max_lead=4)  # lead 3 of 4: not yet
    assert len(drafter.engine.added) == 1 and drafter.take_records() == []
    drafter.track("r", ctx(1, 2, 3, 4), max_lead=4)  # lead 2: resume from the path's end
    assert drafter.engine.added[-1] == ("r#2", [1, 2, 3, 4, 5, 6], 2)
    assert drafter.take_records() == [("r", "resume", None)]


def test_text_leaving_the_path_restarts_it(drafter):
    drafter.track("r", ctx(1, 2), max_lead=8)
    run(drafter, 2)  # path 1 2 3 4, still drafting
    drafter.track("r", ctx(1, 2, 3, 9), max_lead=8)  # the target took 9, not 4
    assert drafter.engine.aborted == ["r#1"]
    assert drafter.engine.added[-1] == ("r#2", [1, 2, 3, 9], 8)
    run(drafter, 1)
    assert drafter.tracks["r"].path.tolist() == [1, 2, 3, 9, 10]
    drafter.forget("r")
    assert drafter.engine.aborted == ["r#1", "r#2"] and "r" not in drafter.tracks


def test_no_room_left_means_no_request(drafter):
    drafter.track("r", ctx(*range(64)), max_lead=4)
    assert drafter.engine.added == []
    assert [kind for _, kind, _ in drafter.take_records()] == ["reset", "stop"]


def test_pause_stops_every_request_and_says_so(drafter):
    drafter.track("r", ctx(1, 2), max_lead=8)
    drafter.track("s", ctx(5), max_lead=8)
    run(drafter, 1)
    drafter.pause()
    assert sorted(drafter.engine.aborted) == ["r#1", "s#1"] and not drafter.engine.busy()
    assert drafter.tracks == {}
    assert sorted(drafter.take_records()) == [("r", "stop", None), ("s", "stop", None)]
    drafter.track("r", ctx(1, 2, 3), max_lead=8)  # tracked again: it restarts
    assert drafter.engine.added[-1] == ("r#1", [1, 2, 3], 8)


# -- the client -------------------------------------------------------------------------------
@pytest.fixture
def client_and_server():
    client = ModelDrafterClient(ModelDrafterConfig(model="/m", name="m", placement="process"),
                                dtype="float32", max_model_len=64, max_num_seqs=4,
                                trust_remote_code=False, hang_timeout_s=0.2)
    conn, server = Pipe()
    client._channel = Channel(conn)
    yield client, server
    client._channel = None  # nothing to shut down: there is no process


def taken(server):
    messages = []
    while server.poll(0):
        messages.append(server.recv())
    return messages


def test_client_mirrors_the_path_and_serves_contexts_it_extends(client_and_server):
    client, server = client_and_server
    assert client.track([("r", ctx(1, 2), 4, 2)])
    (message,) = taken(server)
    assert isinstance(message, Track) and message.items[0].req_id == "r"
    assert client.is_drafting("r", ctx(1, 2))  # not acknowledged yet: a draft may come
    server.send(Update(1, [("r", "reset", ctx(1, 2)), ("r", "extend", (2, ctx(3, 4)))],
                 [(1, 0.05, time.monotonic() - 0.05)]))
    client.poll(1.0)
    assert client.draft_for("r", ctx(1, 2), 4) == [3, 4]
    assert client.draft_for("r", ctx(1, 2, 3), 4) == [4]  # one accepted token later
    assert client.draft_for("r", ctx(1, 2, 9), 4) == []  # the target went another way
    assert client.is_drafting("r", ctx(1, 2, 3)) and not client.is_drafting("r", ctx(1, 2, 9))
    server.send(Update(0, [("r", "extend", (4, ctx(5))), ("r", "stop", None)], []))
    client.poll(1.0)
    assert client.draft_for("r", ctx(1, 2, 3), 4) == [4, 5]
    assert not client.is_drafting("r", ctx(1, 2, 3))
    assert client.step_timings == [(1, 0.05)] and client.health.busy_s == pytest.approx(0.05)


def test_forget_drops_paths_and_tells_the_server(client_and_server):
    client, server = client_and_server
    client.track([("r", ctx(1), 4, 1)])
    server.send(Update(1, [("r", "reset", ctx(1)), ("r", "extend", (1, ctx(2, 3)))], []))
    client.poll(1.0)
    assert client.draft_for("r", ctx(1), 2) == [2, 3]
    client.forget(["r"])
    assert client.draft_for("r", ctx(1), 2) == []
    assert [type(m) for m in taken(server)] == [Track, Forget]


def test_pause_is_sent_once_after_tracking_and_stops_the_client_waiting(client_and_server):
    client, server = client_and_server
    client.pause()
    assert taken(server) == []  # nothing tracked: nothing to pause
    client.track([("r", ctx(1), 4, 1)])
    client.pause()
    client.pause()
    assert [type(m) for m in taken(server)] == [Track, Pause]
    # The server's answer: what it had drafted, then "stop" for the paused request.
    server.send(Update(2, [("r", "reset", ctx(1)), ("r", "extend", (1, ctx(2))),
                               ("r", "stop", None)], []))
    client.poll(1.0)
    assert not client.is_drafting("r", ctx(1))  # no wait for a paused request
    assert client.draft_for("r", ctx(1), 4) == [2]


def test_a_silent_drafter_is_skipped_then_left_out(client_and_server):
    client, _ = client_and_server
    for i in range(MAX_MESSAGES_IN_FLIGHT):
        assert client.track([(f"r{i}", ctx(1, i), 2, 2)])
    assert not client.track([("r", ctx(2), 2, 1)])  # too much unanswered: not sent
    assert client.health.steps_skipped_busy == 1 and client.health.alive
    time.sleep(0.25)  # past hang_timeout_s, with answers owed
    client.poll()
    assert not client.health.alive and "no answer" in client.health.last_error
    assert not client.track([("r", ctx(3), 2, 1)])


def test_an_idle_drafter_is_never_declared_hung(client_and_server):
    client, server = client_and_server
    client.track([("r", ctx(1), 2, 1)])
    server.send(Update(1, [("r", "reset", ctx(1)), ("r", "stop", None)], []))
    client.poll(1.0)
    time.sleep(0.25)  # silent, but it owes nothing
    client.poll()
    assert client.health.alive


def test_a_closed_connection_leaves_the_drafter_out(client_and_server):
    client, server = client_and_server
    client.track([("r", ctx(1), 2, 1)])
    server.close()
    client.poll(0.5)
    assert not client.health.alive and "connection lost" in client.health.last_error


def test_free_drafts_taken_at_the_longest_lookahead_serve_every_shorter_one():
    config = SmurfsConfig.from_user_dict({"method": "smurfs", "num_speculative_tokens": 6,
                                          "drafters": [{"method": "ngram"}]})
    worker = DrafterPool(config, dtype="float32", max_model_len=64, max_num_seqs=4)
    text = ctx(1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3)
    (free,) = worker.model_free_drafts([DraftRequest("r", text, 6)])
    assert free == [[4, 5, 6, 7, 8, 9]]
    for k in range(7):
        request = DraftRequest("r", text, k)
        assert worker.ready([request], models=False, free=[free]) == worker.ready([request])


def test_a_late_reset_for_a_forgotten_request_does_not_bring_it_back(client_and_server):
    # The server answered a track (a "reset": it starts drafting) while the request finished on
    # the client. The late reset must not leave a path that looks drafting forever: after an
    # idle gap (a quiet server) that looked like a drafter owing tokens and silent, i.e. hung.
    client, server = client_and_server
    client.track([("r", ctx(1, 2), 4, 2)])
    client.forget(["r"])
    assert [type(m) for m in taken(server)] == [Track, Forget]
    server.send(Update(1, [("r", "reset", ctx(1, 2))], []))
    server.send(Update(1, [], []))  # the forget taken: the server aborted "r"
    client.poll(1.0)
    assert client.draft_for("r", ctx(1, 2), 4) == [] and not client.is_drafting("r", ctx(1, 2))
    time.sleep(0.25)  # silent past hang_timeout_s, owing nothing
    client.poll()
    assert client.health.alive
    client.track([("r", ctx(1, 2), 4, 2)])  # the same id tracked again is served again
    server.send(Update(1, [("r", "reset", ctx(1, 2)), ("r", "extend", (2, ctx(3)))], []))
    client.poll(1.0)
    assert client.draft_for("r", ctx(1, 2), 4) == [3]


def _state(pid, expected, timeout=5.0):
    """The process's state letter, once it is in ``expected`` (a signal is delivered
    asynchronously: a loaded machine may show the old state for a moment) or at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        if state in expected or time.monotonic() > deadline:
            return state
        time.sleep(0.01)


def test_a_paused_drafter_is_stopped_until_it_drafts_again(client_and_server):
    # Pausing stops the process at once (it must not finish an engine step on a core the target
    # takes back); a stopped drafter is never declared hung; the next track lets it run.
    import subprocess

    client, server = client_and_server
    client._proc = subprocess.Popen(["sleep", "60"])
    try:
        client.track([("r", ctx(1), 4, 1)])
        client.pause()
        assert _state(client._proc.pid, "T") == "T"
        client.forget(["r"])  # a paused server has dropped it already: nothing sent
        assert [type(m) for m in taken(server)] == [Track, Pause]
        time.sleep(0.25)  # pause and track unanswered, past hang_timeout_s: stopped, not hung
        client.poll()
        assert client.health.alive
        client.resume()
        assert _state(client._proc.pid, "SR") in "SR"
        client.poll()  # the hang clock starts again when it runs
        assert client.health.alive
        # Its engine step that was under way when it was stopped timed the stop too: left out.
        now = time.monotonic()
        server.send(Update(2, [], [(1, 0.3, now - 0.3), (1, 0.02, now)]))
        client.poll(1.0)
        assert client.step_timings == [(1, 0.02)]
        client.pause()  # nothing tracked since: nothing to pause, and it keeps running
        assert _state(client._proc.pid, "SR") in "SR"
        client.track([("s", ctx(2), 4, 1)])
        client.pause()
        client.track([("s", ctx(2, 3), 4, 2)])  # tracking again lets it run
        assert _state(client._proc.pid, "SR") in "SR"
    finally:
        client._proc.kill()
        client._proc.wait()
        client._proc = None


# -- the protocol never blocks the target -----------------------------------------------------
def test_half_a_message_never_blocks_a_read(client_and_server):
    # A drafter stopped (SIGSTOP) in the middle of a send leaves half a message in the socket.
    client, server = client_and_server
    client.track([("r", ctx(1, 2), 4, 2)])
    data = frame(Update(1, [("r", "reset", ctx(1, 2)), ("r", "extend", (2, ctx(3)))], []))
    server_socket = __import__("socket").socket(fileno=__import__("os").dup(server.fileno()))
    server_socket.sendall(data[:7])
    started = time.monotonic()
    assert client.poll(0.05) is False  # nothing whole yet, and no wait past the timeout
    assert time.monotonic() - started < 1.0
    assert client.draft_for("r", ctx(1, 2), 4) == []
    server_socket.sendall(data[7:])  # it runs again: the rest arrives
    assert client.poll(1.0)
    assert client.draft_for("r", ctx(1, 2), 4) == [3]
    server_socket.close()


def test_sends_never_block_and_stop_at_the_byte_bound(client_and_server, monkeypatch):
    # A drafter that stops reading: its socket fills; no send waits, and beyond the bound the
    # messages are refused (counted as skipped), pause and forget included.
    import vllm_smurfs.drafters.process_client as mdw

    client, _server = client_and_server
    client._channel.max_pending_bytes = 1 << 18
    monkeypatch.setattr(mdw, "MAX_MESSAGES_IN_FLIGHT", 10**6)
    big = np.arange(60, dtype=np.int32)
    started = time.monotonic()
    results = [client.track([(f"r{i}", big, 2, 60)]) for i in range(20000)]
    client.forget([f"r{i}" for i in range(1000)])
    client.pause()
    assert time.monotonic() - started < 20.0  # ~ms each; a blocking send would hang here
    assert results[0] and not results[-1]
    assert client.health.steps_skipped_busy > 0 and client.health.alive
    assert client._channel.pending_bytes <= client._channel.max_pending_bytes


def test_tracks_send_what_changed_and_the_drafter_rebuilds_the_context(client_and_server):
    client, server = client_and_server
    text = np.arange(40, dtype=np.int32)
    assert client.track([("r", np.concatenate([text, ctx(7, 8)]), 4, 40)])
    (message,) = taken(server)
    ((req_id, base, tokens, lead),) = message.items
    assert (req_id, base, len(tokens), lead) == ("r", 0, 42, 4)  # first time: all of it
    drafter = PathDrafter(ScriptedEngine(), max_model_len=1000)
    drafter.track("r", drafter.context_for("r", base, tokens), lead)
    # The target accepted 7, then produced 5: the text is 42 tokens; the new chain is 6 9.
    new = np.concatenate([text, ctx(7, 5, 6, 9)])
    assert client.track([("r", new, 4, 42)])
    (message,) = taken(server)
    ((_, base, tokens, _),) = message.items
    assert base == 41 and tokens.tolist() == [5, 6, 9]  # only what differs travels
    assert drafter.context_for("r", base, tokens).tolist() == new.tolist()
    # A drafter that dropped the request cannot rebuild it: it asks for the whole context.
    drafter.forget("r")
    assert drafter.context_for("r", base, tokens) is None
    server.send(Update(2, [("r", "resync", None)], []))
    client.poll(1.0)
    assert client.track([("r", new, 4, 42)])
    (message,) = taken(server)
    assert message.items[0].base == 0 and len(message.items[0].tokens) == 44


def test_a_failed_step_resets_both_sides_and_three_in_a_row_leave_the_drafter_out(
        client_and_server, monkeypatch):
    client, server = client_and_server
    client.track([("r", ctx(1, 2), 4, 2)])
    server.send(Update(1, [("r", "reset", ctx(1, 2)), ("r", "extend", (2, ctx(3)))], []))
    client.poll(1.0)
    assert client.draft_for("r", ctx(1, 2), 4) == [3]
    # Counted at the call (the test session's logging config may hand a record to two handlers).
    import vllm_smurfs.drafters.process_client as mdw

    warned: list[str] = []
    monkeypatch.setattr(mdw.logger, "warning", lambda msg, *args: warned.append(msg % args))
    server.send(StepFailed(0, "Traceback ...\nRuntimeError: boom"))
    client.poll(1.0)
    # Known state: no path, no request it would accept a late reset for, whole contexts next.
    assert client.draft_for("r", ctx(1, 2), 4) == [] and not client.is_drafting("r", ctx(1, 2))
    server.send(Update(0, [("r", "reset", ctx(1, 2))], []))  # late: ignored
    client.poll(1.0)
    assert client.draft_for("r", ctx(1, 2), 4) == [] and client.health.alive
    client.track([("r", ctx(1, 2, 3), 4, 3)])
    assert taken(server)[-1].items[0].base == 0
    for owed in (1, 0, 0):  # three failed steps in a row (the update above broke the first run)
        server.send(StepFailed(owed, "RuntimeError: boom"))
    client.poll(1.0)
    assert not client.health.alive and "3 engine steps failed in a row" in client.health.last_error
    # One traceback in the log for the repeated failure, then the line that leaves it out.
    assert len([w for w in warned if "failed a step" in w]) == 1


def test_a_path_is_compared_with_the_text_only_where_it_grew():
    from vllm_smurfs.drafters.process_client import _Path

    path = _Path(np.arange(10, dtype=np.int32), drafting=True)
    for token in range(10, 1000):
        path.append(np.array([token], dtype=np.int32))
    text = np.arange(900, dtype=np.int32)
    assert path.extends(text) and path.agreed == 900
    assert path.extends(np.arange(950, dtype=np.int32)) and path.agreed == 950
    wrong = np.arange(960, dtype=np.int32)
    wrong[955] = -1
    assert not path.extends(wrong) and path.agreed == 950
    assert path.tokens.tolist() == list(range(1000)) and len(path._buffer) < 4000
