"""A model drafter's own process: one vLLM engine that keeps drafting ahead for every request.

Started by `drafters.process_client.ModelDrafterClient` with ``python -m
vllm_smurfs.drafters.process_server`` (a subprocess, because vLLM workers are daemonic and may not
fork children of their own). It connects back to the client over a local socket; the messages are
defined in `drafters.protocol`.

Per request the server keeps a **path**: a context the client sent, followed by the drafter's own
greedy continuation, streamed to the client one engine step at a time (a draft is usable as soon
as its first tokens exist, not when a whole k-token call ends). ``track`` says "the target's text
will be ``context`` if it accepts the chain it is verifying; keep drafting up to ``max_lead``
tokens past it":

- if the path already extends the context (the target accepted what this drafter drafted), the
  drafter keeps going: nothing is redone;
- otherwise the request restarts from the context (prefix caching makes that cheap: only the
  unfinished last KV block and the new tokens are prefilled).

Work in flight is bounded: an engine request drafts at most ``max_lead`` tokens past the context
it was tracked with and then ends (the drafter *pauses* for that request); it resumes from the end
of its path once the target has consumed half of the lead. The engine is vLLM's own: paged KV
cache, prefix caching, every request's next token batched into one engine step.

(Side paths at the drafter's second choices, drafted while the target verifies, were tried and
measured: each costs a re-prefill of the last block and shares the memory bandwidth the main paths
need, and the target's token matched the drafter's second choice too rarely; on the 2-core CPU
machine they lowered tokens/s.)
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_smurfs.drafters.protocol import (
    EXTEND,
    RESET,
    RESUME,
    RESYNC,
    STOP,
    Forget,
    Pause,
    Ready,
    Record,
    Shutdown,
    StartFailed,
    StepFailed,
    Timing,
    Track,
    Update,
)

# Block size of the drafter's KV cache: prefix caching reuses whole blocks only, so small blocks
# re-prefill less per restart; 32 is the smallest the CPU attention backend accepts.
DRAFTER_BLOCK_SIZE = 32


def _die_with_parent() -> None:
    """Ask the kernel to kill this process when its parent dies (Linux): SIGKILL, which also
    ends it while it is stopped (the client stops a paused drafter)."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:
        pass


def _build_engine(spec: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.platforms import current_platform

    kwargs: dict[str, Any] = dict(
        model=spec["model"],
        dtype=spec["dtype"],
        seed=0,
        enforce_eager=True,
        enable_prefix_caching=True,
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        trust_remote_code=spec.get("trust_remote_code", False),
        disable_log_stats=True,
    )
    if current_platform.is_cpu():
        kwargs["block_size"] = DRAFTER_BLOCK_SIZE
        kwargs["kv_cache_memory_bytes"] = int(spec["kv_cache_gib"] * (1 << 30))
    else:
        kwargs["gpu_memory_utilization"] = spec["gpu_memory_utilization"]
    return LLM(**kwargs)


@dataclass
class _Track:
    """One request's path and the engine request extending it."""

    path: np.ndarray  # [num_tokens] int32: tracked context + drafted tokens
    context_len: int  # length of the latest tracked context (a prefix of path)
    max_lead: int
    engine_id: str | None = None  # live engine request drafting this path, if any
    generation: int = 0  # engine requests started so far (their ids must be unique)

    @property
    def lead(self) -> int:
        return len(self.path) - self.context_len


class VllmDraftEngine:
    """The drafter's vLLM `LLMEngine` behind the four calls `PathDrafter` makes."""

    def __init__(self, llm_engine: Any) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self._engine = llm_engine
        self._prompt = TokensPrompt
        self._params = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                                detokenize=False,
                                                output_kind=RequestOutputKind.DELTA)

    def add(self, engine_id: str, prompt: list[int], max_tokens: int) -> None:
        self._engine.add_request(engine_id, self._prompt(prompt_token_ids=prompt),
                                 self._params(max_tokens))

    def abort(self, engine_id: str) -> None:
        self._engine.abort_request([engine_id])

    def busy(self) -> bool:
        return self._engine.has_unfinished_requests()

    def step(self) -> list[tuple[str, list[int], bool]]:
        """One engine step: (engine_id, new tokens, finished) per request that moved."""
        return [(out.request_id, list(out.outputs[0].token_ids), out.finished)
                for out in self._engine.step()]


class PathDrafter:
    """The server's state: one path per request, extended by one batched engine step at a time.

    ``engine`` is a `VllmDraftEngine` (a scripted stand-in serves the unit tests).
    """

    def __init__(self, engine: Any, max_model_len: int) -> None:
        self.engine = engine
        self.max_model_len = max_model_len
        self.tracks: dict[str, _Track] = {}
        self.records: list[tuple[str, str, Any]] = []

    def track(self, req_id: str, context: np.ndarray, max_lead: int) -> None:
        n = len(context)
        t = self.tracks.get(req_id)
        if t is not None and len(t.path) >= n and np.array_equal(t.path[:n], context):
            t.context_len, t.max_lead = n, max_lead
            # Resume only once half the lead is used: a resume re-prefills the last block.
            if t.engine_id is None and t.lead * 2 <= max_lead and self._start(req_id, t):
                self.records.append(Record(req_id, RESUME, None))
            return
        if t is None:
            t = self.tracks[req_id] = _Track(context, n, max_lead)
        else:
            self._abort(t)
            t.path, t.context_len, t.max_lead = context, n, max_lead
        self.records.append(Record(req_id, RESET, context))
        if not self._start(req_id, t):
            self.records.append(Record(req_id, STOP, None))

    def context_for(self, req_id: str, base: int, tokens: np.ndarray) -> np.ndarray | None:
        """The context a track means: the first ``base`` tokens of the one tracked last for
        ``req_id``, then ``tokens``; None if that context is gone (the request was dropped)."""
        tokens = np.asarray(tokens, dtype=np.int32)
        if base == 0:
            return tokens
        t = self.tracks.get(req_id)
        if t is None or base > t.context_len:
            return None
        return np.concatenate([t.path[:base], tokens])

    def forget(self, req_id: str) -> None:
        t = self.tracks.pop(req_id, None)
        if t is not None:
            self._abort(t)

    def pause(self) -> None:
        """Stop drafting for every request (the client left the model drafters out)."""
        for req_id in list(self.tracks):
            self.forget(req_id)
            self.records.append(Record(req_id, STOP, None))

    def step(self) -> Timing | None:
        """One engine step for every drafting request; None if idle."""
        if not self.engine.busy():
            return None
        num_reqs = sum(1 for t in self.tracks.values() if t.engine_id is not None)
        started = time.monotonic()
        moved = self.engine.step()
        seconds = time.monotonic() - started
        for engine_id, tokens, finished in moved:
            req_id = engine_id.rpartition("#")[0]
            t = self.tracks.get(req_id)
            if t is None or t.engine_id != engine_id:
                continue  # aborted or superseded meanwhile
            if tokens:
                new = np.asarray(tokens, dtype=np.int32)
                self.records.append(Record(req_id, EXTEND, (len(t.path), new)))
                t.path = np.concatenate([t.path, new])
            if finished:
                t.engine_id = None
                self.records.append(Record(req_id, STOP, None))
        return Timing(num_reqs, seconds, started)

    def take_records(self) -> list[Record]:
        records, self.records = self.records, []
        return records

    def _start(self, req_id: str, t: _Track) -> bool:
        n = min(t.max_lead - t.lead, self.max_model_len - len(t.path))
        if n <= 0:
            return False
        t.generation += 1
        t.engine_id = f"{req_id}#{t.generation}"
        self.engine.add(t.engine_id, t.path.tolist(), n)
        return True

    def _abort(self, t: _Track) -> None:
        if t.engine_id is not None:
            self.engine.abort(t.engine_id)
            t.engine_id = None


def serve(conn: Any, drafter: PathDrafter, fault: _Fault) -> None:
    """Rounds of: take every message that arrived, then one engine step, then one update.

    Blocks only when no request is drafting; then the next message starts a round. Every round
    ends with one update, which acknowledges the messages taken (the client bounds what it has
    in flight) and serves as a heartbeat while the drafter works.
    """
    while True:
        try:
            idle = not drafter.engine.busy()
            messages = [conn.recv()] if idle else []
            while conn.poll(0):
                messages.append(conn.recv())
        except (EOFError, OSError):
            return
        for message in messages:
            if isinstance(message, Shutdown):
                return
            if isinstance(message, Forget):
                for req_id in message.req_ids:
                    drafter.forget(req_id)
            elif isinstance(message, Pause):
                drafter.pause()
            elif isinstance(message, Track):
                for req_id, base, tokens, max_lead in message.items:
                    context = drafter.context_for(req_id, base, tokens)
                    if context is None:
                        drafter.records.append(Record(req_id, RESYNC, None))
                    else:
                        drafter.track(req_id, context, max_lead)
        timings: list[Timing] = []
        if drafter.engine.busy():
            fault.before_step()
            try:
                stepped = drafter.step()
            except Exception:  # noqa: BLE001 - a failed step costs speculation only
                # Back to a known state on both sides: no request, no record of one.
                for req_id in list(drafter.tracks):
                    drafter.forget(req_id)
                drafter.take_records()
                conn.send(StepFailed(len(messages), traceback.format_exc()))
                continue
            if stepped is not None:
                timings.append(stepped)
        conn.send(Update(len(messages), drafter.take_records(), timings))


class _Fault:
    """Fault injection for the fault tests: ``SMURFS_DRAFTER_FAULT=NAME=exit_after:N`` makes the
    drafter NAME die before its N+1-th engine step; ``NAME=hang_after:N`` makes it stop answering;
    ``NAME=kill_node_after:N`` (a Ray actor) ends its Ray node as a machine that goes away
    would: the raylet that started it and itself, SIGKILL.
    """

    def __init__(self, spec: str, name: str) -> None:
        target, _, fault = spec.partition("=")
        self.kind, _, count = fault.partition(":")
        self.remaining = int(count) if count and target == name else -1
        self.steps = 0

    def before_step(self) -> None:
        if self.remaining < 0:
            return
        if self.steps >= self.remaining:
            if self.kind == "exit_after":
                os._exit(17)
            if self.kind == "hang_after":
                time.sleep(3600)
            if self.kind == "kill_node_after":
                _kill_raylet()
                os.kill(os.getpid(), 9)
        self.steps += 1


def _kill_raylet() -> None:
    """SIGKILL this process's parent if it is a Ray raylet (it is for a Ray actor's process)."""
    import signal

    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            command = f.read().split(b"\0")[0]
    except OSError:
        return
    if os.path.basename(command) == b"raylet":
        os.kill(parent, signal.SIGKILL)


def _warm_up(engine: VllmDraftEngine) -> None:
    """Run the first engine steps before reporting ready: one-time set-up costs must not land
    on a live request."""
    engine.add("warm-up#0", [0, 1, 2, 3], 2)
    while engine.busy():
        engine.step()


def main() -> None:
    from multiprocessing.connection import Client

    address, spec_json = sys.argv[1], sys.argv[2]
    authkey = bytes.fromhex(os.environ.pop("SMURFS_DRAFTER_AUTHKEY"))
    spec = json.loads(spec_json)
    _die_with_parent()
    # Placement first: threads created by torch inherit this affinity.
    if spec.get("cpus"):
        os.sched_setaffinity(0, spec["cpus"])
    conn = Client(address, authkey=authkey)
    engine, answer = start_engine(spec)
    conn.send(answer)
    if engine is not None:
        fault = _Fault(os.environ.get("SMURFS_DRAFTER_FAULT", ""), spec.get("name", ""))
        serve(conn, PathDrafter(engine, spec["max_model_len"]), fault)


def start_engine(spec: dict[str, Any]) -> tuple[VllmDraftEngine | None, Ready | StartFailed]:
    """Build and warm up the drafter's engine: (the engine, `Ready`), or (None, `StartFailed`)
    with the traceback, for the client to decide. Shared by the process and the Ray actor."""
    try:
        started = time.monotonic()
        llm = _build_engine(spec)
        vocab_size = llm.llm_engine.model_config.get_vocab_size()
        engine = VllmDraftEngine(llm.llm_engine)
        _warm_up(engine)
        from vllm.platforms import current_platform

        return engine, Ready({"pid": os.getpid(), "vocab_size": vocab_size,
                              "load_s": time.monotonic() - started,
                              "cpus": sorted(os.sched_getaffinity(0)),
                              "device": current_platform.device_type})
    except Exception:  # noqa: BLE001 - reported to the client, which decides
        return None, StartFailed(traceback.format_exc())


if __name__ == "__main__":
    main()
