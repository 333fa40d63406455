"""A model drafter's own process: one vLLM engine for one small draft model.

Started by `multi_draft_worker.ModelDrafterClient` with ``python -m vllm_smurfs.drafter_server``
(a subprocess, because vLLM workers are daemonic and may not fork children of their own). It
connects back to the client over a local socket:

    -> ("draft", [(job_id, req_id, token_ids, n), ...])
    <- ("drafts", num_messages_taken, [(job_id, tokens), ...])
    -> ("forget", [req_id, ...])
    -> ("shutdown",)

Jobs are not answered one message at a time: before each engine call the server drains every
message waiting and keeps only the newest job of each request (a newer context supersedes an
older one, whose answer would be stale). So work in flight is bounded to one job per request, and
a client that sends drafts ahead never queues up work the target has already overtaken.

The engine is vLLM's own: paged KV cache, prefix caching (a request's next draft prefills only
the tokens accepted since its last one, plus the unfinished last block), and all requests of a
step batched into one ``generate`` call. Drafting is greedy.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

# Block size of the drafter's KV cache: prefix caching reuses whole blocks only, so small blocks
# re-prefill less per step; 32 is the smallest the CPU attention backend accepts.
DRAFTER_BLOCK_SIZE = 32


def _die_with_parent() -> None:
    """Ask the kernel to end this process when its parent dies (Linux)."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
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
        trust_remote_code=spec.get("trust_remote_code", False),
        disable_log_stats=True,
    )
    if current_platform.is_cpu():
        kwargs["block_size"] = DRAFTER_BLOCK_SIZE
        kwargs["kv_cache_memory_bytes"] = int(spec["kv_cache_gib"] * (1 << 30))
    else:
        kwargs["gpu_memory_utilization"] = spec["gpu_memory_utilization"]
    return LLM(**kwargs)


def _draft(llm: Any, batch: list[tuple[list[int], int]]) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=tokens) for tokens, _ in batch]
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
        for _, n in batch
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


def serve(address: str, authkey: bytes, spec: dict[str, Any]) -> None:
    from multiprocessing.connection import Client

    conn = Client(address, authkey=authkey)
    try:
        started = time.monotonic()
        llm = _build_engine(spec)
        vocab_size = llm.llm_engine.model_config.get_vocab_size()
        conn.send(("ready", {"pid": os.getpid(), "vocab_size": vocab_size,
                             "load_s": time.monotonic() - started,
                             "cpus": sorted(os.sched_getaffinity(0))}))
    except Exception:  # noqa: BLE001 - reported to the client, which decides
        conn.send(("error", traceback.format_exc()))
        return
    fault = _Fault(os.environ.get("SMURFS_DRAFTER_FAULT", ""), spec.get("name", ""))
    pending: dict[str, tuple[int, list[int], int]] = {}  # req_id -> newest (job_id, tokens, n)
    taken = 0  # messages read since the last answer (the client bounds what it has in flight)
    while True:
        try:
            # Block only when idle; then take everything that has arrived meanwhile.
            messages = [] if pending else [conn.recv()]
            while conn.poll(0):
                messages.append(conn.recv())
        except (EOFError, OSError):
            return
        taken += len(messages)
        for message in messages:
            if message[0] == "shutdown":
                return
            if message[0] == "forget":
                for req_id in message[1]:
                    pending.pop(req_id, None)
            elif message[0] == "draft":
                for job_id, req_id, tokens, n in message[1]:
                    pending[req_id] = (job_id, tokens, n)
        if not pending:
            continue
        jobs, pending = list(pending.values()), {}
        fault.before_step()
        try:
            drafts = _draft(llm, [(tokens, n) for _, tokens, n in jobs])
        except Exception:  # noqa: BLE001 - a failed step costs speculation only
            conn.send(("error", taken, traceback.format_exc()))
            taken = 0
            continue
        conn.send(("drafts", taken,
                   [(job_id, draft) for (job_id, _, _), draft in zip(jobs, drafts)]))
        taken = 0


class _Fault:
    """Fault injection for the fault tests: ``SMURFS_DRAFTER_FAULT=NAME=exit_after:N`` makes the
    drafter NAME die before its N+1-th engine call; ``NAME=hang_after:N`` makes it stop answering.
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
        self.steps += 1


def main() -> None:
    address, spec_json = sys.argv[1], sys.argv[2]
    authkey = bytes.fromhex(os.environ.pop("SMURFS_DRAFTER_AUTHKEY"))
    spec = json.loads(spec_json)
    _die_with_parent()
    # Placement first: threads created by torch inherit this affinity.
    if spec.get("cpus"):
        os.sched_setaffinity(0, spec["cpus"])
    serve(address, authkey, spec)


if __name__ == "__main__":
    main()
