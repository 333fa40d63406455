"""Methods under test and where their threads run.

A method is written `NAME[:K][@PLACEMENT]`:

    none@2threads  ngram:4  draft_model:2  draft_model:6@1thread  suffix:4  smurfs:4@1thread

NAME is one of METHOD_NAMES; K (num_speculative_tokens) is required for every method but `none`.
PLACEMENT says how many compute threads the target gets, on which cores (the first N cores this
process may use); `auto` leaves vLLM's own choice. Defaults give every method its best placement
on a small machine: single-process methods get all cores; Smurfs gives the target all cores but
one and pins its model drafters to the rest (no spare core: drafters share the target's).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

METHOD_NAMES = ("none", "ngram", "draft_model", "suffix", "smurfs")

#: Inherited variables that decide thread placement: dropped from every child's environment so
#: that only the method's placement applies (a parent shell's OMP_NUM_THREADS=1 would otherwise
#: silently turn a 2-thread baseline into a 1-thread one).
PLACEMENT_VARIABLES = ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY",
                       "KMP_AFFINITY", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
                       "NUMBA_NUM_THREADS", "MKL_NUM_THREADS")


def allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


@dataclass(frozen=True)
class Placement:
    """`threads` compute threads for the target on the first `threads` allowed cores; None: auto."""

    threads: int | None

    @property
    def name(self) -> str:
        if self.threads is None:
            return "auto"
        return f"{self.threads}thread" + ("s" if self.threads > 1 else "")

    def target_cpus(self, cpus: list[int]) -> list[int]:
        return list(cpus) if self.threads is None else list(cpus[: self.threads])

    def spare_cpus(self, cpus: list[int]) -> list[int]:
        """Cores the target does not use (where Smurfs' drafters go); empty for auto."""
        return [] if self.threads is None else list(cpus[self.threads:])

    def offline_env(self, cpus: list[int]) -> dict[str, str]:
        """In-process engine (offline runs): OpenMP settings of the target's own process."""
        if self.threads is None:
            return {}
        places = ",".join(f"{{{c}}}" for c in self.target_cpus(cpus))
        return {"OMP_NUM_THREADS": str(self.threads), "OMP_PLACES": places,
                "OMP_PROC_BIND": "close"}

    def served_env(self, cpus: list[int]) -> dict[str, str]:
        """`vllm serve` (multiprocess engine): vLLM binds its worker's threads itself."""
        if self.threads is None:
            return {}
        return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in self.target_cpus(cpus))}


def parse_placement(text: str, num_cpus: int) -> Placement:
    if text == "auto":
        return Placement(None)
    match = re.fullmatch(r"(\d+)threads?", text)
    if not match:
        raise ValueError(f"placement {text!r}: expected 'auto' or '<N>thread(s)' (e.g. 1thread, "
                         f"2threads)")
    threads = int(match.group(1))
    if not 1 <= threads <= num_cpus:
        raise ValueError(f"placement {text!r}: {threads} threads but this process may use "
                         f"{num_cpus} cores")
    return Placement(threads)


def default_placement(name: str, num_cpus: int) -> Placement:
    if name == "smurfs":
        return Placement(max(1, num_cpus - 1))
    return Placement(num_cpus)


@dataclass(frozen=True)
class MethodSpec:
    name: str
    k: int | None
    placement: Placement

    @property
    def label(self) -> str:
        k = f":{self.k}" if self.k is not None else ""
        return f"{self.name}{k}@{self.placement.name}"


def parse_method(text: str, num_cpus: int) -> MethodSpec:
    match = re.fullmatch(r"([a-z_]+)(?::(\d+))?(?:@(.+))?", text.strip())
    if not match:
        raise ValueError(f"method {text!r}: expected NAME[:K][@PLACEMENT], e.g. draft_model:4@2threads")
    name, k_text, placement_text = match.groups()
    if name not in METHOD_NAMES:
        raise ValueError(f"method {text!r}: unknown name {name!r}; expected one of "
                         f"{', '.join(METHOD_NAMES)}")
    if name == "none" and k_text is not None:
        raise ValueError(f"method {text!r}: 'none' takes no K")
    if name != "none" and k_text is None:
        raise ValueError(f"method {text!r}: give num_speculative_tokens as {name}:K")
    k = int(k_text) if k_text is not None else None
    if k is not None and not 1 <= k <= 16:
        raise ValueError(f"method {text!r}: K must be 1 to 16")
    placement = (parse_placement(placement_text, num_cpus) if placement_text
                 else default_placement(name, num_cpus))
    return MethodSpec(name, k, placement)


def parse_methods(text: str, num_cpus: int) -> list[MethodSpec]:
    specs = [parse_method(part, num_cpus) for part in text.split(",") if part.strip()]
    labels = [s.label for s in specs]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise ValueError(f"--methods lists {', '.join(duplicates)} more than once")
    if not specs:
        raise ValueError("--methods is empty")
    return specs


@dataclass(frozen=True)
class MethodSettings:
    """Run-wide settings a method's speculative config depends on."""

    drafts: tuple[str, ...] = ()  # draft model paths; draft_model uses the first, Smurfs all
    ngram_min: int = 2  # n-gram lengths of vLLM's ngram and Smurfs' n-gram voter, the same
    ngram_max: int = 4
    smurfs_extra: tuple[tuple[str, Any], ...] = ()  # extra top-level Smurfs config keys
    smurfs_ngram_voter: bool = True


def speculative_config(spec: MethodSpec, settings: MethodSettings,
                       cpus: list[int]) -> dict[str, Any] | None:
    """The `speculative_config` of `spec` (None for no speculation)."""
    if spec.name == "none":
        return None
    if spec.name == "ngram":
        return {"method": "ngram", "num_speculative_tokens": spec.k,
                "prompt_lookup_min": settings.ngram_min, "prompt_lookup_max": settings.ngram_max}
    if spec.name == "suffix":
        return {"method": "suffix", "num_speculative_tokens": spec.k}
    if not settings.drafts:
        raise ValueError(f"method {spec.label} needs a draft model: pass --draft PATH")
    if spec.name == "draft_model":
        return {"method": "draft_model", "model": settings.drafts[0],
                "num_speculative_tokens": spec.k}
    spare = spec.placement.spare_cpus(cpus)
    drafter_extra: dict[str, Any] = {"num_threads": 1}
    if spare:
        drafter_extra["cpus"] = spare
    drafters: list[dict[str, Any]] = [{"model": d, **drafter_extra} for d in settings.drafts]
    if settings.smurfs_ngram_voter:
        drafters.append({"method": "ngram", "prompt_lookup_min": settings.ngram_min,
                         "prompt_lookup_max": settings.ngram_max})
    return {"method": "smurfs", "num_speculative_tokens": spec.k, "drafters": drafters,
            **dict(settings.smurfs_extra)}


def child_env(spec: MethodSpec, mode: str, cpus: list[int],
              base: dict[str, str] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """(full environment, the placement part of it) for a method's child process.

    mode is "offline" (in-process engine) or "served" (`vllm serve`). NUMBA_NUM_THREADS=1
    always: vLLM's ngram proposer imports numba, which otherwise raises torch's thread count
    mid-run (a 1-thread method silently gets the second core).
    """
    env = {k: v for k, v in (base if base is not None else os.environ).items()
           if k not in PLACEMENT_VARIABLES}
    placement = (spec.placement.offline_env(cpus) if mode == "offline"
                 else spec.placement.served_env(cpus))
    placement = {**placement, "NUMBA_NUM_THREADS": "1"}
    env.update(placement)
    return env, placement
