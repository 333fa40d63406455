"""scripts/gpu_check.sh --dry-run: the GPU check's CPU-side plumbing, end to end (CI runs it).

The GPU check itself is unverified until someone runs it on a GPU (docs/testing.md); its dry run
runs every step on this machine: the extras it installs are declared, the identity tests it runs
are collected in the environment a GPU gets, `vllm serve` with the default configuration answers
a completion (tiny models, CPU build), the benchmark's command line parses, and the summary is
one JSON object that reads a committed benchmark result.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def run_dry(out: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"],
                          env={**os.environ, "GPU_CHECK_OUT": str(out), **env},
                          capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(lines[-1])


def test_the_dry_run_runs_every_step_on_cpu(tmp_path):
    proc, summary = run_dry(tmp_path / "out")
    print(json.dumps(summary, indent=1)[:4000])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary["dry_run"] and summary["ok"]
    steps = summary["steps"]
    assert list(steps) == ["install", "identity", "serve", "bench"]
    assert steps["install"]["extras"] == "gpu,test,bench,ray" and steps["install"]["gpu"]
    assert steps["identity"]["exit_code"] == 0
    identity_log = (Path(steps["identity"]["log"]).with_suffix(".out")).read_text()
    assert "test_greedy_lossless.py::" in identity_log  # collected, with the GPU's environment
    serve = steps["serve"]
    assert serve["completion_tokens"] == 16 and serve["text"]
    assert set(serve["spec_decode"]) == {"num_drafts", "num_draft_tokens", "num_accepted_tokens"}
    assert "--speculative-config" in serve["command"]
    assert steps["bench"]["methods"] == ["none", "ngram:4", "draft_model:2", "smurfs:4"]
    assert steps["bench"]["loads"] == ["batch1", "served"] and steps["bench"]["concurrency"] == [16]
    assert summary["bench_reader"]["smurfs/rayspare:6@1thread"]["batch1"]["status"] == "ok"
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == summary


def test_a_step_that_fails_fails_the_check(tmp_path):
    # A draft model that does not exist: the server cannot start; the summary names the step.
    (tmp_path / "nothing").mkdir()
    proc, summary = run_dry(tmp_path / "out", SMURFS_DRAFT=str(tmp_path / "nothing"))
    assert proc.returncode != 0
    assert not summary["ok"] and not summary["steps"]["serve"]["ok"]
    assert summary["steps"]["bench"]["ok"]  # the other steps still ran
