"""ModelDrafterClient's protocol logic against a scripted server end of a pipe (no process)."""

import time
from multiprocessing import Pipe

import numpy as np
import pytest

from vllm_smurfs.config import ModelDrafterConfig
from vllm_smurfs.multi_draft_worker import MAX_MESSAGES_IN_FLIGHT, ModelDrafterClient


@pytest.fixture
def client_and_server():
    client = ModelDrafterClient(ModelDrafterConfig(model="/m", name="m"), dtype="float32",
                                max_model_len=64, max_num_seqs=4, trust_remote_code=False,
                                hang_timeout_s=0.2)
    client._conn, server = Pipe()
    yield client, server
    client._conn = None  # nothing to shut down: there is no process


def ctx(*tokens):
    return np.array(tokens, dtype=np.int32)


def answer(server, drafts):
    """Answer every job the server has received with drafts[req_id]."""
    taken, jobs = 0, []
    while server.poll(0):
        message = server.recv()
        taken += 1
        if message[0] == "draft":
            jobs.extend(message[1])
    server.send(("drafts", taken, [(job_id, drafts[req]) for job_id, req, _, _ in jobs]))
    return jobs


def test_paths_serve_every_context_they_extend(client_and_server):
    client, server = client_and_server
    (job,) = client.submit([("r", ctx(1, 2), 3)])
    jobs = answer(server, {"r": [5, 6, 7]})
    assert [(j[1], j[2], j[3]) for j in jobs] == [("r", [1, 2], 3)]
    assert client.wait_for([job], time.monotonic() + 1)
    assert client.draft_for("r", ctx(1, 2), 2) == [5, 6]
    assert client.draft_for("r", ctx(1, 2, 5), 4) == [6, 7]  # one accepted token later
    assert client.draft_for("r", ctx(1, 2, 5, 6, 7), 2) is None  # path used up
    assert client.draft_for("r", ctx(1, 2, 9), 2) is None  # the target went another way
    assert client.draft_for("other", ctx(1, 2), 2) is None


def test_older_paths_serve_branches_and_superseded_jobs_are_ignored(client_and_server):
    client, server = client_and_server
    client.submit([("r", ctx(1), 2)])
    answer(server, {"r": [8, 9]})
    client.poll()
    client.submit([("r", ctx(1, 7), 3)])  # drafted ahead past another drafter's chain [7]
    answer(server, {"r": [4, 4, 4]})
    client.poll()
    assert client.draft_for("r", ctx(1, 7), 3) == [4, 4, 4]
    # The target rejected 7 and produced 8: this drafter's own, older path serves that branch.
    assert client.draft_for("r", ctx(1, 8), 3) == [9]
    first = client.submit([("q", ctx(3), 2)])
    second = client.submit([("q", ctx(3, 3), 2)])  # supersedes the first job
    server.send(("drafts", 0, [(first[0], [7, 7])]))  # a stale answer to the first
    client.poll()
    assert client.draft_for("q", ctx(3), 2) is None
    answer(server, {"q": [6, 6]})
    assert client.wait_for(second, time.monotonic() + 1)
    assert client.draft_for("q", ctx(3, 3), 2) == [6, 6]


def test_forget_drops_paths_and_tells_the_server(client_and_server):
    client, server = client_and_server
    client.submit([("r", ctx(1), 2)])
    answer(server, {"r": [2, 3]})
    client.poll()
    client.forget(["r"])
    assert client.draft_for("r", ctx(1), 2) is None
    assert server.recv() == ("forget", ["r"])


def test_a_silent_drafter_is_skipped_then_left_out(client_and_server):
    client, server = client_and_server
    sent = [client.submit([(f"r{i}", ctx(1, i), 2)]) for i in range(MAX_MESSAGES_IN_FLIGHT)]
    assert all(sent)
    assert client.submit([("r", ctx(2), 2)]) == []  # too much unanswered: not asked
    assert client.health.steps_skipped_busy == 1 and client.health.alive
    assert not client.wait_for(sent[0], time.monotonic() + 0.3)  # past hang_timeout_s
    assert not client.health.alive and "no answer" in client.health.last_error
    assert client.submit([("r", ctx(3), 2)]) == []


def test_a_closed_connection_leaves_the_drafter_out(client_and_server):
    client, server = client_and_server
    jobs = client.submit([("r", ctx(1), 2)])
    server.close()
    assert not client.wait_for(jobs, time.monotonic() + 1)
    assert not client.health.alive and "connection lost" in client.health.last_error
