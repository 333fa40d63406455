"""Drafters as Ray actors (``"placement": "ray"``) on a local Ray cluster bound to 127.0.0.1.

The target's worker starts the cluster (none is named: ``RAY_ADDRESS`` is unset), the drafter's
actor drafts beside an in-worker drafter, and the output equals a run without speculation token
for token; an actor that dies mid-run costs speculation only, and its replacement rejoins and
drafts. After the engine goes, no Ray process of the run is left. Every run has a home folder of
its own, in which Ray must leave nothing (Ray 2.60 writes a token to ``~/.ray/auth_token`` for a
cluster that ``ray.init()`` starts, after which every ``ray start`` on the machine turns token
authentication on); the real home folder is checked too. (A cluster the user started:
tests/e2e/test_ray_cluster.py.)
"""

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from smurfs_tools.jobs import Job, Result, divergences, run_job
from smurfs_tools.tiny_models import TINY_PROMPTS

from conftest import LOOKAHEAD, MAX_TOKENS, fail_on_phase_divergence
from ray_cluster_scenario import run_job as run_job_with_log
from ray_cluster_scenario import run_phases

pytest.importorskip("ray", reason="the 'ray' extra is not installed")
pytestmark = pytest.mark.e2e

FAULT_MAX_TOKENS = 200
# Engine steps the first actor runs before it dies: early in phase 1.
FAULT_AFTER_STEPS = 20
RAY_PROCESSES = ("gcs_server", "raylet")
REAL_TOKEN = Path.home() / ".ray" / "auth_token"


def ray_processes() -> list[str]:
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True,
                         text=True).stdout
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


def _token_file_state() -> tuple[bool, float | None]:
    return REAL_TOKEN.exists(), REAL_TOKEN.stat().st_mtime if REAL_TOKEN.exists() else None


def run(family, spec, max_tokens, home: Path, env=None) -> tuple[Result, str]:
    """The job (RAY_ADDRESS unset, ``home`` as its home folder) and its log; nothing of Ray's
    may be left running, nor in either home folder."""
    home.mkdir(exist_ok=True)
    before, real_token = ray_processes(), _token_file_state()
    job_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    job_env.update(HOME=str(home), VLLM_ENABLE_V1_MULTIPROCESSING="0", **(env or {}))
    result, error, log = run_job_with_log(
        Job(target=family.target, prompts=list(TINY_PROMPTS), speculative_config=spec,
            max_tokens=max_tokens), job_env, timeout_s=900)
    assert result is not None, f"job failed ({error}):\n{log[-8000:]}"
    print(f"\nelapsed {result.elapsed_s:.2f} s, {result.smurfs_stats}")
    assert ray_processes() == before, "the run left Ray processes behind"
    assert not (home / ".ray").exists(), list((home / ".ray").iterdir())
    assert _token_file_state() == real_token
    return result, log


def test_a_ray_drafter_beside_an_in_worker_drafter_is_lossless(family, greedy_runs, tmp_path):
    result, log = run(family, ray_config(family), MAX_TOKENS, tmp_path / "home")
    assert "started a local Ray cluster on 127.0.0.1" in log
    assert divergences(greedy_runs("none").token_ids, result.token_ids) == {}
    stats = {d["name"]: d for d in result.smurfs_stats["drafters"]}
    ray_stats = stats["ray-draft"]
    assert ray_stats["alive"] and ray_stats["replacements"] == 0
    assert ray_stats["engine_steps"] > 0 and ray_stats["drafted_tokens"] > 0
    assert ray_stats["accepted_tokens"] > 0  # its drafts were voted for and verified
    assert stats["draft-0"]["drafted_tokens"] > 0


def test_an_actor_no_node_can_place_is_reported_and_speculation_goes_on(family, greedy_runs,
                                                                         tmp_path):
    """The drafter asks for a resource no node of the cluster has: reported at once, naming what
    it asks for; the engine starts without waiting for it (not draft_timeout_s, not the 600 s an
    engine start may take), and the in-worker drafter drafts alone."""
    spec = ray_config(family, draft_timeout_s=60.0)
    spec["drafters"][1]["ray_options"] = {"resources": {"no_such_node": 1}}
    result, log = run(family, spec, MAX_TOKENS, tmp_path / "home")
    assert divergences(greedy_runs("none").token_ids, result.token_ids) == {}
    assert ("Smurfs drafter ray-draft: its Ray actor is not placed: it asks for "
            "{'no_such_node': 1.0}; no alive node of the cluster has them (nodes: 127.0.0.1: "
            "{'no_such_node': 0.0}). Speculation goes on without it") in log
    assert result.startup_s < 60.0  # it did not wait draft_timeout_s for the actor
    stats = {d["name"]: d for d in result.smurfs_stats["drafters"]}
    assert not stats["ray-draft"]["alive"] and stats["ray-draft"]["drafted_tokens"] == 0
    assert stats["draft-0"]["drafted_tokens"] > 0 and result.num_accepted_tokens > 0


def test_a_ray_actor_killed_mid_run_costs_speculation_only(family, tmp_path):
    """The Ray drafter's actor dies (os._exit) after its 20th engine step, in phase 1 of a
    two-phase job (`ray_fault_job.py`: the engine keeps stepping between the phases until the
    replacement is up, which takes an engine start). Every output of both phases equals the run
    without speculation; the first actor drafted before it died, and its replacement rejoined
    and drafted again in phase 2."""
    reference = run_job(Job(target=family.target, prompts=list(TINY_PROMPTS),
                            max_tokens=FAULT_MAX_TOKENS))
    home = tmp_path / "home"
    home.mkdir()
    before, real_token = ray_processes(), _token_file_state()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(HOME=str(home), VLLM_ENABLE_V1_MULTIPROCESSING="0",
               SMURFS_DRAFTER_FAULT=f"ray-draft=exit_after:{FAULT_AFTER_STEPS}")
    job = {"target": family.target, "speculative_config": ray_config(family),
           "prompts": list(TINY_PROMPTS), "max_tokens": FAULT_MAX_TOKENS,
           "drafter": "ray-draft", "until": "replaced", "timeout_s": 180.0}
    out, error, log = run_phases(job, env, timeout_s=900)
    assert out is not None, f"job failed ({error}):\n{log[-8000:]}"
    assert ray_processes() == before, "the run left Ray processes behind"
    assert not (home / ".ray").exists() and _token_file_state() == real_token
    first, second = out["phases"]
    print(f"\nbetween the phases {out['between_s']} s; {json.dumps(second['after'])}")
    fail_on_phase_divergence(reference, [first, second], family.target, FAULT_MAX_TOKENS, log)

    def ray_draft(stats):
        return {d["name"]: d for d in stats["drafters"]}["ray-draft"]

    def drafted(phase, name="ray-draft"):
        entries = [{d["name"]: d for d in phase[k]["drafters"]}[name] for k in ("before", "after")]
        return entries[1]["drafted_tokens"] - entries[0]["drafted_tokens"]

    # It died in phase 1, not in the warm-up (replacements is a running total)...
    assert ray_draft(first["before"])["replacements"] == 0 and ray_draft(first["before"])["alive"]
    assert ray_draft(first["after"])["replacements"] == 1
    # ... and had drafted: phase 1's drafts are the first actor's, its replacement being ready
    # only after phase 1 ended.
    lost, phase_1_done = log.index("ray-draft (Ray actor on node"), log.index("### phase 1 done")
    rejoined = log.index("(replacement 1)", log.index("Smurfs drafter ray-draft ready as a Ray"))
    assert lost < phase_1_done < rejoined
    assert drafted(first) > 0
    # The replacement rejoined and drafted again.
    assert ray_draft(second["before"])["alive"] and ray_draft(second["after"])["replacements"] == 1
    assert drafted(second) > 0
    # The in-worker drafter drafted all along.
    assert drafted(first, "draft-0") > 0 and drafted(second, "draft-0") > 0


def test_a_lost_actor_is_replaced_and_the_replacement_drafts(family, tmp_path):
    """The client alone, on a real actor and engine: SIGKILL the actor, and a replacement
    rejoins (an engine's start-up takes seconds: too long to wait for inside a short run, where
    the target's threads also take every core)."""
    script = f"""
import logging, os, time
import numpy as np
logging.basicConfig(level=logging.INFO)
from vllm_smurfs.config import ModelDrafterConfig
from vllm_smurfs.drafters.ray_actor import RayDrafterClient

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
    before, real_token = ray_processes(), _token_file_state()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, env={**env, "HOME": str(tmp_path)})
    assert ray_processes() == before, "the client left Ray processes behind"
    assert not (tmp_path / ".ray").exists() and _token_file_state() == real_token
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert lines, out.stdout[-2000:] + out.stderr[-4000:]
    assert lines[0] == "RESULT True 1 True 4"  # rejoined once; drafts as the first actor did
    assert "is lost" in out.stderr and "replacement 1" in out.stderr  # named in the log


# Two tensor-parallel workers, one core each (vLLM-CPU binds one worker per NUMA node unless told).
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def ray_sessions() -> set[str]:
    return set(glob.glob("/tmp/ray/session_2*"))


def test_a_target_in_two_tensor_parallel_workers_drafts_on_one_rank_only(family, tmp_path):
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
    before, real_token = ray_processes(), _token_file_state()
    result = run_job(Job(target=family.target, prompts=list(TINY_PROMPTS), max_tokens=MAX_TOKENS,
                         speculative_config=spec, engine_args=engine_args,
                         env={"RAY_ADDRESS": "", "HOME": str(tmp_path), **TP2_ENV}))
    print(f"\n{result.smurfs_stats}")
    assert ray_processes() == before, "the run left Ray processes behind"
    assert not (tmp_path / ".ray").exists() and _token_file_state() == real_token
    assert len(ray_sessions() - sessions) == 1  # one rank started a cluster, not two
    assert divergences(reference.token_ids, result.token_ids) == {}
    ray_stats = {d["name"]: d for d in result.smurfs_stats["drafters"]}["ray-draft"]
    assert ray_stats["drafted_tokens"] > 0 and ray_stats["accepted_tokens"] > 0

