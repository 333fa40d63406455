"""A user's Ray cluster and a job that joins it, inside a network and PID namespace of its own.

Run by tests/e2e/test_ray_cluster.py as

    unshare --net --pid --fork --mount-proc python ray_cluster_scenario.py SCENARIO.json OUT.json

Only the loopback interface exists in the namespace, so nothing here can reach beyond the machine
(an address rewritten to the machine's outward one finds nothing); every process started here
ends with the namespace, and `ray stop` sees only this namespace's Ray processes.

As a user would: ``ray start --head --node-ip-address 127.0.0.1 --port P`` (dashboard off, usage
reporting off), with token authentication or without, optionally a second raylet on the same head
(``ray start --address``) as a worker node with a resource of its own, then a job whose
environment names the cluster by ``RAY_ADDRESS`` alone. ``HOME`` is a folder of the test's: the
user's token, if any, is there, and nothing else may be written there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

from smurfs_tools.jobs import Job, Result

BIN = os.path.dirname(sys.executable)
PHASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ray_fault_job.py")


def sh(*command: str, env: dict[str, str] | None = None, check: bool = True,
       timeout: float = 120) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def processes(word: str) -> list[str]:
    out = sh("ps", "-ww", "-eo", "pid,args").stdout
    return [line for line in out.splitlines() if word in line and "<defunct>" not in line]


def start_cluster(scenario: dict[str, Any], env: dict[str, str]) -> None:
    auth = scenario["auth"]
    ray = os.path.join(BIN, "ray")
    if auth in ("token", "disabled"):
        # The user has a token (every user who ever ran Ray locally does): ~/.ray/auth_token.
        sh(ray, "get-auth-token", "--generate", env=env)
    cluster_env = {**env, "RAY_AUTH_MODE": "token" if auth == "token" else "disabled"}
    common = ["--node-ip-address", "127.0.0.1", "--disable-usage-stats", "--num-cpus", "1"]
    sh(ray, "start", "--head", "--port", str(scenario["port"]), "--include-dashboard=false",
       "--temp-dir", scenario["temp_dir"], *common, env=cluster_env)
    if scenario.get("worker_resources"):
        sh(ray, "start", "--address", f"127.0.0.1:{scenario['port']}",
           "--resources", json.dumps(scenario["worker_resources"]), *common, env=cluster_env)


def run_job(job: Job, env: dict[str, str], timeout_s: float) -> tuple[Result | None, str, str]:
    """The job in its own process, as `smurfs_tools.jobs.run_job` runs it, keeping its log."""
    result, error, log = run_child(["-m", "smurfs_tools.jobs"], asdict(job), env, timeout_s)
    return (Result(**result) if result is not None else None), error, log


def run_phases(job: dict[str, Any], env: dict[str, str], timeout_s: float
               ) -> tuple[dict[str, Any] | None, str, str]:
    """A two-phase job (`ray_fault_job.py`) in its own process: its output and its log."""
    return run_child([PHASES], job, env, timeout_s)


def run_child(command: list[str], job: dict[str, Any], env: dict[str, str], timeout_s: float
              ) -> tuple[dict[str, Any] | None, str, str]:
    """``python COMMAND JOB.json OUT.json``: (OUT, error, its output, stdout and stderr
    interleaved)."""
    with tempfile.TemporaryDirectory(prefix="smurfs-job-") as tmp:
        job_path, result_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "result.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        # One stream, so that the log keeps the order things happened in.
        proc = subprocess.run([sys.executable, *command, job_path, result_path], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout_s)
        log = proc.stdout
        if proc.returncode != 0 or not os.path.exists(result_path):
            return None, f"exit {proc.returncode}", log
        with open(result_path) as f:
            return json.load(f), "", log


def cluster_state(port: int, env: dict[str, str]) -> dict[str, Any]:
    """Whether the cluster still answers, and its alive nodes (asked as the user would)."""
    probe = (f"from vllm_smurfs.drafters.ray_cluster import probe, user_token\n"
             f"a = probe('127.0.0.1:{port}', user_token())\n"
             f"print(a.code, len(a.node_ids))")
    out = sh(sys.executable, "-c", probe, env=env, check=False).stdout.split()
    return {"answers": out[:1] == ["ok"], "alive_nodes": int(out[1]) if len(out) > 1 else 0}


def main() -> None:
    with open(sys.argv[1]) as f:
        scenario = json.load(f)
    sh("ip", "link", "set", "lo", "up")
    home = scenario["home"]
    # The environment of a user's shell: no Ray settings beyond what the scenario names.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_", "SMURFS_"))}
    env.update(HOME=home, RAY_USAGE_STATS_ENABLED="0")
    out: dict[str, Any] = {"interfaces": sh("ip", "-o", "link").stdout.count("\n")}
    try:
        if scenario["auth"] != "no-cluster":
            start_cluster(scenario, env)
        out["token_before"] = _read(os.path.join(home, ".ray", "auth_token"))
        job_env = {**env, "RAY_ADDRESS": f"127.0.0.1:{scenario['port']}",
                   "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **scenario.get("job_env", {})}
        started = time.monotonic()
        if scenario.get("phases"):
            result, error, log = run_phases(scenario["job"], job_env, scenario["timeout_s"])
        else:
            job_result, error, log = run_job(Job(**scenario["job"]), job_env,
                                             scenario["timeout_s"])
            result = asdict(job_result) if job_result else None
        out.update(result=result, error=error, log=log, job_s=time.monotonic() - started)
        time.sleep(2)  # a moment for the cluster to end the job's actors
        out["drafter_processes_after"] = processes("RayDrafterActor")
        if scenario["auth"] != "no-cluster":
            out["cluster_after"] = cluster_state(scenario["port"], env)
        out["gcs_servers_after"] = len(processes("gcs_server"))
        out["raylets_after"] = sum(os.path.basename(line.split()[1]) == "raylet"
                                   for line in processes("raylet"))
        out["token_after"] = _read(os.path.join(home, ".ray", "auth_token"))
        out["home_after"] = sorted(os.path.relpath(os.path.join(d, n), home)
                                   for d, _, names in os.walk(home) for n in names)
    finally:
        sh(os.path.join(BIN, "ray"), "stop", "--force", env=env, check=False)
        with open(sys.argv[2], "w") as f:
            json.dump(out, f)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


if __name__ == "__main__":
    main()
