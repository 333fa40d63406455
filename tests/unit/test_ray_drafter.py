"""The Ray actor's message handling, without Ray: pushes taken in their order whatever order the
calls run in, and the stream yielding what the server sent, in order, as it comes."""

import asyncio

from vllm_smurfs.drafters.ray_actor import RayDrafterActor, _QueueConnection


def _actor() -> RayDrafterActor:
    actor = RayDrafterActor()
    actor._conn = _QueueConnection(asyncio.get_running_loop(), actor._ready)
    return actor


def test_pushes_run_out_of_order_are_taken_in_order():
    async def scenario() -> list[str]:
        actor = _actor()
        for seq in (2, 0, 3, 1, 5):  # as an async actor may run the calls
            await actor.push(seq, f"m{seq}")
        assert actor._conn is not None
        taken = []
        while not actor._conn.inbox.empty():
            taken.append(actor._conn.inbox.get())
        assert actor._early == {5: "m5"}  # waits for message 4
        await actor.push(4, "m4")
        while not actor._conn.inbox.empty():
            taken.append(actor._conn.inbox.get())
        return taken

    assert asyncio.run(scenario()) == ["m0", "m1", "m2", "m3", "m4", "m5"]


def test_the_stream_yields_the_servers_messages_in_order_as_they_come():
    async def scenario() -> list[list[str]]:
        actor = _actor()
        assert actor._conn is not None
        conn = actor._conn
        stream = actor.stream()
        conn.send("a")
        conn.send("b")
        batches = [await stream.__anext__()]  # what was there: one batch
        waiting = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.01)
        assert not waiting.done()  # nothing to send: the stream waits
        # The server's thread sends; the stream wakes.
        await asyncio.to_thread(conn.send, "c")
        batches.append(await asyncio.wait_for(waiting, 1.0))
        return batches

    assert asyncio.run(scenario()) == [["a", "b"], ["c"]]


# -- the actor's options and its placement ------------------------------------------------------
import sys  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

from vllm_smurfs.config import ModelDrafterConfig  # noqa: E402
from vllm_smurfs.drafters.protocol import Ready  # noqa: E402
from vllm_smurfs.drafters.ray_actor import RayDrafterClient, actor_options  # noqa: E402


def test_on_cpu_the_actor_asks_for_no_device():
    options = actor_options({"resources": {"drafter_node": 1}}, 2, "", 0.1, {})
    assert "num_gpus" not in options and options["resources"] == {"drafter_node": 1}
    assert options["num_cpus"] == 0 and options["scheduling_strategy"] == "DEFAULT"
    assert options["runtime_env"]["env_vars"]["OMP_NUM_THREADS"] == "2"


def test_on_a_gpu_target_a_drafter_naming_no_device_gets_a_share_of_one():
    assert actor_options(None, 1, "GPU", 0.15, {})["num_gpus"] == 0.15
    assert actor_options({"num_gpus": 1}, 1, "GPU", 0.15, {})["num_gpus"] == 1  # as given
    # Another device (vLLM names it by a Ray resource): the share goes there.
    assert actor_options(None, 1, "TPU", 0.2, {})["resources"] == {"TPU": 0.2}
    assert actor_options({"resources": {"TPU": 1}}, 1, "TPU", 0.2, {})["resources"] == {"TPU": 1}
    with pytest.raises(ValueError, match=r"'ssm': ray_options num_gpus is 0, but the target "
                       r"runs on a GPU.*Set num_gpus to the share of a GPU"):
        actor_options({"num_gpus": 0}, 1, "GPU", 0.1, {}, "ssm")


def test_the_actor_sees_the_device_ray_gives_it_and_keeps_the_users_runtime_env():
    # A worker of vLLM's Ray executor runs with Ray told not to set its visible devices; an
    # actor it makes inherits that unless told otherwise.
    options = actor_options(
        {"runtime_env": {"env_vars": {"MINE": "1"}, "pip": ["x"]},
         "scheduling_strategy": "SPREAD"},
        1, "GPU", 0.1, {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "HOME": "/h"})
    env = options["runtime_env"]
    assert env["pip"] == ["x"] and env["env_vars"]["MINE"] == "1"
    assert env["env_vars"]["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] == "0"
    assert "HOME" not in env["env_vars"]
    assert options["scheduling_strategy"] == "SPREAD"


class _Ref:
    def __init__(self, value=None, ready=lambda: False):
        self.value, self._ready = value, ready

    @property
    def ready(self):
        return self._ready()


class FakeRay:
    """The Ray calls a RayDrafterClient makes; the cluster places the actor when ``placed``."""

    def __init__(self, nodes, placed=False):
        self._nodes, self.placed = nodes, placed
        self.options = None
        self.waits = []
        self.exceptions = SimpleNamespace(RayError=RuntimeError)
        fake = self

        class Actor:
            def __init__(self):
                self.node_id = SimpleNamespace(remote=lambda: _Ref("node-b", lambda: fake.placed))
                self.start = SimpleNamespace(remote=lambda spec, fault: _Ref(
                    Ready({"pid": 1, "node_id": "node-b", "node_ip": "10.0.0.2", "cpus": [0],
                           "load_s": 1.0, "device": "cpu"}), lambda: fake.placed))
                self.stream = SimpleNamespace(remote=lambda: _Ref())
                self.stop = SimpleNamespace(remote=lambda: _Ref())

        self.actor_class = SimpleNamespace(
            options=lambda **opts: (setattr(self, "options", opts)
                                    or SimpleNamespace(remote=Actor)))

    def remote(self, cls):
        return self.actor_class

    def nodes(self):
        return self._nodes

    def wait(self, refs, timeout=None, num_returns=1):
        self.waits.append(timeout)
        ready = [r for r in refs if r.ready]
        if not ready and timeout:
            time.sleep(min(timeout, 2.0))  # (a wait of minutes would be a failure anyway)
        return ready, [r for r in refs if not r.ready]

    def get(self, ref, timeout=None):
        return ref.value

    def kill(self, actor):
        pass

    def get_runtime_context(self):
        return SimpleNamespace(get_node_id=lambda: "node-a")


HEAD = {"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 2.0}}


def _platform(monkeypatch, ray_device_key: str, device_type: str) -> None:
    """vLLM's platform as the client reads it (`vllm.platforms.current_platform`), mocked."""
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = SimpleNamespace(ray_device_key=ray_device_key,
                                                 device_type=device_type)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)


def _client(ray, monkeypatch, ray_options, hang_timeout_s=30.0):
    if "vllm.platforms" not in sys.modules or not isinstance(
            getattr(sys.modules["vllm.platforms"], "current_platform", None), SimpleNamespace):
        _platform(monkeypatch, "", "cpu")  # vLLM-CPU's
    monkeypatch.setattr("vllm_smurfs.drafters.ray_actor.connect", lambda cpus, address: ray)
    monkeypatch.setattr("vllm_smurfs.drafters.process_client.target_cores", lambda: None)
    client = RayDrafterClient(
        ModelDrafterConfig(model="/m", name="ssm", placement="ray", ray_options=ray_options),
        "float32", 64, 4, False, hang_timeout_s=hang_timeout_s, cpus=[0])
    client.start()
    return client


def test_a_gpu_target_gives_the_actor_a_gpu_share(monkeypatch):
    _platform(monkeypatch, "GPU", "cuda")  # a CUDA build's (vllm.platforms.cuda)
    ray = FakeRay([HEAD])
    _client(ray, monkeypatch, None)
    assert ray.options["num_gpus"] == 0.1  # gpu_memory_utilization's default
    with pytest.raises(ValueError, match="num_gpus is 0"):
        _client(FakeRay([HEAD]), monkeypatch, {"num_gpus": 0})


def test_an_actor_no_node_has_room_for_is_reported_at_once_and_joins_when_placed(monkeypatch):
    ray = FakeRay([HEAD])
    client = _client(ray, monkeypatch, {"resources": {"drafter_node": 1}})
    started = time.monotonic()
    client.wait_ready(600)
    assert time.monotonic() - started < 1.0  # not the engine's 600 s, nor draft_timeout_s
    assert not client.alive and client._starting is not None  # pending, not killed
    assert client.health.last_error == (
        "its Ray actor is not placed: it asks for {'drafter_node': 1.0}; no alive node of the "
        "cluster has them (nodes: 10.0.0.1: {'drafter_node': 0.0})")
    # A node with room joins (an autoscaler, a raylet started later): the drafter joins too.
    ray.placed = True
    client.poll()
    assert client.alive and client.health.extra["node_ip"] == "10.0.0.2"


def test_an_actor_the_busy_cluster_does_not_place_is_reported_after_draft_timeout(monkeypatch):
    ray = FakeRay([{**HEAD, "Resources": {"CPU": 2.0, "drafter_node": 1.0}}])
    client = _client(ray, monkeypatch, {"resources": {"drafter_node": 1}}, hang_timeout_s=0.3)
    client.wait_ready(600)
    assert ray.waits[0] == 0.3  # the placement waited draft_timeout_s, not 600 s
    assert not client.alive
    assert "asks for {'drafter_node': 1.0}; none placed it within 0.3 s" in (
        client.health.last_error)


def test_a_replacement_the_cluster_does_not_place_is_reported_after_draft_timeout(monkeypatch):
    ray = FakeRay([{**HEAD, "Resources": {"CPU": 2.0, "drafter_node": 1.0}}], placed=True)
    client = _client(ray, monkeypatch, {"resources": {"drafter_node": 1}}, hang_timeout_s=0.3)
    client.wait_ready(600)
    assert client.alive
    ray.placed = False  # its node goes away: the replacement finds no room
    client._fail("connection lost")
    assert client.replacements == 1 and not client.alive
    client.poll()
    assert client.health.last_error == "connection lost"  # not reported yet: just launched
    time.sleep(0.35)
    client.poll()
    assert "its Ray actor is not placed: it asks for {'drafter_node': 1.0}; none placed it " \
           "within 0.3 s" in client.health.last_error
