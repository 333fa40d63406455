"""The proposer's own time per step (vote, controller, bookkeeping): what Smurfs adds to the
target's path beyond the drafters' forwards and waiting for drafts.

    python -m benchmarks.proposer_overhead --target T --draft D --out overhead.json

Per placement (in-worker, process) at batch 1 and at 32 requests, Smurfs' default config (the
draft model and the n-gram voter) on Spec-Bench prompts; from the proposer's own counters:
``(proposer_s - drafting_s - wait_s) / steps`` against ``target_step_s / steps``. Issue 16 asks
for under 2% of the target's step. Each run is an engine in its own process
(`smurfs_tools.jobs`); the JSON carries the provenance of the run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.cli import DEFAULT_DATASET
from benchmarks.provenance import provenance
from benchmarks.spec_bench import load_questions
from smurfs_tools.jobs import Job, run_job


def measure(target: str, draft: str, placement: str, prompts: list[str], max_tokens: int,
            dtype: str) -> dict[str, float | int | str]:
    spec = {"method": "smurfs", "num_speculative_tokens": 6,
            "drafters": [{"model": draft, "placement": placement},
                         {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}]}
    result = run_job(Job(target=target, prompts=prompts, speculative_config=spec,
                         max_tokens=max_tokens, dtype=dtype, max_model_len=2048,
                         chat_template=True))
    stats = result.smurfs_stats
    assert stats is not None
    steps = stats["steps"]
    own_s = stats["proposer_s"] - stats["drafting_s"] - stats["wait_s"]
    return {"placement": placement, "batch": len(prompts), "steps": steps,
            "target_ms_per_step": 1000 * stats["target_step_s"] / steps,
            "drafting_ms_per_step": 1000 * stats["drafting_s"] / steps,
            "wait_ms_per_step": 1000 * stats["wait_s"] / steps,
            "proposer_own_ms_per_step": 1000 * own_s / steps,
            "proposer_own_share_of_target": own_s / stats["target_step_s"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--questions", default=DEFAULT_DATASET)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    prompts = [q["turns"][0] for q in load_questions(args.questions)[::10]][:32]
    rows = []
    for placement in ("worker", "process"):
        for batch, max_tokens in ((1, 96), (32, 24)):
            row = measure(args.target, args.draft, placement, prompts[:batch], max_tokens,
                          args.dtype)
            print(json.dumps(row), flush=True)
            rows.append(row)
    argv_used = ["proposer_overhead", *(argv if argv is not None else sys.argv[1:])]
    Path(args.out).write_text(json.dumps({"provenance": provenance(argv_used, args.dtype),
                                          "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
