"""Starting `vllm serve` on 127.0.0.1 for the serve tests, and reading what it reports."""

from __future__ import annotations

import contextlib
import json
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
def vllm_server(target: str, log_path: Path, extra_args: list[str],
                env: dict[str, str] | None = None) -> Iterator[str]:
    """A float32 `vllm serve target` on a free loopback port (``env`` added to this process's
    environment); yields its base URL."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           **(env or {})}
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


def process_state(pid: int) -> str:
    """The one-letter state of a process in /proc (R running, S sleeping, T stopped, Z zombie);
    "gone" when it no longer exists."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


class ServerLog:
    """What a server wrote to its log: Smurfs' periodic stats lines and its error lines, read
    while it runs (only whole lines)."""

    STATS = re.compile(r"Smurfs drafters: (\{.*\})\s*$")

    def __init__(self, path: Path) -> None:
        self.path = path

    def lines(self) -> list[str]:
        text = self.path.read_text(errors="replace")
        return text.splitlines()[: text.count("\n")]

    def drafter_stats(self) -> list[dict[str, dict]]:
        """Every stats line so far, in order: {drafter name: its entry}."""
        found = []
        for line in self.lines():
            match = self.STATS.search(line)
            if match:
                try:
                    stats = json.loads(match.group(1))
                except json.JSONDecodeError:
                    continue
                found.append({d["name"]: d for d in stats["drafters"]})
        return found

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        """The first match of ``pattern`` in the log, waiting up to ``timeout_s`` for it."""
        deadline = time.monotonic() + timeout_s
        while True:
            for line in self.lines():
                match = re.search(pattern, line)
                if match:
                    return match
            if time.monotonic() > deadline:
                raise AssertionError(f"no log line matching {pattern!r} within {timeout_s} s:\n"
                                     + "\n".join(self.lines()[-40:]))
            time.sleep(0.05)

    def wait_engine_steps(self, name: str, timeout_s: float) -> tuple[int, int]:
        """Wait until drafter ``name``'s engine steps grow from one stats line to a later one
        (it is alive and stepping); returns the two counts."""
        deadline = time.monotonic() + timeout_s
        first = None
        while True:
            stats = self.drafter_stats()
            if stats:
                entry = stats[-1][name]
                if first is None:
                    first = entry["engine_steps"]
                elif entry["alive"] and entry["engine_steps"] > first:
                    return first, entry["engine_steps"]
            if time.monotonic() > deadline:
                raise AssertionError(f"drafter {name}'s engine steps did not grow within "
                                     f"{timeout_s} s: {stats[-1:] if stats else 'no stats'}")
            time.sleep(0.05)
