"""One engine with a recorder in its worker (tests/e2e/test_lifecycle.py, test_drafter_kinds.py).

    python step_probe.py JOB.json RESULT.json     (or `run_probe` from a test)

Runs the real vLLM CPU engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and records,
step by step, what the runner saw and what reached the Smurfs proposer: each ``execute_model``
call (tokens scheduled; finished, preempted and resumed requests), each
``propose_draft_token_ids`` call (the proposer's `live_request_state` as it starts; the drafts
it hands vLLM: how many tokens, the largest id), each ``forget``. The recorder wraps the runner's and the proposer's methods on the instances: the
engine, the patches and the proposer run unchanged. ``generate`` runs ``rounds`` times on one
`LLM`; after each, the engine core settles as a serving engine core does (it keeps stepping while
its scheduler holds requests, finished ones included: the last step carries the last finished
requests to the worker, with nothing to compute), and the proposer's `live_request_state` is
recorded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

EVENTS: list[dict[str, Any]] = []


def _install_recorder(worker: Any) -> bool:
    runner = worker.model_runner
    proposer = runner.drafter
    runner_cls = type(runner)

    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        cached = scheduler_output.scheduled_cached_reqs
        EVENTS.append({
            "kind": "exec", "tokens": scheduler_output.total_num_scheduled_tokens,
            "finished": sorted(scheduler_output.finished_req_ids),
            "preempted": sorted(scheduler_output.preempted_req_ids or ()),
            "resumed": sorted(cached.resumed_req_ids)})
        return runner_cls.execute_model(runner, scheduler_output, *args, **kwargs)

    def propose_draft_token_ids(*args: Any, **kwargs: Any) -> Any:
        event = {"kind": "propose", "state": proposer.live_request_state()}
        EVENTS.append(event)
        drafts = runner_cls.propose_draft_token_ids(runner, *args, **kwargs)
        event["draft_tokens"] = sum(len(d) for d in drafts)
        event["max_draft_id"] = max((t for d in drafts for t in d), default=-1)
        return drafts

    forget = proposer.forget

    def recorded_forget(req_ids: Any) -> None:
        req_ids = list(req_ids)
        EVENTS.append({"kind": "forget", "ids": sorted(req_ids)})
        forget(req_ids)

    runner.execute_model = execute_model
    runner.propose_draft_token_ids = propose_draft_token_ids
    proposer.forget = recorded_forget
    return True


def _live_state(worker: Any) -> dict[str, int]:
    return worker.model_runner.drafter.live_request_state()


def _events(worker: Any) -> list[dict[str, Any]]:
    return list(EVENTS)


def run_probe(target: str, spec: dict, rounds: int, **job: Any) -> dict:
    """Run this script on a job in a fresh process; its recorded result."""
    job = {"target": target, "speculative_config": spec, "rounds": rounds, **job}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    if "kv_cache_memory_bytes" in job["engine_args"]:
        del env["VLLM_CPU_KVCACHE_SPACE"]  # it would override kv_cache_memory_bytes
    with tempfile.TemporaryDirectory(prefix="smurfs-probe-") as tmp:
        job_path, result_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "result.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        proc = subprocess.run([sys.executable, __file__, job_path, result_path], env=env,
                              capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"probe failed (exit {proc.returncode}):\n{proc.stderr[-8000:]}")
        with open(result_path) as f:
            return json.load(f)


def group_steps(result: dict) -> list[dict]:
    """The recorded events grouped by step: its execute_model call, the propose call after it
    (None when vLLM skipped it), and the ids the proposer forgot in it."""
    out: list[dict] = []
    for event in result["events"]:
        if event["kind"] == "exec":
            out.append({"exec": event, "propose": None, "forgot": set()})
        elif event["kind"] == "propose":
            out[-1]["propose"] = event
        else:
            out[-1]["forgot"].update(event["ids"])
    return out


def main() -> None:
    from vllm import LLM, SamplingParams

    with open(sys.argv[1]) as f:
        job = json.load(f)
    llm = LLM(model=job["target"], dtype="float32", max_model_len=job["max_model_len"], seed=0,
              enforce_eager=True, disable_log_stats=False,
              speculative_config=job["speculative_config"], **job["engine_args"])
    llm.collective_rpc(_install_recorder)
    max_tokens = job["max_tokens"]
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(job["prompts"])
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in max_tokens]
    rounds = []
    for _ in range(job["rounds"]):
        outputs = llm.generate(job["prompts"], params, use_tqdm=False)
        core = llm.llm_engine.engine_core.engine_core  # in-process: the EngineCore itself
        while core.scheduler.has_requests():
            llm.llm_engine.step()
        rounds.append({"token_ids": [list(o.outputs[0].token_ids) for o in outputs],
                       "prompt_lens": [len(o.prompt_token_ids) for o in outputs],
                       "live_state": llm.collective_rpc(_live_state)[0]})
    preemptions = sum(int(m.value) for m in llm.get_metrics()
                      if m.name == "vllm:num_preemptions")
    with open(sys.argv[2], "w") as f:
        json.dump({"rounds": rounds, "events": llm.collective_rpc(_events)[0],
                   "preemptions": preemptions}, f)


if __name__ == "__main__":
    main()
