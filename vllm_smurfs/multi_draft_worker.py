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
    steps_late: int = 0
    steps_skipped_busy: int = 0
    last_error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class ModelDrafterClient:
    """One small draft model in its own process, reached over a local socket."""

    def __init__(self, spec: ModelDrafterConfig, dtype: str, max_model_len: int,
                 max_num_seqs: int, trust_remote_code: bool) -> None:
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
            "cpus": spec.cpus or sorted(os.sched_getaffinity(0) | _all_cpus()),
        }
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._listener: Listener | None = None
        self._step = 0
        self._pending_step: int | None = None  # the step whose answer is outstanding

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
    def submit(self, requests: Sequence[DraftRequest]) -> bool:
        """Send a step's requests; False if this drafter cannot take them now."""
        if not self.health.alive or self._conn is None:
            return False
        if self._pending_step is not None and not self._drain_late_answer():
            self.health.steps_skipped_busy += 1
            return False
        self._step += 1
        batch = [(r.req_id, r.context.tolist(), r.k) for r in requests]
        try:
            self._conn.send(("draft", self._step, batch))
        except OSError as exc:
            self._fail(f"send failed: {exc}")
            return False
        self._pending_step = self._step
        return True

    def collect(self, deadline: float) -> list[list[int]] | None:
        """The drafts of the last submitted step, or None if not there by ``deadline``."""
        assert self._conn is not None
        while True:
            try:
                ready = self._conn.poll(max(0.0, deadline - time.monotonic()))
                if not ready:
                    self.health.steps_late += 1
                    return None
                message = self._conn.recv()
            except (EOFError, OSError) as exc:
                self._fail(f"connection lost: {exc!r}")
                return None
            if message[0] == "error":
                self._pending_step = None
                self.health.last_error = message[1]
                logger.warning("Smurfs drafter %s failed a step:\n%s", self.name, message[1])
                return None
            if message[1] == self._pending_step:
                self._pending_step = None
                self.health.steps_answered += 1
                return message[2]
            # an answer to an earlier, timed-out step: stale, drop it

    def _drain_late_answer(self) -> bool:
        """Drop a late answer if it has arrived; True if the drafter is free again."""
        assert self._conn is not None
        try:
            while self._conn.poll(0):
                message = self._conn.recv()
                if message[0] == "error" or message[1] == self._pending_step:
                    self._pending_step = None
                    return True
        except (EOFError, OSError) as exc:
            self._fail(f"connection lost: {exc!r}")
        return False

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
                    spec, dtype, max_model_len, max_num_seqs, trust_remote_code))
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

    def draft(self, requests: Sequence[DraftRequest]) -> list[list[list[int]]]:
        """drafts[i][d]: drafter d's draft for requests[i] (empty when it has none)."""
        drafts: list[list[list[int]]] = [[[] for _ in self.drafters] for _ in requests]
        if not requests:
            return drafts
        submitted = []
        for d, drafter in enumerate(self.drafters):
            if isinstance(drafter, ModelDrafterClient):
                fits = [i for i, r in enumerate(requests)
                        if len(r.context) + r.k <= drafter.max_model_len]
                if fits and drafter.submit([requests[i] for i in fits]):
                    submitted.append((d, drafter, fits))
        # Model-free voters run while the model drafters work.
        for d, drafter in enumerate(self.drafters):
            if isinstance(drafter, ModelFreeDrafter):
                for i, tokens in enumerate(drafter.propose(requests)):
                    drafts[i][d] = tokens
        deadline = time.monotonic() + self.config.draft_timeout_s
        for d, drafter, fits in submitted:
            answer = drafter.collect(deadline)
            if answer is not None:
                for i, tokens in zip(fits, answer):
                    drafts[i][d] = tokens[: requests[i].k]
        return drafts

    def health(self) -> list[DrafterHealth]:
        return [d.health for d in self.drafters]

    def close(self) -> None:
        for drafter in self.model_drafters:
            drafter.close()


def _all_cpus() -> set[int]:
    return set(range(os.cpu_count() or 1))


def _drafter_env(num_threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _INHERITED_ENV_TO_DROP and not k.startswith(_INHERITED_ENV_PREFIXES_TO_DROP)}
    env["OMP_NUM_THREADS"] = str(num_threads)
    # One engine per drafter process, in this process: no engine-core or worker children.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env
