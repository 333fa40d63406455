"""Where a method's processes and threads actually ran, read from /proc while it runs.

Settings say what was asked for; this records what happened: for every process under the
method's root process (engine, vLLM workers, Smurfs drafter servers), its threads' allowed cores
(`Cpus_allowed_list` of /proc/PID/task/*/status), its most threads seen, and its CPU seconds at
the last sample (CPU seconds / wall seconds near 2 means it kept two cores busy).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _stat_fields(pid: int | str) -> list[str] | None:
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        return None
    # comm (field 2) is in parentheses and may hold spaces: split after its closing one.
    return text[text.rfind(")") + 2:].split()


def descendants(root: int) -> list[int]:
    """`root` and every process below it (a snapshot)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(entry)
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry))
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def process_role(comm: str, args: list[str]) -> str:
    """A readable name: the module of `python -m MODULE` (offline_worker, process_server), else
    the command name (VLLM::Worker, vllm)."""
    if "-m" in args[:-1]:
        return args[args.index("-m") + 1].rsplit(".", 1)[-1]
    return comm


def snapshot_process(pid: int) -> dict[str, Any] | None:
    fields = _stat_fields(pid)
    cmdline = _read(f"/proc/{pid}/cmdline")
    if fields is None or cmdline is None:
        return None
    affinities: set[str] = set()
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tids = []
    for tid in tids:
        status = _read(f"/proc/{pid}/task/{tid}/status") or ""
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                affinities.add(line.split(":", 1)[1].strip())
    comm = (_read(f"/proc/{pid}/comm") or "").strip()
    args = [a for a in cmdline.split("\0") if a]
    # utime + stime: fields 14 and 15 of /proc/PID/stat, i.e. 11 and 12 after comm and state.
    cpu_s = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    return {"pid": pid, "name": process_role(comm, args), "cmdline": " ".join(args[:4])[:200],
            "threads": len(tids), "cpus_allowed": sorted(affinities), "cpu_s": cpu_s}


class PlacementSampler:
    """Samples the process tree under a root pid every `interval_s` until stopped.

        with PlacementSampler(interval_s=1.0) as sampler:
            proc = subprocess.Popen(...); sampler.watch(proc.pid); proc.wait()
        sampler.report()  # [{pid, name, cmdline, threads (max), cpus_allowed (all seen), cpu_s}]
    """

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self._roots: list[int] = []
        self._seen: dict[int, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="placement-sampler", daemon=True)
        self._started = time.perf_counter()

    def watch(self, pid: int) -> None:
        self._roots.append(pid)
        self.sample()

    def sample(self) -> None:
        for root in list(self._roots):
            for pid in descendants(root):
                snap = snapshot_process(pid)
                if snap is None:
                    continue
                seen = self._seen.setdefault(pid, {**snap, "cpus_allowed": []})
                seen["threads"] = max(seen["threads"], snap["threads"])
                seen["cpus_allowed"] = sorted(set(seen["cpus_allowed"]) | set(snap["cpus_allowed"]))
                seen["cpu_s"] = snap["cpu_s"]
                seen["name"], seen["cmdline"] = snap["name"], snap["cmdline"]

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception:  # noqa: BLE001, S110 - a /proc race must not stop the measurement
                pass

    def __enter__(self) -> PlacementSampler:  # noqa: PYI034
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def report(self) -> list[dict[str, Any]]:
        wall = time.perf_counter() - self._started
        return [{**p, "wall_s": wall} for _, p in sorted(self._seen.items())]
