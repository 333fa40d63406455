"""Which Ray cluster the drafters join and how, without a cluster: the address named, a loopback
address kept on loopback, the token mode following the cluster's, errors that name the address,
and what an actor that cannot be placed is told. (Real clusters: tests/e2e/test_ray_cluster.py.)"""

import os

import pytest

pytest.importorskip("ray", reason="the 'ray' extra is not installed")

from ray._private import ray_constants, services  # noqa: E402

from vllm_smurfs.drafters import ray_cluster  # noqa: E402
from vllm_smurfs.drafters.ray_cluster import (  # noqa: E402
    ProbeAnswer,
    named_cluster,
    placement_problem,
    requested_resources,
)

OUTWARD = "10.11.12.13"  # what Ray takes for this machine's address, in these tests


@pytest.fixture
def outward_address(monkeypatch):
    """This machine's outward address as Ray finds it (a UDP socket 'connected' outwards)."""
    monkeypatch.setattr(services, "node_ip_address_from_perspective", lambda *a: OUTWARD)
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)


@pytest.fixture(autouse=True)
def restored_environment():
    """Whatever a test changes in the environment for Ray is put back (as `disconnect` does)."""
    before = dict(os.environ)
    yield
    ray_cluster._restore_env()
    os.environ.clear()
    os.environ.update(before)


def test_the_cluster_named_is_the_config_key_then_ray_address_then_none():
    assert named_cluster("10.0.0.5:6379", {"RAY_ADDRESS": "127.0.0.1:6390"}) == (
        "10.0.0.5:6379", "speculative_config.ray_address")
    assert named_cluster(None, {"RAY_ADDRESS": "127.0.0.1:6390"}) == (
        "127.0.0.1:6390", "RAY_ADDRESS")
    assert named_cluster(None, {"RAY_ADDRESS": ""}) is None
    assert named_cluster(None, {}) is None


def test_a_loopback_address_stays_loopback(outward_address):
    # Ray's own treatment of 127.0.0.1: the machine's outward address, where a head started with
    # --node-ip-address 127.0.0.1 does not listen (and traffic leaves the loopback interface).
    assert services.canonicalize_bootstrap_address("127.0.0.1:6390") == f"{OUTWARD}:6390"
    with ray_cluster._loopback_kept("127.0.0.1"):
        assert services.canonicalize_bootstrap_address("127.0.0.1:6390") == "127.0.0.1:6390"
        assert services.canonicalize_bootstrap_address("localhost:6390") == "127.0.0.1:6390"
    assert ray_constants.ENABLE_RAY_CLUSTER  # put back
    with ray_cluster._loopback_kept("10.0.0.5"):  # any other address: untouched
        assert ray_constants.ENABLE_RAY_CLUSTER


class FakeRay:
    """Records the address `ray.init` would connect to, as Ray resolves it at that moment."""

    def __init__(self):
        self.connected_to = None
        self.init_kwargs = None

    def init(self, address=None, **kwargs):
        self.init_kwargs = {"address": address, **kwargs}
        self.connected_to = services.canonicalize_bootstrap_address(address)


def _fake_cluster(monkeypatch, answers, token=None, local_nodes=("n1",)):
    """Probes answer ``answers`` in turn (ProbeAnswer codes); ``token``: the user's token."""
    calls = []

    def probe(address, token_sent, timeout_s=None):
        calls.append((address, token_sent))
        code = answers[min(len(calls), len(answers)) - 1]
        return ProbeAnswer(code, "UNAVAILABLE: refused" if code == "unreachable" else "",
                           node_ids={"n1"} if code == "ok" else set())

    monkeypatch.setattr(ray_cluster, "probe", probe)
    monkeypatch.setattr(ray_cluster, "user_token", lambda: token)
    monkeypatch.setattr(services, "find_node_ids", lambda: list(local_nodes))
    return calls


def test_joining_a_loopback_address_connects_on_loopback(outward_address, monkeypatch):
    calls = _fake_cluster(monkeypatch, ["ok"])
    ray = FakeRay()
    ray_cluster._join(ray, "127.0.0.1:6390", "RAY_ADDRESS")
    assert ray.connected_to == "127.0.0.1:6390"  # not rewritten to the outward address
    assert ray.init_kwargs["address"] == "127.0.0.1:6390"
    assert calls == [("127.0.0.1:6390", None), ("127.0.0.1:6390", None)]
    assert os.environ["RAY_AUTH_MODE"] == "disabled"  # as the cluster: it took no token


def test_a_cluster_with_token_authentication_is_joined_with_the_users_token(monkeypatch):
    calls = _fake_cluster(monkeypatch, ["unauthenticated", "ok"], token="secret")
    ray = FakeRay()
    ray_cluster._join(ray, "127.0.0.1:6390", "RAY_ADDRESS")
    assert calls == [("127.0.0.1:6390", None), ("127.0.0.1:6390", "secret"),
                     ("127.0.0.1:6390", "secret")]
    assert os.environ["RAY_AUTH_MODE"] == "token"
    ray_cluster._restore_env()
    assert "RAY_AUTH_MODE" not in os.environ  # put back when the drafters disconnect


@pytest.mark.parametrize("answers, token, message", [
    (["unreachable"], None, r"Nothing answers at the Ray cluster at 127\.0\.0\.1:6390 "
                            r"\(RAY_ADDRESS=127\.0\.0\.1:6390\) \(UNAVAILABLE"),
    (["unauthenticated"], None, r"127\.0\.0\.1:6390 .* asks for a token .* none was found: "
                                r"give it in RAY_AUTH_TOKEN"),
    (["unauthenticated", "unauthenticated"], "stale", r"127\.0\.0\.1:6390 .* refused the token"),
])
def test_a_cluster_that_cannot_be_joined_is_an_error_naming_it(monkeypatch, answers, token,
                                                                message):
    _fake_cluster(monkeypatch, answers, token=token)
    ray = FakeRay()
    with pytest.raises(RuntimeError, match=message):
        ray_cluster._join(ray, "127.0.0.1:6390", "RAY_ADDRESS")
    assert ray.init_kwargs is None  # Ray was not asked to connect (and retry for minutes)


def test_a_machine_without_a_node_of_the_cluster_is_told_to_start_one(monkeypatch):
    _fake_cluster(monkeypatch, ["ok"], local_nodes=["another-clusters-node"])
    with pytest.raises(RuntimeError, match=r"This machine runs no node of the Ray cluster at "
                       r"10\.0\.0\.5:6379 \(speculative_config\.ray_address=10\.0\.0\.5:6379\)"
                       r".*ray start --address 10\.0\.0\.5:6379"):
        ray_cluster._join(FakeRay(), "10.0.0.5:6379", "speculative_config.ray_address")


def test_ray_client_addresses_are_refused():
    with pytest.raises(RuntimeError, match=r"RAY_ADDRESS=ray://head:10001: .*not supported"):
        ray_cluster._join(FakeRay(), "ray://head:10001", "RAY_ADDRESS")


def test_without_a_named_cluster_a_private_one_is_started_never_one_found(monkeypatch, tmp_path):
    # Ray's default, ray.init() without an address, joins the last cluster started on this
    # machine (another engine's private one, say): the private cluster is asked for by name.
    monkeypatch.setenv("HOME", str(tmp_path))
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(key, raising=False)
    ray = FakeRay()
    ray_cluster._start_private(ray)
    assert ray.init_kwargs["address"] == "local" and ray.connected_to is None
    assert ray.init_kwargs["_node_ip_address"] == "127.0.0.1"
    # Token authentication stays on, with a token no file holds: nothing in the home folder.
    assert os.environ["RAY_AUTH_MODE"] == "token" and len(os.environ["RAY_AUTH_TOKEN"]) == 64
    assert not (tmp_path / ".ray").exists()
    ray_cluster._restore_env()
    assert "RAY_AUTH_TOKEN" not in os.environ and "RAY_AUTH_MODE" not in os.environ


def test_what_an_actor_asks_for_and_whether_a_node_has_it():
    asks = requested_resources({"num_cpus": 0, "num_gpus": 0.1, "memory": 0,
                                "resources": {"drafter_node": 1}})
    assert asks == {"GPU": 0.1, "drafter_node": 1.0}
    head = {"Alive": True, "NodeManagerAddress": "127.0.0.1", "Resources": {"CPU": 2.0}}
    worker = {"Alive": True, "NodeManagerAddress": "127.0.0.2",
              "Resources": {"CPU": 2.0, "GPU": 1.0, "drafter_node": 1.0}}
    assert placement_problem(asks, [head, worker]) is None
    dead = {**worker, "Alive": False}
    assert placement_problem(asks, [head, dead]) == (
        "no alive node of the cluster has them (nodes: 127.0.0.1: "
        "{'GPU': 0.0, 'drafter_node': 0.0})")
    assert placement_problem({}, [head]) is None
