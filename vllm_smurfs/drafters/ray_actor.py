"""A model drafter as a Ray actor (``"placement": "ray"``): on another core, device or node.

The actor runs what a process drafter runs (`drafters.process_server`: the drafter's own vLLM
engine, a `PathDrafter` streaming each request's path, the same rounds and messages of
`drafters.protocol`); only the transport differs. Messages travel as Ray actor calls and Ray
objects: the client pushes each message with ``push`` (fire and forget, numbered: an async actor may
run calls out of order, and the actor takes them in their order), and the actor yields what it has
for the client to one ``stream`` (a Ray streaming generator: each batch reaches the client as it is
made), so nothing in the target's step waits on a remote call (`RayChannel`, the Ray counterpart of
`drafters.channel.Channel`). (A long poll, one ``pull`` call answered with what the actor had, left
the client a step behind: its answer came when the call arrived, not when the next tokens did.)

`RayDrafterClient` is a `drafters.process_client.ModelDrafterClient` with that channel: the paths,
deltas, acknowledgements, hang detection and failure handling are the process drafter's, and the
vote and the controller see no difference. An actor that dies (or whose node goes away) costs
speculation only; the client names it in the log and starts a replacement, which rejoins once its
engine is up (at most `MAX_REPLACEMENTS` times).

Ray comes from the ``ray`` extra and is imported only when a drafter is placed on it. If a Ray
cluster is up (``ray.init(address="auto")`` finds it, or this process is already connected, as a
worker of vLLM's Ray executor is) it is used; otherwise a local one is started on 127.0.0.1
(dashboard and usage reporting off) and stopped with the drafters.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from vllm_smurfs import cores
from vllm_smurfs.config import ModelDrafterConfig
from vllm_smurfs.drafters.process_client import (
    _INHERITED_ENV_PREFIXES_TO_DROP,
    _INHERITED_ENV_TO_DROP,
    MAX_MESSAGES_IN_FLIGHT,
    ModelDrafterClient,
)
from vllm_smurfs.drafters.protocol import Ready, Shutdown, StartFailed
from vllm_smurfs.drafters.ray_cluster import (
    connect,
    disconnect,
    placement_problem,
    requested_resources,
)

logger = logging.getLogger(__name__)

#: Replacement actors started for one drafter after its actor died, at most.
MAX_REPLACEMENTS = 3
#: Pushes not yet taken by the actor beyond which a message is refused (as a full socket refuses
#: one): a drafter that is behind is skipped, not queued without bound.
MAX_PUSHES_IN_FLIGHT = 4 * MAX_MESSAGES_IN_FLIGHT
#: Ray resource names of devices (`vllm.platforms.Platform.ray_device_key`) asked for as num_gpus.
_NUM_GPUS_KEY = "GPU"


# -- the actor's options -------------------------------------------------------------------------
def actor_options(ray_options: Mapping[str, Any] | None, num_threads: int, device_key: str,
                  gpu_fraction: float, environ: Mapping[str, str], name: str = "drafter"
                  ) -> dict[str, Any]:
    """The options the drafter's actor is made with: ``ray_options`` as the user gave them,
    completed.

    - No CPU reserved unless asked (``num_cpus: 0``).
    - Placed by the cluster (``scheduling_strategy: "DEFAULT"``) unless asked otherwise: an actor
      made by a worker of vLLM's Ray executor would otherwise land in that worker's placement
      group, whose bundles hold the target's devices only.
    - On a GPU target (``device_key``: the platform's Ray resource, "" on CPU), a drafter whose
      options name no device gets ``gpu_fraction`` of one (its gpu_memory_utilization): with
      none, Ray reserves nothing for it (and Ray 2.60 no longer hides the node's GPUs from such
      an actor), so its engine would land on whatever device 0 is. ``num_gpus: 0`` is refused.
    - OpenMP not bound to the target's places, and the device Ray gives it visible: an actor made
      by a worker of vLLM's Ray executor inherits that worker's environment, in which Ray is
      told not to set the visible devices (the worker picks its own by rank).
    """
    options = dict(ray_options or {})
    env = dict(options.pop("runtime_env", None) or {})
    env_vars = {**env.get("env_vars", {}), "OMP_NUM_THREADS": str(num_threads),
                "OMP_PROC_BIND": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "RAY_USAGE_STATS_ENABLED": "0"}
    for key in environ:
        if key.startswith("RAY_EXPERIMENTAL_NOSET_"):
            env_vars.setdefault(key, "0")
    options["runtime_env"] = {**env, "env_vars": env_vars}
    options.setdefault("num_cpus", 0)
    options.setdefault("scheduling_strategy", "DEFAULT")
    if device_key:
        resources = dict(options.get("resources") or {})
        if device_key == _NUM_GPUS_KEY and "num_gpus" in options and not options["num_gpus"]:
            raise ValueError(
                f"speculative_config.drafters[] {name!r}: ray_options num_gpus is 0, but the "
                "target runs on a GPU and so does the drafter's engine: Ray would reserve no "
                "GPU for it. Set num_gpus to the share of a GPU it may use (e.g. 0.1; "
                "gpu_memory_utilization sets its memory) or leave num_gpus out (then it asks "
                "for gpu_memory_utilization of one)")
        if device_key == _NUM_GPUS_KEY and "num_gpus" not in options and not resources.get(
                device_key):
            options["num_gpus"] = gpu_fraction
        elif device_key != _NUM_GPUS_KEY and not resources.get(device_key):
            options["resources"] = {**resources, device_key: gpu_fraction}
    return options


def _target_device_key() -> str:
    """The Ray resource of the target's device ("GPU" on CUDA and ROCm; "" on CPU)."""
    from vllm.platforms import current_platform

    return current_platform.ray_device_key or ""


# -- the actor -----------------------------------------------------------------------------------
def _pin_process(cpus: Sequence[int]) -> None:
    """Every thread of this process (Ray's own included) on ``cpus``; threads started later
    inherit it from the thread that starts them."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass  # a thread that ended meanwhile


class _QueueConnection:
    """What `drafters.process_server.serve` reads and writes, for an actor: messages the client
    pushed come from a queue; what the server sends waits in an outbox for the client's stream."""

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
    own (the `drafters.process_server.serve` loop, unchanged)."""

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
        from vllm_smurfs.drafters.process_server import PathDrafter, _Fault, serve, start_engine

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

    async def node_id(self) -> str:
        """The node it runs on: answered once the cluster has placed it (and its process runs)."""
        import ray

        return ray.get_runtime_context().get_node_id()

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
    """The client's end of an actor: `drafters.channel.Channel`'s interface over Ray calls; nothing
    waits longer than the ``timeout`` it is given. Messages go out as numbered ``push`` calls and
    come back on one ``stream`` (a Ray streaming generator the actor yields batches to)."""

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
        self._placed: Any = None  # the ref of a call answered once the actor runs on a node
        self._asks: dict[str, float] = {}  # the resources the actor asks for
        self._launched_at = 0.0
        self._unplaced_reported = False
        self._pid: int | None = None  # the actor's process, when it runs on this node
        self._fault = os.environ.get("SMURFS_DRAFTER_FAULT", "")
        self.replacements = 0
        self._was_ready = False

    def start(self) -> None:
        self._ray = connect(self._engine_spec["cpus"], self.spec.cluster_address)
        self._engine_spec["client_node_id"] = self._ray.get_runtime_context().get_node_id()
        self._engine_spec["num_threads"] = self.num_threads
        try:
            self._launch()
        except BaseException:
            self.close()
            raise

    def _launch(self) -> None:
        options = actor_options(self.spec.ray_options, self.num_threads, _target_device_key(),
                                self.spec.gpu_memory_utilization, os.environ, self.name)
        if "num_gpus" not in (self.spec.ray_options or {}) and options.get("num_gpus"):
            logger.info("Smurfs drafter %s: the target runs on a GPU and ray_options name no "
                        "num_gpus: its Ray actor asks for %s of a GPU (gpu_memory_utilization)",
                        self.name, options["num_gpus"])
        actor_class = self._ray.remote(RayDrafterActor)
        self._actor = actor_class.options(max_concurrency=8, **options).remote()
        self._asks = requested_resources(options)
        self._placed = self._actor.node_id.remote()
        self._launched_at = time.monotonic()
        self._unplaced_reported = False
        # A fault injected for the tests hits the first actor only: its replacement rejoins.
        fault, self._fault = self._fault, ""
        self._starting = self._actor.start.remote(self._engine_spec, fault)

    def wait_ready(self, timeout_s: float) -> None:
        """Wait for the actor to be placed (at most ``draft_timeout_s``: a cluster that cannot
        place it is reported, and the engine goes on without it), then for its engine."""
        deadline = time.monotonic() + timeout_s
        if not self._wait_placed(min(timeout_s, self.hang_timeout_s)):
            return
        ready, _ = self._ray.wait([self._starting], timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            self._fail(f"Ray actor not ready within {timeout_s:.0f} s")
            return
        self._take_start()

    def _wait_placed(self, timeout_s: float) -> bool:
        """Whether the actor runs on a node, waiting up to ``timeout_s``; if not, it is reported
        (at once when no node of the cluster has the resources it asks for)."""
        problem = placement_problem(self._asks, self._ray.nodes())
        if problem is None:
            ready, _ = self._ray.wait([self._placed], timeout=timeout_s)
            if ready:
                return True
        self._report_unplaced(problem, timeout_s)
        return False

    def _report_unplaced(self, problem: str | None, waited_s: float) -> None:
        if problem is None:
            problem = (f"none placed it within {waited_s:g} s (the nodes that have them are "
                       "busy, or its scheduling strategy rules them out)")
        self._unplaced_reported = True
        reason = f"its Ray actor is not placed: it asks for {self._asks}; {problem}"
        logger.error("Smurfs drafter %s: %s. Speculation goes on without it; it joins if the "
                     "cluster places it later.", self.name, reason)
        self.health.alive = False
        self.health.last_error = reason

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
        self._took_ready({**info, "placement": "ray", "replacements": self.replacements})
        self._was_ready = True
        logger.info("Smurfs drafter %s ready as a Ray actor: node %s (%s, %s), pid %s, cpus %s, "
                    "%.1f s%s", self.name, info["node_ip"], info["node_id"][:12],
                    "the target's node" if self._pid is not None else "another node",
                    info["pid"], info["cpus"], info["load_s"],
                    f" (replacement {self.replacements})" if self.replacements else "")

    def poll(self, timeout: float = 0.0) -> bool:
        if self._starting is not None and not self.alive:
            ready, _ = self._ray.wait([self._starting], timeout=0)
            if ready:
                self._take_start()
                if self._channel is not None:  # rejoined
                    self.health.alive = True
            elif (not self._unplaced_reported
                  and time.monotonic() - self._launched_at > self.hang_timeout_s
                  and not self._ray.wait([self._placed], timeout=0)[0]):
                # A replacement that the cluster does not place (its node is gone): reported.
                self._report_unplaced(placement_problem(self._asks, self._ray.nodes()),
                                      self.hang_timeout_s)
            return False
        return super().poll(timeout)

    def close(self) -> None:
        self._thaw()
        actor, self._actor = self._actor, None
        running = self._channel is not None
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self._starting = self._placed = None
        if actor is not None and self._ray is not None:
            if running:  # its engine shuts down cleanly; an actor not placed is only killed
                try:
                    self._ray.get(actor.stop.remote(), timeout=15)
                except Exception:  # noqa: BLE001 - gone already
                    pass
            try:
                self._ray.kill(actor)
            except Exception:  # noqa: BLE001 - gone already (or Ray shut down at exit first)
                pass
        if self._ray is not None:
            self._ray = None
            disconnect()

    def _stoppable_pid(self) -> int | None:
        # Stopped while paused, as a process drafter is, only when the actor runs on this node
        # and shares the target's cores (`stops_when_paused`); a remote actor idles once it has
        # taken the pause.
        return self._pid if self._stop_on_pause else None

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
