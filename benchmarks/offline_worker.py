"""Child process of `benchmarks run`: one vLLM engine, prompts timed one at a time (and batched).

    python -m benchmarks.offline_worker job.json events.jsonl

Modelled on `smurfs_tools.jobs`, which times one `generate` call over all prompts; batch-1
latency needs one `generate` call per prompt in the same engine, each with its own timing and its
own acceptance counters. Events are appended to a JSON-lines file as they happen, so a method that
dies half-way still leaves the prompts it finished:

    {"event": "started", "startup_s": ..., "pid": ...}
    {"event": "ready"}  (warmed up; a gated worker now waits for its first go)
    {"event": "batch1", "prompt_index": i, "elapsed_s": ..., "output_token_ids": [...],
     "prefill_s": ..., "decode_s": ..., ...}
    {"event": "batched", "elapsed_s": ..., "outputs": [{"prompt_index": i, ...}], counters...}
    {"event": "done"}

The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set by the parent) so the
thread placement the parent gives it through the environment is the target's.

A gated job (``"gated": true``, `benchmarks run --interleave`) runs beside the other methods'
workers: before each timed call (each batch-1 prompt, the batched call) it reads a line from
stdin, written by the parent when it is this worker's turn, so that only one method computes at a
time and every prompt is timed for every method within seconds of each other. End of input stops
the worker.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from vllm_smurfs.metrics import get_smurfs_stats, stats_delta
from smurfs_tools.jobs import counter_delta, spec_counters

#: A short prompt outside the benchmark, run once before timing (first-call costs).
WARMUP_PROMPT = "Hello"


def _output_record(output: Any) -> dict[str, Any]:
    completion = output.outputs[0]
    record = {"output_token_ids": list(completion.token_ids), "text": completion.text,
              "num_output_tokens": len(completion.token_ids),
              "finish_reason": completion.finish_reason}
    # The engine's own timestamps (monotonic, kept with log stats on): the prompt's step(s)
    # until the first token, then decoding until the last.
    stats = getattr(output, "metrics", None)
    if getattr(stats, "first_token_ts", 0.0) and getattr(stats, "scheduled_ts", 0.0):
        record["prefill_s"] = stats.first_token_ts - stats.scheduled_ts
        record["decode_s"] = stats.last_token_ts - stats.first_token_ts
    return record


def _snapshot(llm: Any, smurfs: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """vLLM's speculative-decoding counters, and Smurfs' own figures when it runs."""
    return spec_counters(llm), get_smurfs_stats(llm) if smurfs else None


def _since(llm: Any, snapshot: tuple[dict[str, Any], dict[str, Any] | None]) -> dict[str, Any]:
    """What the counters (and Smurfs' figures, as ``smurfs_stats``) gained since ``snapshot``."""
    counters, smurfs_before = snapshot
    out = counter_delta(spec_counters(llm), counters)
    if smurfs_before is not None:
        out["smurfs_stats"] = stats_delta(get_smurfs_stats(llm), smurfs_before)
    return out


def run(job: dict[str, Any], events_path: str) -> None:
    def emit(event: dict[str, Any]) -> None:
        with open(events_path, "a") as f:
            f.write(json.dumps(event) + "\n")

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(model=job["target"], dtype=job["dtype"], max_model_len=job["max_model_len"],
              seed=job.get("seed", 0), enforce_eager=True, disable_log_stats=False,
              speculative_config=job["speculative_config"])
    emit({"event": "started", "startup_s": time.perf_counter() - started, "pid": os.getpid()})
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=job["temperature"],
                            seed=job.get("seed", 0))
    prompts = [TokensPrompt(prompt_token_ids=p["prompt_token_ids"]) for p in job["prompts"]]
    indices = [p["index"] for p in job["prompts"]]

    llm.generate([WARMUP_PROMPT], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    emit({"event": "ready"})

    def turn() -> None:
        """A gated worker's wait for its turn (SystemExit at end of input: the parent gave up)."""
        if job.get("gated") and not sys.stdin.readline():
            raise SystemExit("end of input before the next timed call")

    smurfs = (job["speculative_config"] or {}).get("method") == "smurfs"
    if "batch1" in job["loads"]:
        for index, prompt in zip(indices, prompts):
            turn()
            before = _snapshot(llm, smurfs)
            t0 = time.perf_counter()
            [output] = llm.generate([prompt], params, use_tqdm=False)
            elapsed_s = time.perf_counter() - t0
            emit({"event": "batch1", "prompt_index": index, "elapsed_s": elapsed_s,
                  **_output_record(output), **_since(llm, before)})

    if "batched" in job["loads"]:
        # Prompts of the batch-1 pass would otherwise be served from the prefix cache.
        llm.reset_prefix_cache()
        turn()
        before = _snapshot(llm, smurfs)
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed_s = time.perf_counter() - t0
        emit({"event": "batched", "elapsed_s": elapsed_s,
              "outputs": [{"prompt_index": i, **_output_record(o)}
                          for i, o in zip(indices, outputs)],
              **_since(llm, before)})
    emit({"event": "done"})


def main() -> None:
    job_path, events_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    run(job, events_path)


if __name__ == "__main__":
    main()
