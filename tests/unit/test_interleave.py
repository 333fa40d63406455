"""`benchmarks run --interleave`: the parent's turn-taking, with fake gated workers (no vLLM).

A fake worker speaks the offline worker's gated protocol: it emits `started` and `ready`, then
before each timed call reads a line from stdin and records when its call began and ended.
"""

from __future__ import annotations

import sys

import pytest

from benchmarks import run as bench_run
from benchmarks.methods import parse_method
from benchmarks.spec_bench import Prompt

FAKE_WORKER = r'''
import json, sys, time
job_path, events_path = sys.argv[1], sys.argv[2]
job = json.load(open(job_path))
def emit(e):
    with open(events_path, "a") as f:
        f.write(json.dumps(e) + "\n")
emit({"event": "started", "startup_s": 0.0, "pid": 0})
time.sleep(job["speculative_config"]["startup_s"])
emit({"event": "ready"})
with open(job["speculative_config"]["ready_file"], "a") as f:
    f.write(f"{time.time()}\n")
crash_at = job["speculative_config"].get("crash_at")
for n, p in enumerate(job["prompts"]):
    if not sys.stdin.readline():
        raise SystemExit("end of input")
    if n == crash_at:
        raise SystemExit("crashed on purpose")
    t0 = time.time(); time.sleep(0.05)
    emit({"event": "batch1", "prompt_index": p["index"], "elapsed_s": 0.05, "t0": t0,
          "t1": time.time(), "output_token_ids": [1], "num_output_tokens": 1})
if "batched" in job["loads"]:
    sys.stdin.readline()
    t0 = time.time(); time.sleep(0.05)
    emit({"event": "batched", "elapsed_s": 0.05, "t0": t0, "t1": time.time(),
          "outputs": [{"prompt_index": p["index"], "num_output_tokens": 1}
                      for p in job["prompts"]]})
emit({"event": "done"})
'''


@pytest.fixture
def fake_workers(monkeypatch, tmp_path):
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    monkeypatch.setattr(bench_run._OfflineChild, "command",
                        lambda self: [sys.executable, str(script), self.job_path,
                                      self.events_path])
    return tmp_path


def _run(tmp_path, configs, loads=("batch1",), num_prompts=4):
    settings = bench_run.RunSettings(target="/t", drafts=[], dataset="", methods="",
                                     out_dir=str(tmp_path), interleave=True)
    prompts = [Prompt(i, i, "writing", "mt_bench", f"p{i}", [1, 2]) for i in range(num_prompts)]
    entries = [(parse_method(f"ngram:{k + 1}", 2), {**c, "ready_file": str(tmp_path / "ready")})
               for k, c in enumerate(configs)]
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    return bench_run.run_offline_interleaved(entries, settings, prompts, list(loads), [0, 1],
                                             str(logs), timeout_s=60)


def test_every_worker_is_ready_before_the_first_turn_and_one_computes_at_a_time(fake_workers):
    # The first worker is ready at once, the last after 0.5 s: nobody is timed before that.
    out = _run(fake_workers, [{"startup_s": 0.0}, {"startup_s": 0.2}, {"startup_s": 0.5}],
               loads=("batch1", "batched"))
    calls = []
    for label, loads in out.items():
        assert loads["batch1"]["status"] == "ok" and loads["batch1"]["interleaved"]
        assert loads["batched"]["status"] == "ok"
        for index, rec in loads["batch1"]["per_prompt"].items():
            calls.append((rec["t0"], rec["t1"], label, int(index)))
        calls.append((loads["batched"]["t0"], loads["batched"]["t1"], label, 4))
    calls.sort()
    assert len(calls) == 3 * 5
    ready = [float(t) for t in (fake_workers / "ready").read_text().split()]
    assert len(ready) == 3 and calls[0][0] >= max(ready)
    for (_, end, *_), (start, *_) in zip(calls, calls[1:]):
        assert end <= start  # never two timed calls at once
    # Round by round (prompt by prompt), each method once, the first of a round rotating.
    labels = list(out)
    for u in range(5):
        turn = [label for _, _, label, index in calls[3 * u: 3 * u + 3]]
        assert {index for *_, index in calls[3 * u: 3 * u + 3]} == {u}
        assert turn == labels[u % 3:] + labels[:u % 3]


def test_a_worker_that_dies_records_its_error_and_the_others_finish(fake_workers):
    out = _run(fake_workers, [{"startup_s": 0.0}, {"startup_s": 0.0, "crash_at": 2},
                              {"startup_s": 0.0}])
    first, crashed, last = (out[label]["batch1"] for label in out)
    assert first["status"] == last["status"] == "ok" and len(last["per_prompt"]) == 4
    assert crashed["status"] == "partial" and sorted(crashed["per_prompt"]) == ["0", "1"]
    assert "crashed on purpose" in crashed["error"]
