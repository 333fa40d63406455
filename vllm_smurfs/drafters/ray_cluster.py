"""The Ray cluster that Ray drafters (``"placement": "ray"``) run on: exactly the one the user
names, or a private one.

Which cluster (`connect`), first that applies:

1. this process is connected already (a worker of vLLM's Ray executor): that cluster;
2. ``speculative_config.ray_address``, else ``RAY_ADDRESS``: that cluster, joined and left
   running when the engine goes (``"auto"`` lets Ray find the one on this machine);
3. neither: a private cluster on 127.0.0.1, started here and stopped with the last Ray drafter.

Never "whatever runs on this machine" unless the user says ``auto``: Ray's own default
(``ray.init()`` without an address) joins the last cluster started here, which may be another
engine's private one.

A named cluster is checked before Ray is asked to join it (`probe`: one call to its GCS, no
retries), because Ray's own connect retries for about 20 s on an address that does not answer
and on a refused token, then fails with a message that names neither cause:

- nothing answers: an error at once, naming the address and where it came from;
- token authentication (``RAY_AUTH_MODE=token`` on the cluster): Ray joins a named address without
  a token unless told to, and is refused; this process takes the user's token (``RAY_AUTH_TOKEN``,
  ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``) and turns token mode on. A cluster without
  authentication is joined with it off: a driver in token mode connects to such a cluster, but
  its actors then never run (seen with Ray 2.60), so the mode follows the cluster's;
- a loopback address (a head started with ``--node-ip-address 127.0.0.1`` listens there only)
  stays loopback: Ray rewrites ``127.0.0.1`` to the machine's outward address before connecting
  (`ray._private.services.resolve_ip_for_localhost`), where nothing listens, and retries for
  minutes, sending traffic off the loopback interface meanwhile;
- a machine that runs no node of the cluster: Ray joins through a node on its own machine, and
  would wait a minute for one.

The private cluster keeps Ray's token authentication, with a token that lives in this process's
environment only: Ray 2.60 would otherwise write one to ``~/.ray/auth_token``, after which every
``ray start`` on the machine turns authentication on.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import secrets
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

RAY_NAMESPACE = "vllm-smurfs"
#: Longest wait for the named cluster's GCS to answer one call.
PROBE_TIMEOUT_S = 5.0
_AUTH_MODE = "RAY_AUTH_MODE"
_AUTH_TOKEN = "RAY_AUTH_TOKEN"
_ENABLE_CLUSTERS = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_TOKEN_PLACES = ("RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token (`ray get-auth-token` "
                 "on the cluster's head prints it)")


class _Connection:
    """This process's connection for the drafters: how many Ray drafters use it, whether it was
    made here (then the last drafter disconnects, stopping a private cluster), and the
    environment variables changed for it (restored then)."""

    lock = threading.Lock()
    users = 0
    ours = False
    saved_env: dict[str, str | None] = {}
    saved_cluster_flag: bool | None = None  # Ray's ENABLE_RAY_CLUSTER before it was changed


def connect(cpus: Sequence[int] | None = None, ray_address: str | None = None) -> Any:
    """The `ray` module, connected (see the module's docstring for which cluster).
    ``ray_address``: the ``ray_address`` key of the configuration. ``cpus``: the cores Ray's
    processes and threads started here go on (the drafters' cores, off the target's); default:
    every core this process may use."""
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError(
            "speculative_config.drafters[].placement 'ray' needs Ray: install the extra, "
            "pip install -e '.[cpu,ray]' (or '.[gpu,ray]')") from exc
    with _Connection.lock:
        if ray.is_initialized():
            _Connection.users += 1
            logger.info("Smurfs: Ray drafters use the Ray cluster this process is connected to "
                        "(GCS %s)", ray.get_runtime_context().gcs_address)
            return ray
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        named = named_cluster(ray_address, os.environ)
        with _on_cores(cpus):
            try:
                if named is None:
                    _start_private(ray)
                else:
                    _join(ray, *named)
            except BaseException:
                _restore_env()
                raise
        _Connection.users += 1
        _Connection.ours = True
        return ray


def disconnect() -> None:
    """One Ray drafter less; the last one disconnects (stopping the cluster started here)."""
    with _Connection.lock:
        _Connection.users = max(0, _Connection.users - 1)
        if _Connection.users or not _Connection.ours:
            return
        _Connection.ours = False
        import ray

        if ray.is_initialized():
            ray.shutdown()
        _restore_env()


def named_cluster(ray_address: str | None, environ: Mapping[str, str]
                  ) -> tuple[str, str] | None:
    """(address, where it was named) of the cluster the user names, or None for none."""
    if ray_address:
        return ray_address, "speculative_config.ray_address"
    if environ.get("RAY_ADDRESS"):
        return environ["RAY_ADDRESS"], "RAY_ADDRESS"
    return None


# -- a named cluster -----------------------------------------------------------------------------
@dataclass
class ProbeAnswer:
    """What the cluster's GCS said: ``code`` is "ok", "unauthenticated" or "unreachable"."""

    code: str
    details: str = ""
    node_ids: set[str] = field(default_factory=set)  # alive nodes, hex


def probe(address: str, token: str | None, timeout_s: float = PROBE_TIMEOUT_S) -> ProbeAnswer:
    """One call to the GCS at ``address`` (its cluster id, then its alive nodes), with ``token``
    or without; no retries, at most ``timeout_s`` per call."""
    import grpc
    from ray.core.generated import gcs_pb2, gcs_service_pb2, gcs_service_pb2_grpc

    metadata = [("authorization", f"Bearer {token}")] if token else None
    channel = _grpc_channel(grpc, address)
    try:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s,
                          metadata=metadata)
        reply = stub.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(), timeout=timeout_s,
                                    metadata=metadata)
    except grpc.RpcError as exc:
        code = exc.code()  # type: ignore[attr-defined]
        details = f"{code.name}: {exc.details()}"  # type: ignore[attr-defined]
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return ProbeAnswer("unauthenticated", details)
        return ProbeAnswer("unreachable", details)
    finally:
        channel.close()
    alive = gcs_pb2.GcsNodeInfo.GcsNodeState.ALIVE
    return ProbeAnswer("ok", node_ids={n.node_id.hex() for n in reply.node_info_list
                                       if n.state == alive})


def _grpc_channel(grpc: Any, address: str) -> Any:
    """A channel as Ray's own clients make one (TLS when ``RAY_USE_TLS`` says so), without Ray's
    token interceptor: the probe chooses what it sends."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        from ray._private.tls_utils import load_certs_from_env

        chain, key, ca = load_certs_from_env()
        credentials = grpc.ssl_channel_credentials(certificate_chain=chain, private_key=key,
                                                   root_certificates=ca)
        return grpc.secure_channel(address, credentials)
    return grpc.insecure_channel(address)


def _join(ray: Any, named: str, source: str) -> None:
    """Join the cluster at ``named`` (from ``source``), or raise an error naming both."""
    from ray._private import services

    if "://" in named:
        raise RuntimeError(
            f"{source}={named}: Ray drafters join a cluster as a driver on one of its nodes "
            "(host:port of the head's GCS, as `ray start --head` prints it); Ray Client "
            "addresses (ray://) are not supported")
    address = named
    if named == "auto":  # the user asked Ray to find the cluster on this machine
        try:
            address = services.canonicalize_bootstrap_address_or_die("auto")
        except ConnectionError as exc:
            raise RuntimeError(f"{source}=auto: {exc}") from None
    where = f"the Ray cluster at {address} ({source}={named})"
    host = _host(address)
    with _loopback_kept(host):
        token = _match_authentication(address, where)
        answer = probe(address, token)
    if answer.code != "ok":  # it answered a moment ago
        raise RuntimeError(f"{where} stopped answering: {answer.details}")
    local = set(services.find_node_ids())
    if not answer.node_ids & local:
        raise RuntimeError(
            f"This machine runs no node of {where}: a process joins a Ray cluster through a "
            f"node on its own machine. Start one here first: ray start --address {address}")
    with _loopback_kept(host):
        try:
            ray.init(address=address, namespace=RAY_NAMESPACE, log_to_driver=True,
                     configure_logging=False)
        except Exception as exc:  # noqa: BLE001 - Ray raises several kinds here
            raise RuntimeError(f"Could not join {where}: {type(exc).__name__}: {exc}") from exc
    logger.info("Smurfs: Ray drafters use %s%s", where,
                " with token authentication" if token else "")


def _match_authentication(address: str, where: str) -> str | None:
    """Put this process in the cluster's authentication mode; the token when it has one."""
    answer = probe(address, None)
    if answer.code == "unreachable":
        raise RuntimeError(
            f"Nothing answers at {where} ({answer.details}). Start the cluster "
            "(ray start --head --port PORT), correct the address, or unset it: without one, "
            "Smurfs starts a private cluster on 127.0.0.1 for the drafters.")
    if answer.code == "ok":
        _set_env(_AUTH_MODE, "disabled")  # it has none: a driver in token mode would fail
        return None
    token = user_token()
    if not token:
        raise RuntimeError(f"{where} asks for a token (token authentication) and none was "
                           f"found: give it in {_TOKEN_PLACES}")
    if probe(address, token).code == "unauthenticated":
        raise RuntimeError(f"{where} refused the token found in {_TOKEN_PLACES}")
    _set_env(_AUTH_MODE, "token")
    return token


def user_token() -> str | None:
    """The user's Ray token, wherever Ray looks for it (None when there is none)."""
    from ray._raylet import AuthenticationTokenLoader

    loader = AuthenticationTokenLoader.instance()
    loader.reset_cache()
    if not loader.has_token(ignore_auth_mode=True):
        return None
    return loader.get_raw_token(ignore_auth_mode=True) or None


def _host(address: str) -> str:
    host, sep, _port = address.rpartition(":")
    if not sep:
        raise RuntimeError(f"Ray address {address!r}: expected host:port")
    return host.strip("[]")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextlib.contextmanager
def _loopback_kept(host: str) -> Iterator[None]:
    """Within the block, Ray leaves a loopback address as it is: with multi-node clusters off,
    `resolve_ip_for_localhost` keeps it (the setting is named for Windows and macOS; it applies
    on Linux too). Other addresses are not touched."""
    if not is_loopback(host):
        yield
        return
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


# -- placing an actor ----------------------------------------------------------------------------
def requested_resources(options: Mapping[str, Any]) -> dict[str, float]:
    """The resources an actor made with ``options`` (`ray.remote(...).options`) asks for."""
    asks: dict[str, float] = {}
    for option, resource in (("num_cpus", "CPU"), ("num_gpus", "GPU"), ("memory", "memory")):
        if options.get(option):
            asks[resource] = float(options[option])
    for resource, amount in (options.get("resources") or {}).items():
        if amount:
            asks[resource] = float(amount)
    if options.get("accelerator_type"):
        asks[f"accelerator_type:{options['accelerator_type']}"] = 0.001
    return asks


def placement_problem(asks: Mapping[str, float], nodes: Sequence[Mapping[str, Any]]
                      ) -> str | None:
    """Why no node can ever hold an actor that asks for ``asks``, or None when one can.
    ``nodes``: as `ray.nodes()` lists them (``Alive``, ``NodeManagerAddress``, ``Resources``:
    the node's totals)."""
    alive = [n for n in nodes if n.get("Alive")]
    for node in alive:
        totals = node.get("Resources") or {}
        if all(totals.get(k, 0.0) >= v for k, v in asks.items()):
            return None
    have = "; ".join(f"{n.get('NodeManagerAddress')}: "
                     f"{ {k: (n.get('Resources') or {}).get(k, 0.0) for k in asks} }"
                     for n in alive)
    return f"no alive node of the cluster has them (nodes: {have or 'none'})"


# -- the private cluster -------------------------------------------------------------------------
def _start_private(ray: Any) -> None:
    """A cluster of this process's own on 127.0.0.1 (dashboard and usage reporting off)."""
    # Ray's processes bind loopback only when multi-node clusters are off, which they read from
    # the environment (in this process too, where Ray is imported already).
    _set_env(_ENABLE_CLUSTERS, "0")
    from ray._private import ray_constants

    if _Connection.saved_cluster_flag is None:
        _Connection.saved_cluster_flag = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    if os.environ.get(_AUTH_MODE) in (None, "token") and user_token() is None:
        # Ray would turn token authentication on (or has it on) and write a new token to
        # ~/.ray/auth_token: keep it on, with a token that the cluster's processes inherit and
        # nothing stores.
        _set_env(_AUTH_MODE, "token")
        _set_env(_AUTH_TOKEN, secrets.token_hex(32))
    _refresh_ray_config()
    ray.init(address="local", num_cpus=os.cpu_count() or 1, _node_ip_address="127.0.0.1",
             namespace=RAY_NAMESPACE, include_dashboard=False, log_to_driver=True,
             configure_logging=False)
    logger.info("Smurfs: started a local Ray cluster on 127.0.0.1 for the drafters")


# -- environment ---------------------------------------------------------------------------------
def _set_env(key: str, value: str) -> None:
    """Set ``key`` for this process (and what it starts), remembering the value to restore."""
    _Connection.saved_env.setdefault(key, os.environ.get(key))
    os.environ[key] = value
    if key == _AUTH_MODE:
        _refresh_ray_config()


def _restore_env() -> None:
    saved, _Connection.saved_env = _Connection.saved_env, {}
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    flag, _Connection.saved_cluster_flag = _Connection.saved_cluster_flag, None
    if flag is not None:
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = flag
    if saved:
        _refresh_ray_config()


def _refresh_ray_config() -> None:
    """Ray reads its authentication mode and token into a cache: re-read them."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@contextlib.contextmanager
def _on_cores(cpus: Sequence[int] | None) -> Iterator[None]:
    """Run the block on ``cpus`` (default: every core this process may use). The calling thread
    may be bound to the target's cores (vLLM and OpenMP bind its compute threads, the main one
    included), and Ray's processes and threads started from it inherit its cores: there they
    would take time from the target's step."""
    try:
        before = os.sched_getaffinity(0)
        # The kernel keeps the allowed ones of the cores asked for.
        os.sched_setaffinity(0, cpus or range(os.cpu_count() or 1))
    except OSError:
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
