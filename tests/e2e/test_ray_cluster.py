"""Ray drafters on a Ray cluster the user started (`ray start`), joined by ``RAY_ADDRESS`` alone.

Each scenario runs in a network and PID namespace of its own (`ray_cluster_scenario.py`): only
the loopback interface, so an address rewritten to the machine's outward one reaches nothing, and
every Ray process ends with the namespace. ``HOME`` is the test's own folder, which holds the
user's token when the scenario gives them one; nothing else may appear there, nor in the real
home folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from smurfs_tools.jobs import Job, divergences, run_job
from smurfs_tools.tiny_models import TINY_PROMPTS

from conftest import LOOKAHEAD, MAX_TOKENS, fail_on_phase_divergence

pytest.importorskip("ray", reason="the 'ray' extra is not installed")
pytestmark = pytest.mark.e2e

SCENARIO = Path(__file__).with_name("ray_cluster_scenario.py")
PORT = 6390
REAL_TOKEN = Path.home() / ".ray" / "auth_token"
# The worker node's drafter: killed with its node after this many engine steps of its own.
KILL_AFTER_STEPS = 30
KILL_MAX_TOKENS = 200


def _unshare() -> list[str]:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare(1) for a network namespace of the test's own")
    return ["unshare", "--net", "--pid", "--fork", "--mount-proc"]


def _token_file_state() -> tuple[bool, float | None]:
    return REAL_TOKEN.exists(), REAL_TOKEN.stat().st_mtime if REAL_TOKEN.exists() else None


def run_scenario(tmp_path: Path, job: Job | dict[str, Any], auth: str,
                 job_env: dict[str, str] | None = None,
                 worker_resources: dict[str, float] | None = None,
                 timeout_s: float = 600) -> dict[str, Any]:
    """``job``: a `Job` (run as `smurfs_tools.jobs` runs it) or a two-phase job's dict
    (`ray_fault_job.py`)."""
    home = tmp_path / "home"
    home.mkdir()
    # Ray's socket paths must stay under 108 bytes: its session folder goes in a short one.
    ray_temp = tempfile.mkdtemp(prefix="smurfs-ray-")
    phases = not isinstance(job, Job)
    scenario = {"port": PORT, "auth": auth, "home": str(home), "phases": phases,
                "job": job if phases else asdict(job), "temp_dir": ray_temp,
                "timeout_s": timeout_s, "job_env": job_env or {},
                "worker_resources": worker_resources}
    spec_path, out_path = tmp_path / "scenario.json", tmp_path / "out.json"
    spec_path.write_text(json.dumps(scenario))
    real_token = _token_file_state()
    try:
        proc = subprocess.run([*_unshare(), sys.executable, str(SCENARIO), str(spec_path),
                               str(out_path)], capture_output=True, text=True,
                              timeout=timeout_s + 120)
    finally:
        shutil.rmtree(ray_temp, ignore_errors=True)
    assert out_path.exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(out_path.read_text())
    result = out.get("result") or {}
    print(f"\njob {out.get('job_s', 0):.1f} s; error {out.get('error')!r}; stats "
          f"{json.dumps(result.get('smurfs_stats') or [p['after'] for p in result.get('phases', [])])}")
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert out["interfaces"] == 1  # loopback only
    assert _token_file_state() == real_token  # the real home folder: untouched
    return out


def ray_spec(family, **drafter) -> dict:
    return {"method": "smurfs", "num_speculative_tokens": LOOKAHEAD,
            "drafters": [{"model": family.drafts[0]},
                         {"model": family.drafts[1], "placement": "ray", "name": "ray-draft",
                          **drafter}],
            "lookahead": {"policy": "fixed"}}


def ray_files(out: dict[str, Any]) -> list[str]:
    """What is in the scenario's home folder for Ray (vLLM keeps a cache of its own there)."""
    return [path for path in out["home_after"] if path.startswith(".ray")]


def _ray_stats(out: dict[str, Any]) -> dict[str, Any]:
    return {d["name"]: d for d in out["result"]["smurfs_stats"]["drafters"]}["ray-draft"]


@pytest.mark.parametrize("auth", ["token", "disabled"])
def test_a_job_naming_the_cluster_by_ray_address_alone_drafts_on_it(family, greedy_runs, auth,
                                                                    tmp_path):
    """`ray start --head` with token authentication, and without it (the user has a token file
    all the same, as anyone who ran Ray locally has); the job's environment holds RAY_ADDRESS and
    nothing else of Ray's."""
    job = Job(target=family.target, prompts=list(TINY_PROMPTS),
              speculative_config=ray_spec(family), max_tokens=MAX_TOKENS)
    out = run_scenario(tmp_path, job, auth)
    assert out["result"] is not None, out["log"][-6000:]
    assert divergences(greedy_runs("none").token_ids, out["result"]["token_ids"]) == {}
    ray_stats = _ray_stats(out)
    assert ray_stats["alive"] and ray_stats["replacements"] == 0
    assert ray_stats["drafted_tokens"] > 0 and ray_stats["accepted_tokens"] > 0
    joined = (f"Ray drafters use the Ray cluster at 127.0.0.1:{PORT} "
              f"(RAY_ADDRESS=127.0.0.1:{PORT})")
    assert joined + (" with token authentication" if auth == "token" else "\n") in out["log"]
    assert "started a local Ray cluster" not in out["log"]  # no cluster of its own
    # The user's cluster is up after the job, and nothing of the job's is left on it.
    assert out["cluster_after"] == {"answers": True, "alive_nodes": 1}
    assert out["gcs_servers_after"] == out["raylets_after"] == 1
    assert out["drafter_processes_after"] == []
    # Ray's folder in the home folder holds the user's token, unchanged, and nothing else.
    assert out["token_after"] == out["token_before"] is not None
    assert ray_files(out) == [".ray/auth_token"]


def test_a_drafter_on_a_worker_node_that_dies_mid_run_costs_speculation_only(family, tmp_path):
    """A second raylet on the same head, as a worker node with a resource of its own; the Ray
    drafter is placed there by ray_options, drafts, and the node is killed mid-run (its raylet
    and the drafter's process, SIGKILL, as when a machine goes away, after the drafter's 30th
    engine step). Its replacement asks for the same resource, which no node has any more: it is
    reported, and the engine goes on with its in-worker drafter. The user has no token: a fresh
    home folder. (Two phases, the engine kept stepping for a few seconds between them: the
    report comes draft_timeout_s after the replacement is launched.)"""
    reference = run_job(Job(target=family.target, prompts=list(TINY_PROMPTS),
                            max_tokens=KILL_MAX_TOKENS))
    spec = {**ray_spec(family, ray_options={"resources": {"drafter_node": 1}}),
            "draft_timeout_s": 3.0}
    job = {"target": family.target, "speculative_config": spec, "prompts": list(TINY_PROMPTS),
           "max_tokens": KILL_MAX_TOKENS, "drafter": "ray-draft", "until": "seconds",
           "seconds": 8.0, "timeout_s": 60.0}
    out = run_scenario(tmp_path, job, "none", worker_resources={"drafter_node": 1},
                       job_env={"SMURFS_DRAFTER_FAULT": f"ray-draft=kill_node_after:"
                                                        f"{KILL_AFTER_STEPS}"})
    assert out["result"] is not None, out["log"][-6000:]
    first, second = out["result"]["phases"]
    fail_on_phase_divergence(reference, [first, second], family.target, KILL_MAX_TOKENS)
    log = out["log"]
    ready = [line for line in log.splitlines() if "ray-draft ready as a Ray actor" in line]
    assert len(ready) == 1 and "(replacement" not in ready[0]  # it ran on the worker node...
    assert "node 127.0.0.1 (" in ready[0] and ", another node), pid" in ready[0]

    def ray_draft(stats):
        return {d["name"]: d for d in stats["drafters"]}["ray-draft"]

    # ... drafted there in phase 1, and died there: mid-run, not in the warm-up. Its drafts in
    # phase 1 are its own (the replacement never ran: the only node with its resource is gone).
    assert ray_draft(first["before"])["replacements"] == 0 and ray_draft(first["before"])["alive"]
    assert ray_draft(first["after"])["replacements"] == 1
    drafted = ray_draft(first["after"])["drafted_tokens"] - ray_draft(first["before"])[
        "drafted_tokens"]
    assert drafted > 0
    assert "Smurfs drafter ray-draft (Ray actor on node 127.0.0.1) is lost" in log
    assert log.index("is lost") < log.index("### phase 1 done")
    assert ("Smurfs drafter ray-draft: its Ray actor is not placed: it asks for "
            "{'drafter_node': 1.0}") in log  # the replacement, reported
    # Phase 2: the in-worker drafter drafts alone, and the outputs are as without speculation.
    assert not ray_draft(second["after"])["alive"]
    assert ray_draft(second["after"])["drafted_tokens"] == ray_draft(second["before"])[
        "drafted_tokens"]
    draft0 = [{d["name"]: d for d in p["drafters"]}["draft-0"]["drafted_tokens"]
              for p in (second["before"], second["after"])]
    assert draft0[1] > draft0[0]
    # The user's head is up; the worker node's raylet is gone (the cluster marks the node dead
    # once its health checks fail, seconds later).
    assert out["cluster_after"]["answers"] and out["raylets_after"] == 1
    assert out["token_after"] is None and ray_files(out) == []


def test_a_named_cluster_that_does_not_answer_fails_fast_naming_it(family, tmp_path):
    """RAY_ADDRESS names a port nothing listens on: the engine fails at start-up, at once, with
    an error naming the address (Ray's own connect would retry for about 20 s and then name
    neither cause nor setting)."""
    job = Job(target=family.target, prompts=list(TINY_PROMPTS)[:1],
              speculative_config=ray_spec(family), max_tokens=4)
    out = run_scenario(tmp_path, job, "no-cluster", timeout_s=300)
    assert out["result"] is None
    assert (f"Nothing answers at the Ray cluster at 127.0.0.1:{PORT} "
            f"(RAY_ADDRESS=127.0.0.1:{PORT}) (UNAVAILABLE") in out["log"]
    assert "Failed to get cluster ID from GCS" not in out["log"]  # no retries of Ray's
    assert ray_files(out) == []
