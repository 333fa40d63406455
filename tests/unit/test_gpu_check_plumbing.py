"""The pure parts of the GPU check (scripts/gpu_check.sh): the identity tests' environment by
platform, the benchmark's command line, the summary. Its dry run, end to end:
tests/e2e/test_gpu_check.py."""

import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace

from smurfs_tools import gpu_check

REPO = Path(__file__).resolve().parents[2]


def test_identity_needs_batch_invariant_kernels_on_a_gpu_and_nothing_on_cpu(monkeypatch):
    assert gpu_check.identity_env("cpu") == {}
    for device in ("cuda", "rocm", "xpu"):
        assert gpu_check.identity_env(device) == {"VLLM_BATCH_INVARIANT": "1"}
    # The platform as vLLM reports it (a CUDA build on a GPU machine, mocked).
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = SimpleNamespace(device_type="cuda")
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    assert gpu_check.current_device_type() == "cuda"


def test_the_suite_sets_the_identity_environment_it_is_given(capsys):
    assert gpu_check.main(["identity-env", "cuda"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "ok": True, "device_type": "cuda", "env": {"VLLM_BATCH_INVARIANT": "1"}}
    conftest = (REPO / "tests" / "e2e" / "conftest.py").read_text()
    assert '"-m", "smurfs_tools.gpu_check", "identity-env"' in conftest
    assert "os.environ.setdefault(_key, _value)" in conftest


def test_the_benchmark_command_line_is_the_issues_quick_pass():
    script = (REPO / "scripts" / "gpu_check.sh").read_text()
    line = next(x for x in script.splitlines() if x.startswith("BENCH=("))
    assert "--methods none,ngram:4,draft_model:2,smurfs:4" in line
    parsed = gpu_check.bench_args(
        ["run", "--target", "/t", "--draft", "/d", "--quick", "--methods",
         gpu_check.BENCH_METHODS, "--loads", "batch1,served", "--concurrency", "16"])
    assert parsed["methods"] == ["none", "ngram:4", "draft_model:2", "smurfs:4"]
    assert parsed["loads"] == ["batch1", "served"] and parsed["concurrency"] == [16]


def test_the_summary_says_which_step_failed(tmp_path):
    steps = [{"step": "install", "ok": True, "dry_run": False},
             {"step": "serve", "ok": False, "dry_run": False, "error": "TimeoutError: ..."}]
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    report = gpu_check.summary(tmp_path)
    assert not report["ok"] and not report["dry_run"]
    assert report["steps"]["serve"]["error"] == "TimeoutError: ..."
    assert gpu_check.main(["summary", str(tmp_path)]) == 1


def test_the_summary_reads_a_benchmark_result():
    result = REPO / "benchmarks" / "results" / "2026-12-05-ray" / "batch1" / "pass-1" / "result.json"
    methods = gpu_check.bench_summary(result)
    ray = methods["smurfs/rayspare:6@1thread"]["batch1"]
    assert ray["status"] == "ok" and ray["identical"] == "5/6"
    assert 0.5 < ray["speedup"] < 1.0 and ray["mean_acceptance_length"] > 1.0
