"""An engine that shuts down leaves nothing of Smurfs behind: no process, socket, thread, folder
or open file; also when a drafter never started."""

import json
import re
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.e2e

# Runs in a fresh process: an in-process engine with a process drafter (its own engine, socket
# and folder), an in-worker drafter and a trace file; the snapshot before the engine, while it
# runs, and after `del llm`.
SCRIPT = textwrap.dedent(r'''
    import gc, glob, json, os, sys, tempfile, threading, time
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    def snapshot(trace):
        fds = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                fds.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
        children = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid():
                children.append(pid)
        return {"sockets": sum(f.startswith("socket:") for f in fds),
                "trace_open": any(f == trace for f in fds),
                "children": children,
                "threads": sorted(t.name for t in threading.enumerate()),
                "folders": sorted(glob.glob(os.path.join(tempfile.gettempdir(), "smurfs-*")))}

    if __name__ == "__main__":
        target, draft, process_draft, trace = sys.argv[1:5]
        from vllm import LLM, SamplingParams
        before = snapshot(trace)
        llm = LLM(model=target, dtype="float32", max_model_len=256, enforce_eager=True,
                  speculative_config={
                      "method": "smurfs", "num_speculative_tokens": 3, "trace_file": trace,
                      "draft_timeout_s": 5.0, "lookahead": {"policy": "fixed"},
                      "drafters": [{"model": draft},
                                   {"model": process_draft, "placement": "process"},
                                   {"method": "ngram"}]})
        llm.generate(["the river runs to the sea"], SamplingParams(max_tokens=16))
        during = snapshot(trace)
        from vllm_smurfs.metrics import get_smurfs_stats
        during["drafters"] = {d["name"]: d["alive"] for d in get_smurfs_stats(llm)["drafters"]}
        del llm
        gc.collect()
        time.sleep(0.5)
        print("SNAPSHOTS " + json.dumps({"before": before, "during": during,
                                         "after": snapshot(trace)}))
''')


def run_and_snapshot(family, tmp_path, process_draft: str) -> tuple[dict, str]:
    """The snapshots, and the engine's log (vLLM logs to stdout)."""
    trace = tmp_path / "trace.jsonl"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, family.target, family.drafts[0],
                           process_draft, str(trace)],
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SNAPSHOTS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    snapshots = json.loads(lines[0].removeprefix("SNAPSHOTS "))
    print(f"\n{json.dumps(snapshots, indent=1)}")
    return snapshots, proc.stdout + proc.stderr


def assert_nothing_left(snapshots: dict) -> None:
    before, after = snapshots["before"], snapshots["after"]
    assert after["children"] == before["children"] == []
    assert after["folders"] == before["folders"]
    assert not after["trace_open"]
    assert after["sockets"] <= before["sockets"]
    # tqdm's monitor thread (vLLM's progress bars) lives on by tqdm's design; nothing else may.
    assert [t for t in after["threads"] if t != "tqdm_monitor"] == before["threads"]


def test_nothing_of_smurfs_outlives_its_engine(family, tmp_path):
    snapshots, _ = run_and_snapshot(family, tmp_path, family.drafts[1])
    during = snapshots["during"]
    # While it runs there is something to leave behind: the test can fail.
    assert during["drafters"] == {"draft-0": True, "draft-1": True, "ngram[2,4]": True}
    assert during["children"] and during["trace_open"]
    assert len(during["folders"]) > len(snapshots["before"]["folders"])
    assert_nothing_left(snapshots)


def test_a_drafter_that_never_starts_leaves_nothing_either(family, tmp_path):
    # Same config and tokenizer as a draft, so it passes the start-up checks, but no weights:
    # its process exits before it is ready.
    import shutil
    from pathlib import Path

    broken = tmp_path / "broken-draft"
    broken.mkdir()
    for item in Path(family.drafts[1]).iterdir():
        if not item.name.endswith(".safetensors"):
            shutil.copy(item, broken / item.name)
    snapshots, log = run_and_snapshot(family, tmp_path, str(broken))
    # It was launched (its process answered that its engine failed to start, or exited with a
    # code before it answered) and is reported not alive, the others alive.
    assert re.search(r"Smurfs drafter broken-draft is left out for the rest of the run: drafter "
                     r"(engine failed to start|process did not connect \(exit code -?\d+\)|"
                     r"engine did not start \(exit code -?\d+\))", log), log[-6000:]
    assert snapshots["during"]["drafters"] == {"draft-0": True, "broken-draft": False,
                                               "ngram[2,4]": True}
    # Its socket's folder was made when it was launched, and is gone with the engine.
    assert len(snapshots["during"]["folders"]) > len(snapshots["before"]["folders"])
    assert_nothing_left(snapshots)
