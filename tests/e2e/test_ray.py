"""Drafters as Ray actors (``"placement": "ray"``) on a local Ray cluster bound to 127.0.0.1.

The target's worker starts the cluster (none is running here), the drafter's actor drafts beside
an in-worker drafter, and the output equals a run without speculation token for token; an actor
that dies mid-run costs speculation only, and its replacement rejoins. After the engine goes, no
Ray process of the run is left.
"""

import glob
import os
import subprocess
import sys

import pytest

from smurfs_tools.jobs import Job, divergences, run_job
from smurfs_tools.tiny_models import TINY_PROMPTS

from conftest import LOOKAHEAD, MAX_TOKENS

pytest.importorskip("ray", reason="the 'ray' extra is not installed")
pytestmark = pytest.mark.e2e

FAULT_MAX_TOKENS = 200
# Engine steps the first actor runs before it dies: early in the run.
FAULT_AFTER_STEPS = 100
RAY_PROCESSES = ("gcs_server", "raylet")


def ray_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    # An exited process not reaped yet (<defunct>) is not left running.
    return [line for line in out.splitlines()
            if any(name in line for name in RAY_PROCESSES) and "<defunct>" not in line]


def ray_config(family, **extra) -> dict:
    """One in-worker drafter and one Ray-actor drafter, fixed lookahead, pipelined."""
    return {"method": "smurfs", "num_speculative_tokens": LOOKAHEAD,
            "drafters": [{"model": family.drafts[0]},
                         {"model": family.drafts[1], "placement": "ray", "name": "ray-draft",
                          "ray_options": {"num_cpus": 0}}],
            "lookahead": {"policy": "fixed"}, **extra}


def run(family, spec, max_tokens, env=None, one_at_a_time=False):
    before = ray_processes()
    result = run_job(Job(target=family.target, prompts=list(TINY_PROMPTS),
                         speculative_config=spec, max_tokens=max_tokens,
                         env={"RAY_ADDRESS": "", **(env or {})}, one_at_a_time=one_at_a_time))
    print(f"\nelapsed {result.elapsed_s:.2f} s, {result.smurfs_stats}")
    assert ray_processes() == before, "the run left Ray processes behind"
    return result


def test_a_ray_drafter_beside_an_in_worker_drafter_is_lossless(family, greedy_runs):
    result = run(family, ray_config(family), MAX_TOKENS)
    assert divergences(greedy_runs("none").token_ids, result.token_ids) == {}
    stats = {d["name"]: d for d in result.smurfs_stats["drafters"]}
    ray_stats = stats["ray-draft"]
    assert ray_stats["alive"] and ray_stats["replacements"] == 0
    assert ray_stats["engine_steps"] > 0 and ray_stats["drafted_tokens"] > 0
    assert ray_stats["accepted_tokens"] > 0  # its drafts were voted for and verified
    assert stats["draft-0"]["drafted_tokens"] > 0


def test_a_ray_actor_killed_mid_run_costs_speculation_only(family):
    reference = run_job(Job(target=family.target, prompts=list(TINY_PROMPTS),
                            max_tokens=FAULT_MAX_TOKENS))
    result = run(family, ray_config(family), FAULT_MAX_TOKENS,
                 env={"SMURFS_DRAFTER_FAULT": f"ray-draft=exit_after:{FAULT_AFTER_STEPS}"})
    assert divergences(reference.token_ids, result.token_ids) == {}
    stats = {d["name"]: d for d in result.smurfs_stats["drafters"]}
    assert stats["ray-draft"]["replacements"] == 1  # its actor died; a replacement was started
    # The in-worker drafter kept drafting after the Ray drafter was lost.
    assert stats["draft-0"]["drafted_tokens"] > 0 and result.num_accepted_tokens > 0
    assert result.smurfs_stats["steps_without_models"] == 0


def test_a_lost_actor_is_replaced_and_the_replacement_drafts(family):
    """The client alone, on a real actor and engine: SIGKILL the actor, and a replacement
    rejoins (an engine's start-up takes seconds: too long to wait for inside a short run, where
    the target's threads also take every core)."""
    script = f"""
import logging, os, time
import numpy as np
logging.basicConfig(level=logging.INFO)
from vllm_smurfs.config import ModelDrafterConfig
from vllm_smurfs.ray_drafter import RayDrafterClient

spec = ModelDrafterConfig(model={family.drafts[0]!r}, placement="ray", dtype="float32")
client = RayDrafterClient(spec, "float32", 256, 4, False, hang_timeout_s=5.0)
client.start()
client.wait_ready(120)
context = np.arange(5, 25, dtype=np.int32)

def draft():
    client.track([("r", context, 4, len(context))])
    deadline = time.monotonic() + 30
    while len(client.draft_for("r", context, 4)) < 4 and time.monotonic() < deadline:
        client.poll(0.01)
    return client.draft_for("r", context, 4)

first = draft()
os.kill(client.health.extra["pid"], 9)
deadline = time.monotonic() + 120
while not (client.alive and client.replacements) and time.monotonic() < deadline:
    client.poll(0.01)
    time.sleep(0.05)
print("RESULT", client.alive, client.replacements, first == draft(), len(first))
client.close()
"""
    before = ray_processes()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "RAY_ADDRESS": ""})
    assert ray_processes() == before, "the client left Ray processes behind"
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert lines, out.stdout[-2000:] + out.stderr[-4000:]
    assert lines[0] == "RESULT True 1 True 4"  # rejoined once; drafts as the first actor did
    assert "is lost" in out.stderr and "replacement 1" in out.stderr  # named in the log


# Two tensor-parallel workers, one core each (vLLM-CPU binds one worker per NUMA node unless told).
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def ray_sessions() -> set[str]:
    return set(glob.glob("/tmp/ray/session_2*"))


def test_a_target_in_two_tensor_parallel_workers_drafts_on_one_rank_only(family):
    """vLLM-CPU 0.32.0 has no Ray executor (its platform names no Ray device), so the target is
    split by the multiprocess executor here; what is checked is Smurfs' side: one rank starts
    the drafters (one Ray cluster, one actor), and every rank verifies the same drafts."""
    engine_args = {"tensor_parallel_size": 2}
    reference = run_job(Job(target=family.target, prompts=list(TINY_PROMPTS),
                            max_tokens=MAX_TOKENS, engine_args=engine_args, env=TP2_ENV))
    spec = {"method": "smurfs", "num_speculative_tokens": LOOKAHEAD,
            "drafters": [{"model": family.drafts[1], "placement": "ray", "name": "ray-draft"},
                         {"method": "ngram"}], "lookahead": {"policy": "fixed"}}
    sessions = ray_sessions()
    before = ray_processes()
    result = run_job(Job(target=family.target, prompts=list(TINY_PROMPTS), max_tokens=MAX_TOKENS,
                         speculative_config=spec, engine_args=engine_args,
                         env={"RAY_ADDRESS": "", **TP2_ENV}))
    print(f"\n{result.smurfs_stats}")
    assert ray_processes() == before, "the run left Ray processes behind"
    assert len(ray_sessions() - sessions) == 1  # one rank started a cluster, not two
    assert divergences(reference.token_ids, result.token_ids) == {}
    ray_stats = {d["name"]: d for d in result.smurfs_stats["drafters"]}["ray-draft"]
    assert ray_stats["drafted_tokens"] > 0 and ray_stats["accepted_tokens"] > 0

