"""A generation job in two phases, the engine kept stepping between them: for the Ray fault tests.

    python ray_fault_job.py JOB.json OUT.json

A drafter killed in phase 1 is replaced, and a replacement takes seconds to start (its own
engine) while the tiny test models generate a whole phase in one or two: one run would end first.
Between the phases the engine steps on a short request at a time (the drafters are polled only in
engine steps) until ``until`` holds: "replaced" (the Ray drafter named ``drafter`` is alive again
with a replacement) or "seconds" (``seconds`` have passed), at most ``timeout_s``. Then phase 2
runs the same prompts. Each phase's outputs are compared with a run without speculation by the
test; the Smurfs figures before and after each phase, and markers in the log ("### phase N
done"), show what happened when.

JOB.json: {"target", "speculative_config", "prompts", "max_tokens", "drafter", "until",
           "seconds", "timeout_s"}
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def _drafter(stats: dict[str, Any], name: str) -> dict[str, Any]:
    return {d["name"]: d for d in stats["drafters"]}[name]


def main() -> None:
    from vllm import LLM, SamplingParams

    from vllm_smurfs.metrics import get_smurfs_stats

    with open(sys.argv[1]) as f:
        job = json.load(f)
    llm = LLM(model=job["target"], dtype="float32", max_model_len=512, seed=0,
              enforce_eager=True, disable_log_stats=False,
              speculative_config=job["speculative_config"])
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0)
    busy = SamplingParams(max_tokens=8, temperature=0.0)
    # No warm-up request: a fault set to hit after N drafter steps hits in phase 1.
    out: dict[str, Any] = {"phases": []}
    for phase in (1, 2):
        llm.reset_prefix_cache()
        before = get_smurfs_stats(llm)
        outputs = llm.generate(job["prompts"], params, use_tqdm=False)
        after = get_smurfs_stats(llm)
        out["phases"].append({"token_ids": [list(o.outputs[0].token_ids) for o in outputs],
                              "before": before, "after": after})
        print(f"### phase {phase} done", flush=True)
        if phase == 2:
            break
        started = time.monotonic()
        while time.monotonic() - started < job["timeout_s"]:
            drafter = _drafter(get_smurfs_stats(llm), job["drafter"])
            if job["until"] == "replaced" and drafter["alive"] and drafter.get("replacements"):
                break
            if job["until"] == "seconds" and time.monotonic() - started >= job["seconds"]:
                break
            llm.generate(["keep the engine stepping"], busy, use_tqdm=False)
            time.sleep(0.1)  # and leave the cores to a replacement's engine start now and then
        out["between_s"] = round(time.monotonic() - started, 1)
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
