"""The drafter runtime: N drafters, each asked for a draft of every request in a step.

Model drafters run in their own processes (`drafter_server`), each with its own vLLM engine; the
interface is asynchronous (`ModelDrafterClient.submit` now, `collect` later) so drafting can
overlap other work. Model-free voters (`model_free`) run in this process: they cost microseconds.

Faults cost speculation, never a request: a drafter that is late past the step's deadline gives
no draft for that step (and is skipped while its late answer is outstanding); one that crashes
is left out for the rest of the run. Both show in the log and in `DrafterHealth`.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener
from typing import Any

import numpy as np

from vllm_smurfs.config import ModelDrafterConfig, NgramDrafterConfig, SmurfsConfig
from vllm_smurfs.model_free import NgramVoter

logger = logging.getLogger(__name__)

# Environment of the worker that must not leak into a drafter process: thread binding set up for
# the target (it would pin the drafter to the target's core) and distributed ranks.
_INHERITED_ENV_TO_DROP = (
    "OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY",
    "VLLM_CPU_OMP_THREADS_BIND", "VLLM_DIST_IDENT", "RANK", "LOCAL_RANK", "WORLD_SIZE",
    "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES_OVERRIDE",
)
_INHERITED_ENV_PREFIXES_TO_DROP = ("KMP_", "OMP_", "GOMP_")
# Messages a drafter may have unanswered before it is skipped: the server answers everything it
# has read with each engine call, so a healthy drafter stays at 1-2; the bound keeps a stalled one
# from filling its socket until send() would block the target.
MAX_MESSAGES_IN_FLIGHT = 4
# Paths (context + drafted tokens) kept per request and drafter: the newest answer and the two
# before it, so a draft that lost the vote still serves when the target takes its branch.
PATHS_PER_REQUEST = 3


@dataclass(frozen=True)
class DraftRequest:
    req_id: str
    context: np.ndarray  # [num_tokens] int: prompt + output so far
    k: int  # most draft tokens wanted


@dataclass
class DrafterHealth:
    name: str
    alive: bool = True
    steps_answered: int = 0
    steps_late: int = 0  # steps whose wait ended before this drafter's answer
    steps_skipped_busy: int = 0  # steps it was not asked: too many messages unanswered
    last_error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class ModelDrafterClient:
    """One small draft model in its own process, reached over a local socket."""

    def __init__(self, spec: ModelDrafterConfig, dtype: str, max_model_len: int,
                 max_num_seqs: int, trust_remote_code: bool, hang_timeout_s: float) -> None:
        self.spec = spec
        self.name = spec.display_name
        self.health = DrafterHealth(self.name)
        self.max_model_len = spec.max_model_len or max_model_len
        self._engine_spec = {
            "model": os.path.expanduser(spec.model),
            "dtype": dtype if spec.dtype == "auto" else spec.dtype,
            "max_model_len": self.max_model_len,
            "max_num_seqs": max_num_seqs,
            "kv_cache_gib": spec.kv_cache_gib,
            "gpu_memory_utilization": spec.gpu_memory_utilization,
            "trust_remote_code": trust_remote_code,
            "cpus": spec.cpus or _free_cpus(),
            "name": self.name,
        }
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._listener: Listener | None = None
        self._job_id = 0
        self._jobs: dict[int, tuple[str, np.ndarray]] = {}  # unanswered job -> (req_id, context)
        self._newest_job: dict[str, int] = {}  # req_id -> its newest job
        self._paths: dict[str, list[np.ndarray]] = {}  # req_id -> newest paths first
        self._unanswered = 0  # messages sent that the server has not taken into an answer yet
        self._unanswered_since: float | None = None
        self.hang_timeout_s = hang_timeout_s

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the process (returns at once; `wait_ready` waits for the engine)."""
        authkey = secrets.token_bytes(16)
        address = os.path.join(tempfile.mkdtemp(prefix="smurfs-"), "drafter.sock")
        self._listener = Listener(address, family="AF_UNIX", authkey=authkey)
        env = _drafter_env(self.spec.num_threads)
        env["SMURFS_DRAFTER_AUTHKEY"] = authkey.hex()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_smurfs.drafter_server", address,
             json.dumps(self._engine_spec)],
            env=env,
        )

    def wait_ready(self, timeout_s: float) -> None:
        assert self._listener is not None and self._proc is not None
        accepted: list[Connection] = []
        acceptor = threading.Thread(target=lambda: accepted.append(self._listener.accept()),
                                    daemon=True)
        acceptor.start()
        deadline = time.monotonic() + timeout_s
        while acceptor.is_alive() and time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            acceptor.join(0.1)
        if not accepted:
            self._fail(f"drafter process did not connect (exit code {self._proc.poll()})")
            return
        self._conn = accepted[0]
        while self._conn.poll(0.2) is False:
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self._fail(f"drafter engine did not start (exit code {self._proc.poll()})")
                return
        message = self._conn.recv()
        if message[0] != "ready":
            self._fail("drafter engine failed to start:\n" + str(message[1]))
            return
        self.health.extra.update(message[1])
        logger.info("Smurfs drafter %s ready: pid %s, cpus %s, %.1f s", self.name,
                    message[1]["pid"], message[1]["cpus"], message[1]["load_s"])

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.send(("shutdown",))
            except OSError:
                pass
            self._conn.close()
            self._conn = None
        if self._proc is not None and self._proc.poll() is None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    # -- drafting -----------------------------------------------------------------------------
    # A drafter's answer is kept as a *path*: the context it was asked about followed by the tokens
    # it drafted. Whatever the target does next, a path still gives a draft for any context that
    # is a proper prefix of it: after a full acceptance (when the path was drafted ahead, past the
    # voted chain), after a rejection where the target's token is the one this drafter had drafted
    # (its own draft lost the vote), after a one-token step whose token it had guessed, or after a
    # late answer. The newest PATHS_PER_REQUEST paths are kept; older ones are dropped.

    def submit(self, jobs: Sequence[tuple[str, np.ndarray, int]]) -> list[int]:
        """Send ``(req_id, context, n)`` jobs (draft n tokens after context); return job ids."""
        if not self.health.alive or self._conn is None or not jobs:
            return []
        if self._unanswered >= MAX_MESSAGES_IN_FLIGHT:
            # Behind (or hung): sending more would only fill the socket until send() blocks.
            self.health.steps_skipped_busy += 1
            self._check_hung()
            return []
        batch, ids = [], []
        for req_id, context, n in jobs:
            self._job_id += 1
            superseded = self._newest_job.get(req_id)
            if superseded is not None:
                self._jobs.pop(superseded, None)  # the server drops it, or answers it late
            self._newest_job[req_id] = self._job_id
            self._jobs[self._job_id] = (req_id, context)
            batch.append((self._job_id, req_id, context.tolist(), n))
            ids.append(self._job_id)
        if not self._send(("draft", batch)):
            return []
        return ids

    def wait_for(self, job_ids: Sequence[int], deadline: float) -> bool:
        """Take answers until ``job_ids`` are answered or ``deadline``; True if all were."""
        waiting = set(job_ids)
        while waiting & self._jobs.keys():
            if not self._receive(max(0.0, deadline - time.monotonic())):
                self.health.steps_late += 1
                self._check_hung()
                return False
        return True

    def poll(self) -> None:
        """Take every answer that has already arrived."""
        while self._receive(0.0):
            pass

    def draft_for(self, req_id: str, context: np.ndarray, k: int) -> list[int] | None:
        """Up to k tokens continuing ``context`` along this drafter's path, or None."""
        n = len(context)
        for path in self._paths.get(req_id, ()):
            if len(path) > n and np.array_equal(path[:n], context):
                return path[n : n + k].tolist()
        return None

    def forget(self, req_ids: Sequence[str]) -> None:
        for req_id in req_ids:
            self._paths.pop(req_id, None)
            job = self._newest_job.pop(req_id, None)
            if job is not None:
                self._jobs.pop(job, None)
        if self.health.alive and self._conn is not None and req_ids:
            self._send(("forget", list(req_ids)))

    def _send(self, message: tuple[Any, ...]) -> bool:
        assert self._conn is not None
        try:
            self._conn.send(message)
        except OSError as exc:
            self._fail(f"send failed: {exc}")
            return False
        self._unanswered += 1
        if self._unanswered_since is None:
            self._unanswered_since = time.monotonic()
        return True

    def _check_hung(self) -> None:
        since = self._unanswered_since
        if since is not None and time.monotonic() - since > self.hang_timeout_s:
            self._fail(f"no answer for {time.monotonic() - since:.1f} s")

    def _receive(self, timeout: float) -> bool:
        """Take one message within ``timeout``; False if none came (or the drafter is gone)."""
        if not self.health.alive or self._conn is None:
            return False
        try:
            if not self._conn.poll(timeout):
                return False
            message = self._conn.recv()
        except (EOFError, OSError) as exc:
            self._fail(f"connection lost: {exc!r}")
            return False
        self._unanswered = max(0, self._unanswered - message[1])
        self._unanswered_since = time.monotonic() if self._unanswered else None
        if message[0] == "error":
            self.health.last_error = message[2]
            logger.warning("Smurfs drafter %s failed a step:\n%s", self.name, message[2])
            self._jobs.clear()  # that step's jobs are lost; the next step asks again
            return True
        self.health.steps_answered += 1
        for job_id, tokens in message[2]:
            job = self._jobs.pop(job_id, None)
            if job is not None:
                req_id, context = job
                path = np.concatenate([context, np.asarray(tokens, context.dtype)])
                paths = self._paths.setdefault(req_id, [])
                paths.insert(0, path)
                del paths[PATHS_PER_REQUEST:]
        return True

    def _fail(self, reason: str) -> None:
        if self.health.alive:
            logger.error("Smurfs drafter %s is left out for the rest of the run: %s",
                         self.name, reason)
        self.health.alive = False
        self.health.last_error = reason
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()


class ModelFreeDrafter:
    """A model-free voter behind the same interface as a model drafter."""

    def __init__(self, spec: NgramDrafterConfig) -> None:
        self.spec = spec
        self.name = spec.display_name
        self.health = DrafterHealth(self.name)
        self._voter = NgramVoter(spec.prompt_lookup_min, spec.prompt_lookup_max)

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        self.health.steps_answered += 1
        return [self._voter.propose(r.context, r.k) for r in requests]


class MultiDraftWorker:
    """Asks every drafter for a draft of every request; the vote happens in the proposer."""

    def __init__(self, config: SmurfsConfig, dtype: str, max_model_len: int, max_num_seqs: int,
                 trust_remote_code: bool = False) -> None:
        self.config = config
        self.drafters: list[ModelDrafterClient | ModelFreeDrafter] = []
        for spec in config.drafters:
            if isinstance(spec, ModelDrafterConfig):
                self.drafters.append(ModelDrafterClient(
                    spec, dtype, max_model_len, max_num_seqs, trust_remote_code,
                    hang_timeout_s=config.draft_timeout_s))
            else:
                self.drafters.append(ModelFreeDrafter(spec))
        self._started = False

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.drafters]

    @property
    def model_drafters(self) -> list[ModelDrafterClient]:
        return [d for d in self.drafters if isinstance(d, ModelDrafterClient)]

    def start(self, timeout_s: float = 600.0) -> None:
        """Start all model drafters at once and wait until each is ready or left out."""
        for drafter in self.model_drafters:
            drafter.start()
        atexit.register(self.close)
        deadline = time.monotonic() + timeout_s
        for drafter in self.model_drafters:
            drafter.wait_ready(max(1.0, deadline - time.monotonic()))
        self._started = True
        if self.model_drafters and not any(d.health.alive for d in self.model_drafters):
            logger.error("No Smurfs model drafter started; only model-free voters will draft.")

    def draft(self, requests: Sequence[DraftRequest], wait_s: float) -> list[list[list[int]]]:
        """drafts[i][d]: drafter d's draft for requests[i] (empty when it has none in time).

        Drafts already drafted ahead are used at once; for the other requests each model drafter
        is asked now and waited for at most ``wait_s`` (a late answer still serves later steps).
        """
        drafts: list[list[list[int]]] = [[[] for _ in self.drafters] for _ in requests]
        if not requests:
            return drafts
        asked: list[tuple[ModelDrafterClient, list[int]]] = []
        for drafter in self.model_drafters:
            drafter.poll()
            missing = [(r.req_id, r.context, r.k) for r in requests
                       if drafter.draft_for(r.req_id, r.context, r.k) is None
                       and len(r.context) + r.k <= drafter.max_model_len]
            asked.append((drafter, drafter.submit(missing)))
        # Model-free voters run while the model drafters work.
        for d, drafter in enumerate(self.drafters):
            if isinstance(drafter, ModelFreeDrafter):
                for i, tokens in enumerate(drafter.propose(requests)):
                    drafts[i][d] = tokens
        deadline = time.monotonic() + wait_s
        for drafter, job_ids in asked:
            drafter.wait_for(job_ids, deadline)
        for d, drafter in enumerate(self.drafters):
            if isinstance(drafter, ModelDrafterClient):
                for i, r in enumerate(requests):
                    drafts[i][d] = drafter.draft_for(r.req_id, r.context, r.k) or []
        return drafts

    def draft_ahead(self, requests: Sequence[DraftRequest], voted: Sequence[list[int]]) -> None:
        """Let model drafters continue past the voted chains while the target verifies them.

        Each drafts k + 1 tokens after ``context + voted``: its own guess of the target's next
        token (standing in for the bonus token), then a full next draft.
        """
        for drafter in self.model_drafters:
            jobs = []
            for request, chain in zip(requests, voted):
                context = np.concatenate([request.context, np.asarray(chain, request.context.dtype)])
                if len(context) + request.k + 1 <= drafter.max_model_len:
                    jobs.append((request.req_id, context, request.k + 1))
            drafter.submit(jobs)

    def forget(self, req_ids: Sequence[str]) -> None:
        for drafter in self.model_drafters:
            drafter.forget(req_ids)

    def health(self) -> list[DrafterHealth]:
        return [d.health for d in self.drafters]

    def close(self) -> None:
        for drafter in self.model_drafters:
            drafter.close()


def _free_cpus() -> list[int]:
    """Cores this process's compute threads are not bound to (all cores if it is unbound).

    vLLM binds the target worker's threads to its cores (core 0 of 2 here, by default): drafters
    go to the others, so drafting and verification do not fight over a core.
    """
    every = set(range(os.cpu_count() or 1))
    free = every - os.sched_getaffinity(0)
    return sorted(free or every)


def _drafter_env(num_threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _INHERITED_ENV_TO_DROP and not k.startswith(_INHERITED_ENV_PREFIXES_TO_DROP)}
    env["OMP_NUM_THREADS"] = str(num_threads)
    # One engine per drafter process, in this process: no engine-core or worker children.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env
