"""`vllm serve TARGET --speculative-config smurfs.json` answers like offline generation."""

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from vllm_smurfs.tiny_models import TINY_PROMPTS

from conftest import MAX_TOKENS

pytestmark = pytest.mark.e2e

PROMPT_INDEX = 1
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


def spec_counters(base: str) -> dict[str, float]:
    text = requests.get(f"{base}/metrics", timeout=30).text
    found = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        match = re.search(rf"^vllm:spec_decode_{name}_total(?:{{[^}}]*}})? ([0-9.e+]+)$",
                          text, re.M)
        assert match, f"/metrics has no vllm:spec_decode_{name}_total"
        found[name] = float(match.group(1))
    return found


@pytest.fixture(scope="module")
def server(family, tmp_path_factory):
    # Fixed lookahead: on tiny models (a target step of a millisecond) the adaptive policy
    # rightly finds little worth drafting, and this test is about the server path. Both kinds
    # of model drafter in one collective: one in the target's worker, one in its own process.
    config = {"method": "smurfs", "num_speculative_tokens": 4, "lookahead": {"policy": "fixed"},
              "drafters": [{"model": family.drafts[0]},
                           {"model": family.drafts[1], "placement": "process"},
                           {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}]}
    config_path = tmp_path_factory.mktemp("serve") / "smurfs.json"
    config_path.write_text(json.dumps(config))
    port = free_port()
    log_path = config_path.parent / "server.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            vllm_command() + ["serve", family.target, "--speculative-config", str(config_path),
                              "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
                              "--host", "127.0.0.1", "--port", str(port), "--seed", "0"],
            stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited ({proc.returncode}):\n{log_path.read_text()[-6000:]}")
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve did not start:\n{log_path.read_text()[-6000:]}")
            time.sleep(1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_serve_matches_offline_and_counts_speculation(server, family, greedy_runs):
    before = spec_counters(server)
    response = requests.post(f"{server}/v1/completions", timeout=300, json={
        "model": family.target, "prompt": TINY_PROMPTS[PROMPT_INDEX],
        "max_tokens": MAX_TOKENS[PROMPT_INDEX], "temperature": 0})
    response.raise_for_status()
    served_text = response.json()["choices"][0]["text"]
    offline_text = greedy_runs("none").texts[PROMPT_INDEX]
    assert served_text == offline_text
    after = spec_counters(server)
    print(f"\n/metrics before {before} after {after}")
    assert after["num_drafts"] > before["num_drafts"]
    assert after["num_draft_tokens"] > before["num_draft_tokens"]
    assert after["num_accepted_tokens"] > before["num_accepted_tokens"]
