"""A model drafter's own process: one vLLM engine for one small draft model.

Started by `multi_draft_worker.ModelDrafterClient` with ``python -m vllm_smurfs.drafter_server``
(a subprocess, because vLLM workers are daemonic and may not fork children of their own). It
connects back to the client over a local socket and answers draft requests in order:

    -> ("draft", step, [(req_id, token_ids, k), ...])   <- ("drafts", step, [draft_tokens, ...])
    -> ("shutdown",)

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


def _draft(llm: Any, batch: list[tuple[str, list[int], int]]) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(tokens)) for _, tokens, _ in batch]
    params = [
        SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True, detokenize=False)
        for _, _, k in batch
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
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == "shutdown":
            return
        if message[0] == "draft":
            _, step, batch = message
            try:
                conn.send(("drafts", step, _draft(llm, batch)))
            except Exception:  # noqa: BLE001 - a failed step costs speculation only
                conn.send(("error", traceback.format_exc()))


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
