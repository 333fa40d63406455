"""The target's end of a process drafter (`drafters.process_server`): `ModelDrafterClient` starts
the drafter's process, mirrors its paths (a request's text followed by the drafter's own
continuation, streamed one engine step at a time), tells it where each request's text goes
(`track`), pauses it, and leaves it out when it fails. Nothing here waits on the drafter's socket
(`drafters.channel.Channel`); the messages are `drafters.protocol`'s.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener
from typing import Any

import numpy as np

from vllm_smurfs import cores
from vllm_smurfs.config import ModelDrafterConfig
from vllm_smurfs.drafters.channel import Channel
from vllm_smurfs.drafters.protocol import (
    EXTEND,
    RESET,
    RESUME,
    RESYNC,
    STOP,
    Forget,
    Pause,
    Ready,
    Shutdown,
    StartFailed,
    StepFailed,
    Track,
    TrackItem,
)

logger = logging.getLogger(__name__)

# Environment of the worker that must not leak into a drafter process: thread binding set up for
# the target (it would pin the drafter to the target's core) and distributed ranks.
_INHERITED_ENV_TO_DROP = (
    "OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY",
    "VLLM_CPU_OMP_THREADS_BIND", "VLLM_DIST_IDENT", "RANK", "LOCAL_RANK", "WORLD_SIZE",
    "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES_OVERRIDE",
    "NUMBA_NUM_THREADS",
)
_INHERITED_ENV_PREFIXES_TO_DROP = ("KMP_", "OMP_", "GOMP_")
# Messages a drafter may leave unacknowledged before it is not sent more tracks: the server
# acknowledges everything it took with each round (one engine step), and a step sends at most
# two, so a healthy drafter stays at 1-2. (Sends never block the target whatever the drafter
# does: see `drafters.channel.Channel`; this bound keeps a drafter that is behind from being fed
# work it cannot do.)
MAX_MESSAGES_IN_FLIGHT = 4
# Bytes the socket has not taken yet beyond which a message is not queued (a stalled drafter's
# socket fills; tracks then skip it until it drains). Tracks send what changed of each request's
# text, so a step's message is a few hundred bytes; a first track carries whole prompts.
MAX_PENDING_BYTES = 4 << 20
# A drafter whose engine step fails this many times in a row is left out, as a crash is; a
# failure's traceback is logged once, later ones in a line at most once a minute.
MAX_FAILED_STEPS_IN_A_ROW = 3
_FAILURE_LOG_INTERVAL_S = 60.0


@dataclass
class DrafterHealth:
    name: str
    alive: bool = True
    steps_answered: int = 0  # rounds of the drafter process (one engine step each)
    steps_late: int = 0  # target steps whose wait for drafts ended before this drafter had them
    steps_skipped_busy: int = 0  # steps it was not told about: too many messages unacknowledged
    busy_s: float = 0.0  # seconds the drafter's engine spent in its steps
    last_error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class _Path:
    """The client's copy of one request's path on one drafter.

    Extended in place (a buffer that doubles: appending a token is O(1), not a copy of the path),
    and compared with the request's text only where it has not been yet: the text only grows,
    so a prefix found equal to it stays equal (``agreed``), and each check costs the tokens added
    since the last one.
    """

    __slots__ = ("_buffer", "length", "drafting", "agreed")

    def __init__(self, tokens: np.ndarray, drafting: bool) -> None:
        self._buffer = np.array(tokens, dtype=np.int32)  # a copy: the path is ours to extend
        self.length = len(self._buffer)
        self.drafting = drafting  # the drafter is extending it
        self.agreed = 0  # leading tokens known to equal the request's text

    @property
    def tokens(self) -> np.ndarray:  # [length] int32
        return self._buffer[: self.length]

    def append(self, tokens: np.ndarray) -> None:
        end = self.length + len(tokens)
        if end > len(self._buffer):
            grown = np.empty(max(end, 2 * len(self._buffer)), dtype=np.int32)
            grown[: self.length] = self._buffer[: self.length]
            self._buffer = grown
        self._buffer[self.length:end] = tokens
        self.length = end

    def extends(self, context: np.ndarray) -> bool:
        """Whether the path starts with ``context``, the request's text now."""
        n = len(context)
        if self.length < n:
            return False
        if self.agreed < n:
            if not np.array_equal(self._buffer[self.agreed:n], context[self.agreed:]):
                return False
            self.agreed = n
            return True
        # Compared before; the last token still is (a guard for a context that is not this
        # request's growing text, which costs nothing).
        return n == 0 or self._buffer[n - 1] == context[n - 1]


class ModelDrafterClient:
    """One small draft model in its own process, reached over a local socket."""

    def __init__(self, spec: ModelDrafterConfig, dtype: str, max_model_len: int,
                 max_num_seqs: int, trust_remote_code: bool, hang_timeout_s: float,
                 cpus: list[int] | None = None, num_threads: int | None = None) -> None:
        self.spec = spec
        self.name = spec.display_name
        self.health = DrafterHealth(self.name)
        self.max_model_len = spec.max_model_len or max_model_len
        self._engine_spec = {
            "model": os.path.expanduser(spec.model),
            "dtype": dtype if spec.dtype == "auto" else spec.dtype,
            "max_model_len": self.max_model_len,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max(spec.prefill_chunk_tokens, max_num_seqs),
            "kv_cache_gib": spec.kv_cache_gib,
            "gpu_memory_utilization": spec.gpu_memory_utilization,
            "trust_remote_code": trust_remote_code,
            "cpus": cpus or spec.cpus or cores.allowed_cpus(),
            "name": self.name,
        }
        self.num_threads = num_threads or spec.num_threads or 1
        self.hang_timeout_s = hang_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._channel: Channel | None = None
        self._listener: Listener | None = None
        self._tmpdir: str | None = None
        self._paths: dict[str, _Path] = {}
        # Per request, the context last sent (and how much of it is the request's text, which
        # never changes): the next track sends what differs from it.
        self._sent: dict[str, tuple[np.ndarray, int]] = {}
        self._failed_in_a_row = 0
        self._failure_logged_at = -_FAILURE_LOG_INTERVAL_S
        # Requests tracked and not forgotten since: a "reset" for any other is a late answer to
        # a track sent before the request was forgotten, and must not bring its path back.
        self._live: set[str] = set()
        self._unacked = 0  # messages sent that the server has not acknowledged yet
        self._tracking = False  # tracked something since the last pause
        self._frozen = False  # the process is stopped (SIGSTOP) while paused
        self._stop_on_pause = True  # pausing stops the process (see `stops_when_paused`)
        self._stops: deque[tuple[float, float]] = deque(maxlen=8)  # recent (stopped, resumed)
        self._stopped_at = 0.0
        self._last_heard = time.monotonic()
        #: (num_reqs, seconds) of engine steps not yet handed to the length controller
        self.step_timings: list[tuple[int, float]] = []

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the process (returns at once; `wait_ready` waits for the engine)."""
        authkey = secrets.token_bytes(16)
        self._tmpdir = tempfile.mkdtemp(prefix="smurfs-")
        address = os.path.join(self._tmpdir, "drafter.sock")
        self._listener = Listener(address, family="AF_UNIX", authkey=authkey)
        env = _drafter_env(self.num_threads)
        env["SMURFS_DRAFTER_AUTHKEY"] = authkey.hex()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_smurfs.drafters.process_server", address,
             json.dumps(self._engine_spec)],
            env=env,
        )

    def wait_ready(self, timeout_s: float) -> None:
        assert self._listener is not None and self._proc is not None
        listener = self._listener
        accepted: list[Connection] = []
        acceptor = threading.Thread(target=lambda: accepted.append(listener.accept()),
                                    daemon=True)
        acceptor.start()
        deadline = time.monotonic() + timeout_s
        while acceptor.is_alive() and time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            acceptor.join(0.1)
        if not accepted:
            self._fail(f"drafter process did not connect (exit code {self._proc.poll()})")
            self._close_listener()  # the acceptor thread's accept() ends with it
            acceptor.join(1.0)
            return
        self._close_listener()  # connected: nothing else will
        conn = accepted[0]
        while conn.poll(0.2) is False:
            if self._proc.poll() is not None or time.monotonic() > deadline:
                conn.close()
                self._fail(f"drafter engine did not start (exit code {self._proc.poll()})")
                return
        message = conn.recv()
        if not isinstance(message, Ready):
            conn.close()
            error = message.error if isinstance(message, StartFailed) else repr(message)
            self._fail("drafter engine failed to start:\n" + error)
            return
        # From here on nothing waits on the drafter: see channel.Channel.
        self._channel = Channel(conn, MAX_PENDING_BYTES)
        self._took_ready(message.info)
        logger.info("Smurfs drafter %s ready: pid %s, cpus %s, %.1f s", self.name,
                    message.info["pid"], message.info["cpus"], message.info["load_s"])

    def _took_ready(self, info: dict[str, Any]) -> None:
        """The drafter's engine is up (``info``: its `Ready` info): its figures, and whether a
        pause stops its process."""
        self._stop_on_pause = stops_when_paused(info, target_cores())
        self.health.extra.update(info)
        self._last_heard = time.monotonic()

    def close(self) -> None:
        """Shut the drafter down: its process, the socket, the listener, the socket's folder."""
        self._thaw()
        if self._channel is not None:
            try:
                self._channel.send(Shutdown())
                self._channel.flush()
            except OSError:
                pass
            self._channel.close()
            self._channel = None
        if self._proc is not None:
            if self._proc.poll() is None:
                try:
                    self._proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
        self._close_listener()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def _close_listener(self) -> None:
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass
            self._listener = None

    @property
    def alive(self) -> bool:
        return self.health.alive and self._channel is not None

    # -- drafting -----------------------------------------------------------------------------
    def track(self, items: Sequence[tuple[str, np.ndarray, int, int]]) -> bool:
        """Tell the drafter each request's text: ``(req_id, context, max_lead, text_len)``, the
        context's first ``text_len`` tokens being the request's text (the rest: the chain the
        target is verifying).

        It keeps (or restarts) its path for the request and drafts up to ``max_lead`` tokens past
        ``context``. What travels is, per request, what differs from the context sent before:
        ``(req_id, base, tokens, max_lead)``, the context being the first ``base`` tokens of the
        last one followed by ``tokens``. Returns False when nothing was sent (no items, dead,
        or behind).
        """
        if not self.alive or not items:
            return False
        self._thaw()
        if self._unacked >= MAX_MESSAGES_IN_FLIGHT:
            # Behind (or hung): it would only be given work it cannot do.
            self.health.steps_skipped_busy += 1
            self._check_hung()
            return False
        batch, sent_now = [], {}
        for req_id, context, max_lead, text_len in items:
            if len(context) >= self.max_model_len:
                continue
            context = np.asarray(context, dtype=np.int32)
            base = self._common_prefix(req_id, context)
            batch.append(TrackItem(req_id, base, context[base:], max_lead))
            sent_now[req_id] = (context, text_len)
        sent = bool(batch) and self._send(Track(batch))
        if sent:
            self._live.update(sent_now)
            self._sent.update(sent_now)
        self._tracking |= sent
        return sent

    def _common_prefix(self, req_id: str, context: np.ndarray) -> int:
        """Leading tokens ``context`` shares with the context last sent for ``req_id``: at least
        that one's text (a request's text only grows), then the chain it carried, compared."""
        last = self._sent.get(req_id)
        if last is None:
            return 0
        previous, text_len = last
        n = min(len(previous), len(context))
        if text_len > n:
            return 0  # not the same request's text (cannot happen for a live request)
        differs = np.flatnonzero(previous[text_len:n] != context[text_len:n])
        return text_len + (int(differs[0]) if len(differs) else n - text_len)

    def pause(self) -> None:
        """Stop drafting for every request until the next `track` (paths answer "stop"), and
        stop the process (SIGSTOP) at once: a drafter on a core the target takes back must not
        finish its engine step there (a chunk of prefill takes a second on one core, and every
        OpenMP thread of the target waits for the one it shares a core with)."""
        if self.alive and self._tracking:
            self._tracking = not self._send(Pause())
            if not self._tracking:
                self._sent.clear()  # the server drops every request it had
                self._freeze()

    def resume(self) -> None:
        """Let a paused drafter's process run again (it then takes the pause, and what comes
        after it, in order); `track` does it too."""
        self._thaw()

    def _stoppable_pid(self) -> int | None:
        """The process `pause` stops (SIGSTOP) and `resume` lets run: the drafter's, while alive
        and when stopping it gives the target something (`stops_when_paused`)."""
        if not self._stop_on_pause or self._proc is None or self._proc.poll() is not None:
            return None
        return self._proc.pid

    def _freeze(self) -> None:
        pid = self._stoppable_pid()
        if self._frozen or pid is None:
            return
        try:
            os.kill(pid, signal.SIGSTOP)
        except OSError:
            return
        self._frozen = True
        self._stopped_at = time.monotonic()

    def _thaw(self) -> None:
        if not self._frozen:
            return
        self._frozen = False
        pid = self._stoppable_pid()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
        self._last_heard = time.monotonic()  # silence while stopped was not a hang
        self._stops.append((self._stopped_at, self._last_heard))

    def _was_stopped_during(self, started: float, seconds: float) -> bool:
        return any(started < resumed and started + seconds > stopped
                   for stopped, resumed in self._stops)

    def draft_for(self, req_id: str, context: np.ndarray, k: int) -> list[int]:
        """Up to k tokens continuing ``context`` along this drafter's path (may be empty)."""
        path = self._paths.get(req_id)
        if path is None or not path.extends(context):
            return []
        n = len(context)
        return path.tokens[n : n + k].tolist()

    def is_drafting(self, req_id: str, context: np.ndarray) -> bool:
        """Whether more tokens continuing ``context`` may still come for this request."""
        if not self.alive:
            return False
        if self._unacked:
            return True  # a message it has not acted on yet may start a draft
        path = self._paths.get(req_id)
        return path is not None and path.drafting and path.extends(context)

    def poll(self, timeout: float = 0.0) -> bool:
        """Take every update that has arrived (waiting up to ``timeout`` for the first)."""
        got = False
        while self._receive(timeout):
            got, timeout = True, 0.0
        if not got:
            self._check_hung()
        return got

    def forget(self, req_ids: Sequence[str]) -> None:
        for req_id in req_ids:
            self._paths.pop(req_id, None)
            self._live.discard(req_id)
            self._sent.pop(req_id, None)
        # A paused server has dropped every request already (and a stopped one must not be sent
        # a message per finished request).
        if self.alive and req_ids and self._tracking:
            self._send(Forget(list(req_ids)))

    def _send(self, message: Track | Forget | Pause) -> bool:
        assert self._channel is not None
        try:
            if not self._channel.send(message):
                # The socket holds MAX_PENDING_BYTES the drafter has not read: it is behind.
                self.health.steps_skipped_busy += 1
                return False
        except OSError as exc:
            self._fail(f"send failed: {exc}")
            return False
        if not self._unacked and not self._owes_tokens():
            self._last_heard = time.monotonic()  # the hang clock starts now
        self._unacked += 1
        return True

    def _owes_tokens(self) -> bool:
        return any(p.drafting for p in self._paths.values())

    def _check_hung(self) -> None:
        if not self.alive or self._frozen or not (self._unacked or self._owes_tokens()):
            return
        silent = time.monotonic() - self._last_heard
        if silent > self.hang_timeout_s:
            self._fail(f"no answer for {silent:.1f} s")

    def _receive(self, timeout: float) -> bool:
        """Apply one message within ``timeout``; False if none came (or the drafter is gone)."""
        if not self.alive:
            return False
        assert self._channel is not None
        try:
            message = self._channel.receive(timeout)
        except (EOFError, OSError) as exc:
            self._fail(f"connection lost: {exc!r}")
            return False
        if message is None:
            return False
        self._last_heard = time.monotonic()
        self._unacked = max(0, self._unacked - message.taken)
        if isinstance(message, StepFailed):
            self._step_failed(message.error)
            return True
        self._failed_in_a_row = 0
        self.health.steps_answered += 1
        for num_reqs, seconds, started in message.timings:
            if self._was_stopped_during(started, seconds):
                continue  # the time it was stopped is not the step's
            self.health.busy_s += seconds
            self.step_timings.append((num_reqs, seconds))
        for req_id, kind, payload in message.records:
            self._apply(req_id, kind, payload)
        return True

    def _step_failed(self, error: str) -> None:
        """The drafter's engine step failed: it dropped every request (and so does this side:
        nothing sent before can come back), and after MAX_FAILED_STEPS_IN_A_ROW it is out."""
        self._failed_in_a_row += 1
        self.health.last_error = error
        self._paths.clear()
        self._live.clear()
        self._sent.clear()
        if self._failed_in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
            last_line = error.strip().splitlines()[-1] if error.strip() else error
            self._fail(f"{self._failed_in_a_row} engine steps failed in a row: {last_line}")
            return
        now = time.monotonic()
        if self._failed_in_a_row == 1 and now - self._failure_logged_at >= _FAILURE_LOG_INTERVAL_S:
            self._failure_logged_at = now
            logger.warning("Smurfs drafter %s failed a step (its requests start again):\n%s",
                           self.name, error)

    def _apply(self, req_id: str, kind: str, payload: Any) -> None:
        if kind == RESET:
            if req_id in self._live:
                self._paths[req_id] = _Path(payload, drafting=True)
            return
        if kind == RESYNC:
            # The drafter did not have the context a track built on (it had dropped the
            # request): the next track sends the whole context.
            self._sent.pop(req_id, None)
            self._paths.pop(req_id, None)
            return
        path = self._paths.get(req_id)
        if path is None:
            return  # forgotten meanwhile
        if kind == EXTEND:
            start, tokens = payload
            if start == path.length:
                path.append(tokens)
        elif kind in (RESUME, STOP):
            path.drafting = kind == RESUME

    def _fail(self, reason: str) -> None:
        if self.health.alive:
            logger.error("Smurfs drafter %s is left out for the rest of the run: %s",
                         self.name, reason)
        self.health.alive = False
        self.health.last_error = reason
        self._paths.clear()
        self._sent.clear()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def stops_when_paused(info: dict[str, Any], target: Sequence[int] | None) -> bool:
    """Whether pausing the drafter of ``info`` (its `Ready` info: ``device``, ``cpus``) stops its
    process (SIGSTOP): only a drafter that computes on CPU cores the target's threads use
    (``target``: their cores, None when they float over every core). Stopped, it gives those
    cores back at once instead of finishing an engine step there. A drafter elsewhere gains the
    target nothing by stopping, and one on a GPU must keep running: its host thread feeds the
    device, and a stopped process keeps its device memory and context while work it queued
    waits on it."""
    if info.get("device", "cpu") != "cpu":
        return False
    if target is None:
        return True
    return bool(set(info.get("cpus") or ()) & set(target))


def target_cores() -> list[int] | None:
    """The cores the target's compute threads are bound to (in the target's worker, where the
    clients live); None when they float (see `cores.target_cpus`)."""
    try:
        import torch
    except ImportError:
        return None
    return cores.target_cpus(torch.get_num_threads())


def _drafter_env(num_threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _INHERITED_ENV_TO_DROP and not k.startswith(_INHERITED_ENV_PREFIXES_TO_DROP)}
    env["OMP_NUM_THREADS"] = str(num_threads)
    # One engine per drafter process, in this process: no engine-core or worker children.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env
