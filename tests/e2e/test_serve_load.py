"""`vllm serve` with the default Smurfs config under load and faults answers as a server without
speculation does, token for token, and stays healthy.

64 requests, 32 at a time: prompts longer than two drafters' context, requests cancelled
mid-stream, `max_tokens` 1; one process drafter killed mid-run, another stopped (SIGSTOP) for
three times `draft_timeout_s` while requests are served.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import requests

from smurfs_tools.tiny_models import TINY_PROMPTS

from serving import vllm_server

pytestmark = pytest.mark.e2e

NUM_REQUESTS = 64
CONCURRENCY = 32
DRAFT_TIMEOUT_S = 1.0
STOP_S = 3 * DRAFT_TIMEOUT_S
DRAFTER_CONTEXT = 64  # max_model_len of two of the drafters; the long prompts are longer


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
        if "vllm_smurfs.drafter_server" in cmdline and json.dumps(model) in cmdline:
            found.append(int(pid))
    assert len(found) == 1, f"expected one drafter process for {model}, found {found}"
    return found[0]


def test_default_config_under_load_and_drafter_faults_is_lossless(family, tmp_path):
    asks = workload()
    config = {"method": "smurfs", "num_speculative_tokens": 4,
              "draft_timeout_s": DRAFT_TIMEOUT_S,
              "drafters": [
                  {"model": family.drafts[0], "max_model_len": DRAFTER_CONTEXT},
                  {"model": family.drafts[1], "placement": "process"},
                  {"model": family.drafts[2], "placement": "process",
                   "max_model_len": DRAFTER_CONTEXT},
                  {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}]}
    config_path = tmp_path / "smurfs.json"
    config_path.write_text(json.dumps(config))

    with vllm_server(family.target, tmp_path / "reference.log", []) as base:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            reference = list(pool.map(lambda a: None if a.cancel else complete(
                base, family.target, a), asks))

    events: list[str] = []
    with vllm_server(family.target, tmp_path / "smurfs.log",
                     ["--speculative-config", str(config_path)]) as base:
        killed, stopped = drafter_pid(family.drafts[1]), drafter_pid(family.drafts[2])
        done = threading.Semaphore(0)

        def one(ask: Ask) -> dict | None:
            try:
                return complete(base, family.target, ask)
            finally:
                done.release()

        with ThreadPoolExecutor(CONCURRENCY) as pool:
            first = [pool.submit(one, a) for a in asks[:CONCURRENCY]]
            for _ in range(8):
                done.acquire()
            done_at_kill = sum(f.done() for f in first)
            os.kill(killed, signal.SIGKILL)
            events.append(f"killed drafter {killed} with {done_at_kill} of {len(first)} done")
            os.kill(stopped, signal.SIGSTOP)
            try:
                stop_started = time.monotonic()
                done_at_stop = sum(f.done() for f in first)
                second = [pool.submit(one, a) for a in asks[CONCURRENCY:]]
                time.sleep(STOP_S)
                done_while_stopped = sum(f.done() for f in first + second) - done_at_stop
                events.append(f"stopped drafter {stopped} for {time.monotonic() - stop_started:.1f}"
                              f" s: {done_while_stopped} requests finished meanwhile")
            finally:
                os.kill(stopped, signal.SIGCONT)
            answers = [f.result() for f in first + second]
        print("\n" + "\n".join(events))
        assert requests.get(f"{base}/health", timeout=10).status_code == 200
        again = complete(base, family.target, asks[1])

    assert done_at_kill < len(first), "the kill came after the work: " + events[0]
    # Requests went on while a drafter was stopped past its timeout: nothing waited for it.
    assert done_while_stopped > 0, events[1]
    for i, (ask, want, got) in enumerate(zip(asks, reference, answers, strict=True)):
        if ask.cancel:
            continue
        assert got == want, f"request {i} (max_tokens {ask.max_tokens}) differs"
        assert got["tokens"] == ask.max_tokens
    assert again == reference[1]
