"""Run one offline generation job in a fresh process and return its tokens and acceptance figures.

The demo and the end-to-end tests compare several engines (no speculation, vLLM's draft_model,
Smurfs) on the same prompts. Each engine runs in its own process: vLLM engines do not tear down
cleanly inside one process, and a fresh process gives every method the same start.

    result = run_job(Job(target=..., prompts=[...], speculative_config={...}))
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from vllm_smurfs.metrics import get_smurfs_stats, mean_acceptance_length, stats_delta


@dataclass
class Job:
    target: str
    prompts: list[str]
    speculative_config: dict[str, Any] | None = None
    max_tokens: list[int] | int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: none
    seeds: list[int] | None = None  # one sampling seed per prompt (for temperature > 0)
    # The engine's seed (its random streams at temperature > 0): runs compared statistically
    # need seeds of their own, or they share their randomness.
    seed: int = 0
    dtype: str = "float32"
    max_model_len: int = 512
    chat_template: bool = False  # apply the tokenizer's chat template to each prompt
    env: dict[str, str] = field(default_factory=dict)  # "" unsets a variable
    # Further `LLM(...)` arguments (e.g. max_num_seqs, max_num_batched_tokens, block_size).
    engine_args: dict[str, Any] = field(default_factory=dict)
    # Driving the engine step by step instead of one generate() call: prompt i joins at engine
    # step arrive_at[i] (default 0), and is aborted once its output has abort_after[i] tokens.
    arrive_at: dict[int, int] = field(default_factory=dict)
    abort_after: dict[int, int] = field(default_factory=dict)
    one_at_a_time: bool = False  # batch 1: each prompt generated alone, in order
    # Test-only instrumentation: Python files run in the job's process before its engine starts
    # (e.g. tests/e2e/lossy_verifier.py, which breaks the verifier for a control run). The engine
    # is in that process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so what they patch is what it runs.
    preload: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # JSON (the job travels to its process as JSON) turns integer keys into strings.
        self.arrive_at = {int(k): v for k, v in self.arrive_at.items()}
        self.abort_after = {int(k): v for k, v in self.abort_after.items()}


@dataclass
class Result:
    token_ids: list[list[int]]
    texts: list[str]
    elapsed_s: float  # generate() only, not start-up
    startup_s: float
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    smurfs_stats: dict[str, Any] | None = None  # of the measured generate() only
    num_preemptions: int = 0  # requests the scheduler preempted in the measured run
    aborted: list[int] = field(default_factory=list)  # prompts aborted (outputs: until then)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / drafts: tokens produced per verified draft."""
        return mean_acceptance_length(self.num_accepted_tokens, self.num_drafts)

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / self.num_drafts for a in self.accepted_per_position] if self.num_drafts else []


def first_divergence(reference: list[int], other: list[int]) -> int | None:
    """First position where two outputs differ (a length difference counts), None if equal."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def divergences(reference: list[list[int]], other: list[list[int]]) -> dict[int, int]:
    """{prompt index: first divergent position} over all prompts; empty when identical."""
    if len(reference) != len(other):
        raise ValueError(f"{len(reference)} reference outputs but {len(other)} to compare")
    found = {i: first_divergence(a, b) for i, (a, b) in enumerate(zip(reference, other))}
    return {i: pos for i, pos in found.items() if pos is not None}


def run_job(job: Job, timeout_s: float = 900.0) -> Result:
    """Run ``job`` in a child process (in-process engine there) and return its result."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(job.env)
    env = {k: v for k, v in env.items() if v != ""}  # an empty value in job.env unsets it
    with tempfile.TemporaryDirectory(prefix="smurfs-job-") as tmp:
        job_path, result_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "result.json")
        with open(job_path, "w") as f:
            json.dump(asdict(job), f)
        proc = subprocess.run([sys.executable, "-m", "smurfs_tools.jobs", job_path, result_path],
                              env=env, timeout=timeout_s, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(result_path):
            raise RuntimeError(f"generation job failed (exit {proc.returncode}):\n"
                               f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
        with open(result_path) as f:
            return Result(**json.load(f))


def _execute(job: Job) -> Result:
    import runpy

    for path in job.preload:
        runpy.run_path(path, run_name="smurfs_job_preload")
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=job.target, dtype=job.dtype, max_model_len=job.max_model_len, seed=job.seed,
              enforce_eager=True, disable_log_stats=False,
              speculative_config=job.speculative_config, **job.engine_args)
    startup_s = time.perf_counter() - started
    n = len(job.prompts)
    max_tokens = job.max_tokens if isinstance(job.max_tokens, list) else [job.max_tokens] * n
    seeds = job.seeds or [None] * n
    params = [SamplingParams(max_tokens=m, temperature=job.temperature, top_p=job.top_p,
                             top_k=job.top_k, seed=s)
              for m, s in zip(max_tokens, seeds)]
    tokenizer = llm.get_tokenizer()
    prompts: list[Any] = []
    for text in job.prompts:
        if job.chat_template:
            # return_dict=False: transformers 5 returns a BatchEncoding by default.
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
            prompts.append({"prompt_token_ids": list(ids)})
        else:
            prompts.append(text)
    # Warm-up: the first generate() pays one-time costs (kernel set-up, drafter caches) that
    # would otherwise be timed as generation.
    # A prompt of its own, and a cleared prefix cache, so no measured prompt starts cached.
    llm.generate(["warm up"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    llm.reset_prefix_cache()
    before, smurfs_before = spec_counters(llm), _smurfs_stats(llm)
    preemptions_before = _preemptions(llm)
    started = time.perf_counter()
    aborted: list[int] = []
    if job.arrive_at or job.abort_after:
        token_ids, texts, aborted = _drive(llm, job, prompts, params)
    else:
        if job.one_at_a_time:
            outputs = [llm.generate([p], [sp], use_tqdm=False)[0]
                       for p, sp in zip(prompts, params, strict=True)]
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        token_ids = [list(o.outputs[0].token_ids) for o in outputs]
        texts = [o.outputs[0].text for o in outputs]
    elapsed_s = time.perf_counter() - started
    counted = counter_delta(spec_counters(llm), before)
    smurfs_after = _smurfs_stats(llm)
    return Result(
        token_ids=token_ids,
        texts=texts,
        num_preemptions=_preemptions(llm) - preemptions_before,
        aborted=aborted,
        elapsed_s=elapsed_s,
        startup_s=startup_s,
        num_drafts=counted["num_drafts"],
        num_draft_tokens=counted["num_draft_tokens"],
        num_accepted_tokens=counted["num_accepted_tokens"],
        accepted_per_position=counted["accepted_per_position"],
        smurfs_stats=(stats_delta(smurfs_after, smurfs_before)
                      if smurfs_after is not None and smurfs_before is not None else None),
    )


def _drive(llm: Any, job: Job, prompts: list[Any], params: list[Any]
           ) -> tuple[list[list[int]], list[str], list[int]]:
    """Step the engine by hand: prompts join at their step, some are aborted midway."""
    engine = llm.llm_engine
    ids = [f"job-{i}" for i in range(len(prompts))]
    pending = sorted(range(len(prompts)), key=lambda i: job.arrive_at.get(i, 0))
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    texts: dict[int, str] = {i: "" for i in range(len(prompts))}
    done: set[int] = set()
    aborted: list[int] = []
    step = 0
    while len(done) < len(prompts):
        while pending and job.arrive_at.get(pending[0], 0) <= step:
            i = pending.pop(0)
            engine.add_request(ids[i], prompts[i], params[i])
        if not engine.has_unfinished_requests():
            step += 1
            continue
        for output in engine.step():
            i = ids.index(output.request_id)
            tokens[i] = list(output.outputs[0].token_ids)
            texts[i] = output.outputs[0].text
            if output.finished:
                done.add(i)
            elif i in job.abort_after and len(tokens[i]) >= job.abort_after[i]:
                engine.abort_request([ids[i]])
                aborted.append(i)
                done.add(i)
        step += 1
    return ([tokens[i] for i in range(len(prompts))], [texts[i] for i in range(len(prompts))],
            sorted(aborted))


def _preemptions(llm: Any) -> int:
    return sum(int(m.value) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def spec_counters(llm: Any) -> dict[str, Any]:
    """vLLM's cumulative speculative-decoding counters (zero without speculation)."""
    out: dict[str, Any] = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                           "accepted_per_position": []}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            out[name] = int(metric.value)
        elif name == "num_accepted_tokens_per_pos":
            out["accepted_per_position"] = [int(v) for v in metric.values]
    return out


def counter_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """What `spec_counters` counted between two snapshots."""
    per_pos_before = before["accepted_per_position"] or [0] * len(after["accepted_per_position"])
    return {
        "num_drafts": after["num_drafts"] - before["num_drafts"],
        "num_draft_tokens": after["num_draft_tokens"] - before["num_draft_tokens"],
        "num_accepted_tokens": after["num_accepted_tokens"] - before["num_accepted_tokens"],
        "accepted_per_position": [a - b for a, b in zip(after["accepted_per_position"],
                                                        per_pos_before)],
    }


def _smurfs_stats(llm: Any) -> dict[str, Any] | None:
    try:
        return get_smurfs_stats(llm)
    except Exception:  # noqa: BLE001 - not Smurfs, or a multiprocess engine refusing the RPC
        return None


def main() -> None:
    job_path, result_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = Job(**json.load(f))
    result = _execute(job)
    with open(result_path, "w") as f:
        json.dump(asdict(result), f)


if __name__ == "__main__":
    main()
