"""Which paused drafters are stopped (SIGSTOP): only those that compute on CPU cores the target's
threads use. A drafter on a GPU, or on cores of its own, keeps running (it idles once it has
taken the pause)."""

import subprocess
import time
from multiprocessing import Pipe

import numpy as np
import pytest

from vllm_smurfs.config import ModelDrafterConfig
from vllm_smurfs.drafters.channel import Channel
from vllm_smurfs.drafters.process_client import ModelDrafterClient, stops_when_paused
from vllm_smurfs.drafters.protocol import Pause, Track


def test_only_cpu_drafters_on_the_targets_cores_are_stopped():
    assert stops_when_paused({"device": "cpu", "cpus": [1]}, [0, 1])  # shares core 1
    assert stops_when_paused({"device": "cpu", "cpus": [1]}, None)  # the target floats
    assert not stops_when_paused({"device": "cpu", "cpus": [2, 3]}, [0, 1])  # cores of its own
    assert not stops_when_paused({"device": "cuda", "cpus": [0]}, [0, 1])  # on a GPU
    assert not stops_when_paused({"device": "cuda", "cpus": [0]}, None)
    assert stops_when_paused({"cpus": [0]}, [0])  # a drafter from before "device" was sent


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _wait_state(pid: int, expected: str, timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    while _state(pid) not in expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return _state(pid)


@pytest.mark.parametrize("info, stopped", [
    ({"device": "cpu", "cpus": [0]}, True),
    ({"device": "cuda", "cpus": [0]}, False),
])
def test_a_paused_gpu_drafter_process_keeps_running(info, stopped, monkeypatch):
    # The target's threads on every core this machine has: a CPU drafter shares one of them.
    monkeypatch.setattr("vllm_smurfs.drafters.process_client.target_cores", lambda: [0, 1])
    client = ModelDrafterClient(ModelDrafterConfig(model="/m", name="m", placement="process"),
                                dtype="float32", max_model_len=64, max_num_seqs=4,
                                trust_remote_code=False, hang_timeout_s=5.0)
    conn, server = Pipe()
    client._channel = Channel(conn)
    client._proc = subprocess.Popen(["sleep", "60"])
    try:
        client._took_ready({"pid": client._proc.pid, **info})
        client.track([("r", np.array([1, 2], dtype=np.int32), 4, 2)])
        client.pause()
        # The pause is sent either way: the drafter stops drafting for every request.
        assert [type(server.recv()), type(server.recv())] == [Track, Pause]
        if stopped:
            assert _wait_state(client._proc.pid, "T") == "T"
        else:
            time.sleep(0.2)  # a signal would have arrived by now
            assert _state(client._proc.pid) in "SR"
        client.resume()
        assert _wait_state(client._proc.pid, "SR") in "SR"
    finally:
        client._channel = None
        client._proc.kill()
        client._proc.wait()
        client._proc = None
