"""Starting `vllm serve` on 127.0.0.1 for the serve tests, and reading what it reports."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import requests

STARTUP_TIMEOUT_S = 600


def vllm_command() -> list[str]:
    """The venv's `vllm` command (set up by scripts/setup.sh), else the same entry point."""
    script = Path(sys.executable).parent / "vllm"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "vllm_smurfs.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_server(target: str, log_path: Path, extra_args: list[str]) -> Iterator[str]:
    """A float32 `vllm serve target` on a free loopback port; yields its base URL."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            vllm_command() + ["serve", target, "--dtype", "float32", "--max-model-len", "512",
                              "--enforce-eager", "--host", "127.0.0.1", "--port", str(port),
                              "--seed", "0", *extra_args],
            stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise AssertionError(
                    f"vllm serve exited ({proc.returncode}):\n{log_path.read_text()[-6000:]}")
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"vllm serve did not start:\n{log_path.read_text()[-6000:]}")
            time.sleep(1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def spec_counters(base: str) -> dict[str, float]:
    text = requests.get(f"{base}/metrics", timeout=30).text
    found = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        match = re.search(rf"^vllm:spec_decode_{name}_total(?:{{[^}}]*}})? ([0-9.e+]+)$",
                          text, re.M)
        assert match, f"/metrics has no vllm:spec_decode_{name}_total"
        found[name] = float(match.group(1))
    return found
