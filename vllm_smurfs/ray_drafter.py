"""A model drafter as a Ray actor (``"placement": "ray"``): on another core, device or node.

The actor runs what a process drafter runs (`drafter_server`: the drafter's own vLLM engine, a
`PathDrafter` streaming each request's path, the same rounds and messages of `drafter_protocol`);
only the transport differs. Messages travel as Ray actor calls and Ray objects: the client pushes
each message with ``push`` (fire and forget, numbered: an async actor may run calls out of
order, and the actor takes them in their order), and the actor yields what it has for the client
to one ``stream`` (a Ray streaming generator: each batch reaches the client as it is made), so
nothing in the target's step waits on a remote call (`RayChannel`, the Ray counterpart of
`channel.Channel`). (A long poll, one ``pull`` call answered with what the actor had, left the
client a step behind: its answer came when the call arrived, not when the next tokens did.)

`RayDrafterClient` is a `drafter_client.ModelDrafterClient` with that channel: the paths, deltas,
acknowledgements, hang detection and failure handling are the process drafter's, and the vote and
the controller see no difference. An actor that dies (or whose node goes away) costs speculation
only; the client names it in the log and starts a replacement, which rejoins once its engine is up
(at most `MAX_REPLACEMENTS` times).

Ray comes from the ``ray`` extra and is imported only when a drafter is placed on it. If a Ray
cluster is up (``ray.init(address="auto")`` finds it, or this process is already connected, as a
worker of vLLM's Ray executor is) it is used; otherwise a local one is started on 127.0.0.1
(dashboard and usage reporting off) and stopped with the drafters.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from vllm_smurfs import cores
from vllm_smurfs.config import ModelDrafterConfig
from vllm_smurfs.drafter_client import (
    _INHERITED_ENV_PREFIXES_TO_DROP,
    _INHERITED_ENV_TO_DROP,
    MAX_MESSAGES_IN_FLIGHT,
    ModelDrafterClient,
)
from vllm_smurfs.drafter_protocol import Ready, Shutdown, StartFailed

logger = logging.getLogger(__name__)

#: Replacement actors started for one drafter after its actor died, at most.
MAX_REPLACEMENTS = 3
#: Pushes not yet taken by the actor beyond which a message is refused (as a full socket refuses
#: one): a drafter that is behind is skipped, not queued without bound.
MAX_PUSHES_IN_FLIGHT = 4 * MAX_MESSAGES_IN_FLIGHT
RAY_NAMESPACE = "vllm-smurfs"


# -- the cluster ---------------------------------------------------------------------------------
class _Connection:
    """Whether this process connected to Ray for the drafters (then it disconnects, and stops the
    local cluster it started, when the last Ray drafter closes)."""

    lock = threading.Lock()
    users = 0
    ours = False


def connect(cpus: Sequence[int] | None = None) -> Any:
    """The `ray` module, connected: to the running cluster, or to a local one started here.
    ``cpus``: the cores Ray's processes and threads started here go on (the drafters' cores,
    off the target's); default: every core this process may use."""
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError(
            "speculative_config.drafters[].placement 'ray' needs Ray: install the extra, "
            "pip install -e '.[cpu,ray]' (or '.[gpu,ray]')") from exc
    with _Connection.lock:
        _Connection.users += 1
        if ray.is_initialized():
            return ray
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        common = dict(namespace=RAY_NAMESPACE, include_dashboard=False, log_to_driver=True,
                      configure_logging=False)
        with _on_cores(cpus):
            try:
                ray.init(address="auto", **common)
                logger.info("Smurfs: Ray drafters use the running Ray cluster")
            except ConnectionError:
                _loopback_only()
                ray.init(num_cpus=os.cpu_count() or 1, _node_ip_address="127.0.0.1",
                         **common)
                logger.info("Smurfs: started a local Ray cluster on 127.0.0.1 for the drafters")
        _Connection.ours = True
        return ray


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


def _pin_process(cpus: Sequence[int]) -> None:
    """Every thread of this process (Ray's own included) on ``cpus``; threads started later
    inherit it from the thread that starts them."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass  # a thread that ended meanwhile


def _loopback_only() -> None:
    """Keep a local cluster on 127.0.0.1: Ray turns 127.0.0.1 into the machine's address (and
    its servers then listen on every interface) unless multi-node clusters are off, which the
    setting below does, despite its name, on Linux too. Read by Ray at import time: set for the
    processes the cluster starts, and in this process, where Ray is imported already (ray 2.x)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


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


# -- the actor -----------------------------------------------------------------------------------
class _QueueConnection:
    """What `drafter_server.serve` reads and writes, for an actor: messages the client pushed
    come from a queue; what the server sends waits in an outbox for the client's stream."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ready: asyncio.Event) -> None:
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.outbox: deque[Any] = deque()
        self._loop, self._ready = loop, ready

    def recv(self) -> Any:
        return self.inbox.get()

    def poll(self, timeout: float = 0.0) -> bool:
        return not self.inbox.empty()

    def send(self, message: Any) -> None:
        self.outbox.append(message)
        self._loop.call_soon_threadsafe(self._ready.set)


class RayDrafterActor:
    """The drafter's engine and paths inside a Ray actor (made remote by `RayDrafterClient`).

    Async: ``push`` and ``stream`` are served at once while the engine steps in a thread of its
    own (the `drafter_server.serve` loop, unchanged)."""

    def __init__(self) -> None:
        self._conn: _QueueConnection | None = None
        self._ready = asyncio.Event()
        self._server: threading.Thread | None = None
        self._early: dict[int, Any] = {}  # pushed messages ahead of one not taken yet
        self._next_seq = 0

    async def start(self, spec: dict[str, Any], fault: str) -> Ready | StartFailed:
        """Build the engine (as a process drafter does) and start serving; `Ready` carries the
        node it runs on, so that the client can tell a drafter beside it from a remote one."""
        import ray

        for key in list(os.environ):
            if key in _INHERITED_ENV_TO_DROP or key.startswith(_INHERITED_ENV_PREFIXES_TO_DROP):
                del os.environ[key]
        os.environ["OMP_NUM_THREADS"] = str(spec["num_threads"])
        os.environ["OMP_PROC_BIND"] = "false"
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        node_id = ray.get_runtime_context().get_node_id()
        if spec.get("cpus") and node_id == spec.get("client_node_id"):
            # The cores the client planned for it on this node, as a process drafter's; not the
            # ones it inherited from Ray's processes (which may be the target's).
            _pin_process(spec["cpus"])
        from vllm_smurfs.drafter_server import PathDrafter, _Fault, serve, start_engine

        engine, answer = await asyncio.to_thread(start_engine, spec)
        if engine is None:
            return answer
        if spec.get("cpus") and node_id == spec.get("client_node_id"):
            _pin_process(spec["cpus"])  # threads the engine started, whatever they inherited
            answer.info["cpus"] = sorted(set().union(*cores.thread_affinities()))
        self._conn = _QueueConnection(asyncio.get_running_loop(), self._ready)
        drafter = PathDrafter(engine, spec["max_model_len"])
        self._server = threading.Thread(target=serve, name="smurfs-drafter",
                                        args=(self._conn, drafter, _Fault(fault, spec["name"])),
                                        daemon=True)
        self._server.start()
        answer.info.update(node_id=node_id, node_ip=ray.util.get_node_ip_address())
        return answer

    async def push(self, seq: int, message: Any) -> None:
        """Message ``seq`` (0, 1, ...) of the client's. An async actor may run calls out of the
        order they were made in: messages wait here until every earlier one has come."""
        assert self._conn is not None, "push before start"
        self._early[seq] = message
        while self._next_seq in self._early:
            self._conn.inbox.put(self._early.pop(self._next_seq))
            self._next_seq += 1

    async def stream(self) -> AsyncIterator[list[Any]]:
        """Every message for the client, as they come: one batch per wait (a Ray streaming
        generator, so that each batch reaches the client as soon as it is made, in order)."""
        assert self._conn is not None, "stream before start"
        while True:
            while not self._conn.outbox:
                self._ready.clear()
                if self._conn.outbox:
                    break
                await self._ready.wait()
            out = list(self._conn.outbox)
            for _ in out:
                self._conn.outbox.popleft()
            yield out

    async def stop(self) -> None:
        if self._conn is not None:
            self._conn.inbox.put(Shutdown())
        if self._server is not None:
            await asyncio.to_thread(self._server.join, 10.0)


# -- the client ----------------------------------------------------------------------------------
class RayChannel:
    """The client's end of an actor: `channel.Channel`'s interface over Ray calls; nothing waits
    longer than the ``timeout`` it is given. Messages go out as numbered ``push`` calls and come
    back on one ``stream`` (a Ray streaming generator the actor yields batches to)."""

    def __init__(self, ray: Any, actor: Any) -> None:
        self._ray, self._actor = ray, actor
        self._inbox: deque[Any] = deque()
        self._pushes: deque[Any] = deque()  # refs of pushes the actor may not have taken yet
        self._stream = actor.stream.remote()
        self._seq = 0  # pushes made (the actor takes them in this order)

    def send(self, message: Any) -> bool:
        """Push ``message``; False (not sent) while too many pushes are outstanding."""
        if len(self._pushes) >= MAX_PUSHES_IN_FLIGHT:
            done, _ = self._ray.wait(list(self._pushes), num_returns=len(self._pushes),
                                     timeout=0)
            finished = set(done)
            self._pushes = deque(r for r in self._pushes if r not in finished)
            if len(self._pushes) >= MAX_PUSHES_IN_FLIGHT:
                return False
        self._pushes.append(self._actor.push.remote(self._seq, message))
        self._seq += 1
        return True

    def flush(self) -> None:
        pass

    def receive(self, timeout: float = 0.0) -> Any | None:
        """The next message, waiting up to ``timeout``; EOFError when the actor is gone."""
        if not self._inbox:
            ready, _ = self._ray.wait([self._stream], timeout=timeout)
            if not ready:
                return None
            try:
                self._inbox.extend(self._ray.get(next(self._stream)))
            except StopIteration:
                raise EOFError("the Ray actor's stream ended") from None
            except self._ray.exceptions.RayError as exc:
                raise EOFError(f"Ray actor lost: {type(exc).__name__}: {exc}") from None
            if not self._inbox:
                return None
        return self._inbox.popleft()

    def close(self) -> None:
        self._inbox.clear()
        self._pushes.clear()


class RayDrafterClient(ModelDrafterClient):
    """A model drafter in a Ray actor, behind the process drafter's client."""

    def __init__(self, spec: ModelDrafterConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(spec, *args, **kwargs)
        self._ray: Any = None
        self._actor: Any = None
        self._starting: Any = None  # the ref of the start() call while the actor starts
        self._pid: int | None = None  # the actor's process, when it runs on this node
        self._fault = os.environ.get("SMURFS_DRAFTER_FAULT", "")
        self.replacements = 0
        self._was_ready = False

    def start(self) -> None:
        self._ray = connect(self._engine_spec["cpus"])
        self._engine_spec["client_node_id"] = self._ray.get_runtime_context().get_node_id()
        self._engine_spec["num_threads"] = self.num_threads
        self._launch()

    def _launch(self) -> None:
        options = dict(self.spec.ray_options or {})
        env = dict(options.pop("runtime_env", None) or {})
        # The actor's process inherits the environment of Ray's processes, which may be the
        # target's (when its worker started the cluster): OpenMP must not bind the drafter's
        # threads to the target's places (see `RayDrafterActor.start` for its own cores).
        env["env_vars"] = {**env.get("env_vars", {}), "OMP_NUM_THREADS": str(self.num_threads),
                           "OMP_PROC_BIND": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                           "RAY_USAGE_STATS_ENABLED": "0"}
        options.setdefault("num_cpus", 0)
        actor_class = self._ray.remote(RayDrafterActor)
        self._actor = actor_class.options(runtime_env=env, max_concurrency=8,
                                          **options).remote()
        # A fault injected for the tests hits the first actor only: its replacement rejoins.
        fault, self._fault = self._fault, ""
        self._starting = self._actor.start.remote(self._engine_spec, fault)

    def wait_ready(self, timeout_s: float) -> None:
        ready, _ = self._ray.wait([self._starting], timeout=timeout_s)
        if not ready:
            self._fail(f"Ray actor not ready within {timeout_s:.0f} s")
            return
        self._take_start()

    def _take_start(self) -> None:
        starting, self._starting = self._starting, None
        try:
            answer = self._ray.get(starting)
        except self._ray.exceptions.RayError as exc:
            self._fail(f"Ray actor failed to start: {type(exc).__name__}: {exc}")
            return
        if not isinstance(answer, Ready):
            self._fail("drafter engine failed to start:\n" + answer.error)
            return
        self._channel = RayChannel(self._ray, self._actor)  # type: ignore[assignment]
        info = answer.info
        self._pid = info["pid"] if info["node_id"] == self._engine_spec["client_node_id"] else None
        self.health.extra.update(info, placement="ray", replacements=self.replacements)
        self._last_heard = time.monotonic()
        self._was_ready = True
        logger.info("Smurfs drafter %s ready as a Ray actor: node %s, pid %s, cpus %s, %.1f s%s",
                    self.name, info["node_ip"], info["pid"], info["cpus"], info["load_s"],
                    f" (replacement {self.replacements})" if self.replacements else "")

    def poll(self, timeout: float = 0.0) -> bool:
        if self._starting is not None and not self.alive:
            ready, _ = self._ray.wait([self._starting], timeout=0)
            if ready:
                self._take_start()
                if self._channel is not None:  # rejoined
                    self.health.alive = True
            return False
        return super().poll(timeout)

    def close(self) -> None:
        self._thaw()
        actor, self._actor = self._actor, None
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if actor is not None and self._ray is not None:
            try:
                self._ray.get(actor.stop.remote(), timeout=15)
                self._ray.kill(actor)
            except Exception:  # noqa: BLE001 - gone already (or Ray shut down at exit first)
                pass
        if self._ray is not None:
            self._ray = None
            disconnect()

    def _stoppable_pid(self) -> int | None:
        # Stopped while paused, as a process drafter is, only when the actor runs on this node
        # (it may share the target's cores); a remote actor idles once it has taken the pause.
        return self._pid

    def _fail(self, reason: str) -> None:
        if self._frozen:
            self._thaw()
        replace = (self._was_ready and self.replacements < MAX_REPLACEMENTS
                   and self._ray is not None and "engine steps failed" not in reason)
        if not replace:
            super()._fail(reason)
            self._kill_actor()
            return
        self.replacements += 1
        self.health.extra["replacements"] = self.replacements
        logger.error("Smurfs drafter %s (Ray actor on node %s) is lost: %s; starting a "
                     "replacement (%d of %d)", self.name, self.health.extra.get("node_ip"),
                     reason, self.replacements, MAX_REPLACEMENTS)
        self.health.alive = False
        self.health.last_error = reason
        self._paths.clear()
        self._sent.clear()
        self._live.clear()
        self._unacked = 0
        self._tracking = False
        self._channel = None
        self._pid = None
        self._kill_actor()
        self._launch()

    def _kill_actor(self) -> None:
        if self._actor is not None and self._ray is not None:
            try:
                self._ray.kill(self._actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
