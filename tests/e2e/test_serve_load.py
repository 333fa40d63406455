"""`vllm serve` with Smurfs under load and drafter faults answers as a server without
speculation does, token for token, and stays healthy.

A workload of 64 requests (prompts longer than two drafters' context, requests cancelled
mid-stream, `max_tokens` 1) is sent by 32 clients in turn, over and over, so that the server is
busy however long each phase takes: one process drafter killed mid-run, another stopped
(SIGSTOP) past `draft_timeout_s`, then the whole workload once more. Every answer is compared
with the reference server's answer to the same request.

Two Smurfs servers run the same workload and faults:
- with a fixed lookahead and the target on one core, the process drafters on the other: every
  drafter drafts in every step, and the client never pauses (SIGSTOP) and resumes (SIGCONT) its
  process drafters itself, which it does where they share the target's cores (the target takes
  its cores back for every step with a prompt chunk, and the adaptive default pauses them where
  they do not pay): its SIGCONT would undo the test's SIGSTOP. There the test shows each event: before each signal the drafter is running (its /proc state is not
  T) and its engine steps advance (Smurfs' periodic stats line in the log); after it, the log
  names the killed drafter as lost at once and the stopped one as hung after about
  `draft_timeout_s`; vLLM's speculative-decoding counters in /metrics grow in every phase
  (before the kill, between the kill and the stop, while stopped, after);
- with the default configuration (adaptive), which carries the identity assertions only.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from smurfs_tools.tiny_models import TINY_PROMPTS

from serving import ServerLog, process_state, spec_counters, vllm_server

pytestmark = pytest.mark.e2e

NUM_REQUESTS = 64
CONCURRENCY = 32
DRAFT_TIMEOUT_S = 1.0
STOP_S = 3 * DRAFT_TIMEOUT_S
# Slack for a fault to show in the log: the client notices at its next step's poll.
NOTICE_S = 5.0
LOG_STATS_INTERVAL_S = 0.2  # Smurfs' stats line, read for the drafters' engine steps
DRAFTER_CONTEXT = 64  # max_model_len of two of the drafters; the long prompts are longer
LOST = "Smurfs drafter {} is left out for the rest of the run: (connection lost|send failed)"
HUNG = "Smurfs drafter {} is left out for the rest of the run: no answer for ([0-9.]+) s"


@dataclass(frozen=True)
class Ask:
    prompt: str
    max_tokens: int
    cancel: bool  # streamed, and the connection closed after a few chunks


def workload() -> list[Ask]:
    asks = []
    for i in range(NUM_REQUESTS):
        if i % 8 == 0:  # ~100 words: past the drafters' 64-token context
            prompt = " ".join(TINY_PROMPTS[(i + j) % len(TINY_PROMPTS)] for j in range(8))
        else:
            prompt = TINY_PROMPTS[i % len(TINY_PROMPTS)]
        max_tokens = 1 if i % 8 == 3 else (24, 160, 48, 0, 96, 200, 64, 120)[i % 8]
        asks.append(Ask(prompt, max_tokens, cancel=i % 8 == 5))
    return asks


def complete(base: str, model: str, ask: Ask) -> dict | None:
    """The completion's text and token count (None for a request cancelled mid-stream)."""
    body = {"model": model, "prompt": ask.prompt, "max_tokens": ask.max_tokens,
            "temperature": 0, "ignore_eos": True}
    if ask.cancel:
        with requests.post(f"{base}/v1/completions", json={**body, "stream": True},
                           stream=True, timeout=300) as response:
            response.raise_for_status()
            for n, _ in enumerate(response.iter_lines()):
                if n >= 3:
                    break  # the client goes away mid-stream
        return None
    response = requests.post(f"{base}/v1/completions", json=body, timeout=300)
    response.raise_for_status()
    answer = response.json()
    return {"text": answer["choices"][0]["text"],
            "tokens": answer["usage"]["completion_tokens"]}


def drafter_pid(model: str) -> int:
    """The pid of the process drafter serving ``model`` (its command line names the path)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        if "vllm_smurfs.drafters.process_server" in cmdline and json.dumps(model) in cmdline:
            found.append(int(pid))
    assert len(found) == 1, f"expected one drafter process for {model}, found {found}"
    return found[0]


def smurfs_config(family, **extra) -> dict:
    """An in-worker drafter and two process drafters (draft-0 and draft-2 with a 64-token
    context: draft-1, the one stopped, drafts for every request) and the n-gram voter."""
    return {"method": "smurfs", "num_speculative_tokens": 4, "draft_timeout_s": DRAFT_TIMEOUT_S,
            "drafters": [
                {"model": family.drafts[0], "max_model_len": DRAFTER_CONTEXT},
                {"model": family.drafts[1], "placement": "process"},
                {"model": family.drafts[2], "placement": "process",
                 "max_model_len": DRAFTER_CONTEXT},
                {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}],
            **extra}


@pytest.fixture(scope="module")
def reference(family, tmp_path_factory) -> list[dict | None]:
    """The answers of a server without speculation (None for the cancelled requests)."""
    log = tmp_path_factory.mktemp("reference") / "reference.log"
    with vllm_server(family.target, log, []) as base:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            return list(pool.map(lambda a: None if a.cancel else complete(
                base, family.target, a), workload()))


class Load:
    """32 clients sending the workload's requests in turn (request n is ask n % 64) until
    stopped, so that the server is busy through every phase of a fault run however long it
    takes; every answer is kept with its ask's index."""

    def __init__(self, base: str, model: str) -> None:
        self.asks = workload()
        self.base, self.model = base, model
        self.answers: list[tuple[int, dict | None]] = []
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(CONCURRENCY)
        self._clients = [self._pool.submit(self._client) for _ in range(CONCURRENCY)]

    def _client(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                n, self._next = self._next, self._next + 1
            answer = complete(self.base, self.model, self.asks[n % NUM_REQUESTS])
            with self._lock:
                self.answers.append((n % NUM_REQUESTS, answer))

    def wait_done(self, count: int, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.answers) < count:
            assert time.monotonic() < deadline, f"{len(self.answers)} of {count} answered"
            for client in self._clients:
                if client.done():
                    client.result()  # a client's error, raised here
            time.sleep(0.02)

    def stop(self) -> list[tuple[int, dict | None]]:
        """Stop sending, wait for the requests in flight; every answer, in order of arrival."""
        self._stop.set()
        for client in self._clients:
            client.result()
        self._pool.shutdown()
        return self.answers


@dataclass
class FaultRun:
    answers: list[tuple[int, dict | None]]  # (ask index, answer), every request served
    again: dict | None  # asks[1] once more, after everything
    healthy: bool
    log: ServerLog
    events: list[str]
    counters: dict[str, dict[str, float]]  # /metrics at each phase boundary, in order
    seconds: dict[str, float]  # from each signal to the log line naming its drafter


def serve_with_faults(family, config: dict, tmp_path: Path,
                      before_signal: Callable[[ServerLog, str, int], None] | None,
                      env: dict[str, str] | None = None) -> FaultRun:
    """Serve the workload with ``config`` under a steady load: once 8 requests are answered,
    kill draft-2's process; then stop draft-1's (SIGSTOP) for STOP_S; then serve the whole
    workload once more before the load stops. ``before_signal(log, name, pid)`` runs before
    each signal; with it, the run also waits for the log to name each drafter lost or hung."""
    config_path = tmp_path / "smurfs.json"
    config_path.write_text(json.dumps(config))
    log = ServerLog(tmp_path / "smurfs.log")
    events: list[str] = []
    counters: dict[str, dict[str, float]] = {}
    seconds: dict[str, float] = {}
    with vllm_server(family.target, log.path, ["--speculative-config", str(config_path)],
                     env) as base:
        killed, stopped = drafter_pid(family.drafts[2]), drafter_pid(family.drafts[1])
        counters["start"] = spec_counters(base)
        load = Load(base, family.target)
        try:
            load.wait_done(8)
            if before_signal:
                before_signal(log, "draft-2", killed)
            counters["kill"] = spec_counters(base)
            os.kill(killed, signal.SIGKILL)
            killed_at = time.monotonic()
            events.append(f"killed draft-2 ({killed}) with {len(load.answers)} requests answered")
            if before_signal:
                log.wait_for(LOST.format("draft-2"), NOTICE_S)
                seconds["lost"] = time.monotonic() - killed_at
                events.append(f"draft-2 named lost {seconds['lost']:.2f} s after the kill")
                before_signal(log, "draft-1", stopped)
            counters["stop"] = spec_counters(base)
            os.kill(stopped, signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                if before_signal:
                    hung = log.wait_for(HUNG.format("draft-1"), DRAFT_TIMEOUT_S + NOTICE_S)
                    seconds["hung"] = time.monotonic() - stopped_at
                    counters["hung"] = spec_counters(base)
                    events.append(f"draft-1 named hung {seconds['hung']:.2f} s after the stop "
                                  f"(its client: no answer for {hung.group(1)} s)")
                time.sleep(max(0.0, STOP_S - (time.monotonic() - stopped_at)))
                counters["resume"] = spec_counters(base)
                events.append(f"draft-1 stopped for {time.monotonic() - stopped_at:.1f} s, "
                              f"{len(load.answers)} requests answered")
            finally:
                try:
                    os.kill(stopped, signal.SIGCONT)
                except ProcessLookupError:
                    pass  # the client killed it once it was found hung
            load.wait_done(len(load.answers) + NUM_REQUESTS)
        finally:
            answers = load.stop()
        healthy = requests.get(f"{base}/health", timeout=10).status_code == 200
        again = complete(base, family.target, load.asks[1])
        counters["end"] = spec_counters(base)
    events.append(f"{len(answers)} requests answered in all")
    print("\n" + "\n".join(events) + f"\n/metrics at each phase boundary: {counters}")
    return FaultRun(answers, again, healthy, log, events, counters, seconds)


def assert_answers_as_without_speculation(run: FaultRun, reference: list[dict | None]) -> None:
    assert run.healthy
    asks = workload()
    assert {i for i, _ in run.answers} == set(range(NUM_REQUESTS))  # every ask, at least once
    for i, got in run.answers:
        if asks[i].cancel:
            continue
        assert got == reference[i], f"request {i} (max_tokens {asks[i].max_tokens}) differs"
        assert got["tokens"] == asks[i].max_tokens
    assert run.again == reference[1]


def test_a_killed_and_a_stopped_drafter_under_load_cost_speculation_only(family, tmp_path,
                                                                         reference):
    config = smurfs_config(family, lookahead={"policy": "fixed"},
                           log_stats_interval_s=LOG_STATS_INTERVAL_S)
    seen: dict[str, tuple[str, tuple[int, int]]] = {}

    def before_signal(log: ServerLog, name: str, pid: int) -> None:
        # Running, not stopped, and stepping: the signal hits a live, drafting drafter.
        steps = log.wait_engine_steps(name, timeout_s=30)
        seen[name] = (process_state(pid), steps)

    run = serve_with_faults(family, config, tmp_path, before_signal,
                            env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    print(f"before the signals (/proc state, engine steps): {seen}")
    assert_answers_as_without_speculation(run, reference)
    # The drafters had a core of their own: nothing but the test stopped or resumed them.
    run.log.wait_for(r"Smurfs placement: target 1 threads, .*; no core is shared", 0)
    for name in ("draft-2", "draft-1"):
        state, (first, later) = seen[name]
        assert state not in ("T", "t", "Z", "gone"), f"{name} was not running: {state}"
        assert later > first
    # The killed drafter was named lost at once; the stopped one hung once silent for about
    # draft_timeout_s (its last answer may have come a step before the stop), not long after.
    assert run.seconds["lost"] < NOTICE_S
    assert 0.8 * DRAFT_TIMEOUT_S <= run.seconds["hung"] < DRAFT_TIMEOUT_S + NOTICE_S
    # Speculation went on in every phase: before the kill, between the kill and the stop, while
    # draft-1 was stopped (until it was found hung, and after), and at the end, with both
    # process drafters gone.
    phases = list(run.counters.items())
    for (start, before), (end, after) in zip(phases, phases[1:]):
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            assert after[key] > before[key], f"{key} did not grow from {start} to {end}"
    final = run.log.drafter_stats()[-1]
    assert not final["draft-1"]["alive"] and not final["draft-2"]["alive"]
    assert final["draft-0"]["alive"] and final["draft-0"]["drafted_tokens"] > 0


def test_the_default_config_under_load_and_drafter_faults_is_lossless(family, tmp_path,
                                                                      reference):
    run = serve_with_faults(family, smurfs_config(family), tmp_path, before_signal=None)
    assert_answers_as_without_speculation(run, reference)
