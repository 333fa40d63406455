"""Methods under test and where their threads run.

A method is written `NAME[/VARIANT][:K][@PLACEMENT]`:

    none@2threads  ngram:4  draft_model:2  draft_model:6@1thread  suffix:4  smurfs:4@1thread
    draft_model/table:6  ngram/long:8  smurfs/sync:4   (variants defined with --variant)

NAME is one of METHOD_NAMES; K (num_speculative_tokens) is required for every method but `none`.
VARIANT (any method but `none`) names a JSON object given by `--variant NAME=JSON` (alias
`--smurfs-variant`) whose keys are merged into the method's speculative config (top-level keys
added or replaced), so that several variants of a method run side by side in one run.
PLACEMENT says how many compute threads the target gets, on which cores (the first N cores this
process may use); `auto` leaves vLLM's own choice. By default every method's target gets all
cores; Smurfs' model drafters then run in the target's worker, on its threads (the default
placement). `smurfs:K@1thread` on 2 cores gives them a core of their own instead, as drafter
processes (`"placement": "process"`).
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

METHOD_NAMES = ("none", "ngram", "draft_model", "suffix", "smurfs")

#: Inherited variables that decide thread placement: dropped from every child's environment so
#: that only the method's placement applies (a parent shell's OMP_NUM_THREADS=1 would otherwise
#: silently turn a 2-thread baseline into a 1-thread one).
PLACEMENT_VARIABLES = ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY",
                       "KMP_AFFINITY", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
                       "NUMBA_NUM_THREADS", "MKL_NUM_THREADS")

#: glibc's allocator thresholds fixed for every method's engine (docs/configuration.md, CPU).
#: Left dynamic, they follow the process's history of allocations, and an engine with an
#: in-worker drafter prefilled the same prompts 6% slower than one without, with nothing drafted;
#: fixed, both ran as fast and two passes agreed within 1% (2026-12-06-prompt-pending). A value
#: the parent sets wins; `--glibc-malloc-defaults` leaves them out.
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "1073741824"}


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
    return Placement(num_cpus)


@dataclass(frozen=True)
class MethodSpec:
    name: str
    k: int | None
    placement: Placement
    variant: str | None = None  # a name given by --variant (any method but none)

    @property
    def label(self) -> str:
        variant = f"/{self.variant}" if self.variant else ""
        k = f":{self.k}" if self.k is not None else ""
        return f"{self.name}{variant}{k}@{self.placement.name}"


def parse_method(text: str, num_cpus: int, variants: Iterable[str] = ()) -> MethodSpec:
    match = re.fullmatch(r"([a-z_]+)(?:/([A-Za-z0-9_.-]+))?(?::(\d+))?(?:@(.+))?", text.strip())
    if not match:
        raise ValueError(f"method {text!r}: expected NAME[/VARIANT][:K][@PLACEMENT], "
                         "e.g. draft_model:4@2threads")
    name, variant, k_text, placement_text = match.groups()
    if name not in METHOD_NAMES:
        raise ValueError(f"method {text!r}: unknown name {name!r}; expected one of "
                         f"{', '.join(METHOD_NAMES)}")
    if variant is not None and name == "none":
        raise ValueError(f"method {text!r}: 'none' takes no /VARIANT (it has no speculative "
                         "config to merge one into)")
    variants = list(variants)
    if variant is not None and variant not in variants:
        raise ValueError(f"method {text!r}: variant {variant!r} is not defined; define it with "
                         f"--variant '{variant}={{...}}' (defined: "
                         f"{', '.join(variants) or 'none'})")
    if name == "none" and k_text is not None:
        raise ValueError(f"method {text!r}: 'none' takes no K")
    if name != "none" and k_text is None:
        raise ValueError(f"method {text!r}: give num_speculative_tokens as {name}:K")
    k = int(k_text) if k_text is not None else None
    if k is not None and not 1 <= k <= 16:
        raise ValueError(f"method {text!r}: K must be 1 to 16")
    placement = (parse_placement(placement_text, num_cpus) if placement_text
                 else default_placement(name, num_cpus))
    return MethodSpec(name, k, placement, variant)


def parse_methods(text: str, num_cpus: int, variants: Iterable[str] = ()) -> list[MethodSpec]:
    variants = list(variants)
    specs = [parse_method(part, num_cpus, variants) for part in text.split(",") if part.strip()]
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
    #: {variant name: keys merged into the speculative config of NAME/VARIANT:K}, applied last
    #: (after smurfs_extra for Smurfs)
    variants: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()

    @classmethod
    def variants_of(cls, variants: dict[str, dict[str, Any]]
                    ) -> tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]:
        """{name: keys} (as --variant gives them) in this frozen class's form."""
        return tuple((name, tuple(keys.items())) for name, keys in variants.items())


#: Keys a variant may not change: they are in the method's label (NAME, K), which must say what ran.
LABELLED_KEYS = ("method", "num_speculative_tokens")


def merge_variant(config: dict[str, Any], keys: dict[str, Any], label: str) -> dict[str, Any]:
    """`config` with a variant's top-level keys added or replaced (values copied); a key
    written ``+KEY`` extends the list under KEY instead (``{"+drafters": [{"method":
    "suffix"}]}``: the method's drafters and a suffix voter)."""
    for key in LABELLED_KEYS:
        if key in keys and keys[key] != config.get(key):
            raise ValueError(f"method {label}: its variant sets {key}={keys[key]!r} but the label "
                             f"says {config.get(key)!r}; give the method and K in the method name")
    out = dict(config)
    for key, value in copy.deepcopy(keys).items():
        if key.startswith("+"):
            base = out.get(key[1:], [])
            if not isinstance(base, list) or not isinstance(value, list):
                raise ValueError(f"method {label}: its variant extends {key[1:]} ({key}), which "
                                 "takes a list on both sides")
            out[key[1:]] = [*base, *value]
        else:
            out[key] = value
    return out


def speculative_config(spec: MethodSpec, settings: MethodSettings,
                       cpus: list[int]) -> dict[str, Any] | None:
    """The `speculative_config` of `spec` (None for no speculation), its variant merged in."""
    config = _base_config(spec, settings, cpus)
    if config is None or spec.variant is None:
        return config
    variants = dict(settings.variants)
    if spec.variant not in variants:
        raise ValueError(f"method {spec.label}: variant {spec.variant!r} is not defined "
                         f"(--variant '{spec.variant}={{...}}')")
    return merge_variant(config, dict(variants[spec.variant]), spec.label)


def _base_config(spec: MethodSpec, settings: MethodSettings,
                 cpus: list[int]) -> dict[str, Any] | None:
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
    # Drafters in the target's worker, on its threads (the default placement); where the target
    # leaves cores free, drafter processes there instead, one thread each.
    drafter_extra: dict[str, Any] = ({"placement": "process", "num_threads": 1, "cpus": spare}
                                     if spare else {})
    drafters: list[dict[str, Any]] = [{"model": d, **drafter_extra} for d in settings.drafts]
    if settings.smurfs_ngram_voter:
        drafters.append({"method": "ngram", "prompt_lookup_min": settings.ngram_min,
                         "prompt_lookup_max": settings.ngram_max})
    return {"method": "smurfs", "num_speculative_tokens": spec.k, "drafters": drafters,
            **copy.deepcopy(dict(settings.smurfs_extra))}


def missing_dependency(spec: MethodSpec) -> str | None:
    """Why `spec` cannot run in this environment, before paying for an engine start; or None."""
    import importlib.util

    if spec.name == "suffix" and importlib.util.find_spec("arctic_inference") is None:
        return ("vLLM's suffix decoding needs arctic-inference, which is not installed (no wheel "
                "for this platform: `pip install --no-build-isolation arctic-inference` builds "
                "it from its sdist in ~20 s, with nanobind and grpcio-tools installed)")
    return None


def child_env(spec: MethodSpec, mode: str, cpus: list[int], base: dict[str, str] | None = None,
              allocator: bool = True) -> tuple[dict[str, str], dict[str, str]]:
    """(full environment, the placement part of it) for a method's child process.

    The placement part holds the thread placement and, with `allocator`, glibc's thresholds
    (`ALLOCATOR_ENV`, each unless the parent set it): the settings a result records per method.

    mode is "offline" (in-process engine) or "served" (`vllm serve`). NUMBA_NUM_THREADS is set
    to the placement's thread count: vLLM's ngram proposer starts numba's OpenMP layer, which
    sets the process's OpenMP thread count -- torch's too -- to NUMBA_NUM_THREADS (default: all
    cores). Left alone, a 1-thread method silently gets a second thread; set to 1 under a
    2-thread placement, it silently loses one (both seen here).
    """
    env = {k: v for k, v in (base if base is not None else os.environ).items()
           if k not in PLACEMENT_VARIABLES}
    placement = (spec.placement.offline_env(cpus) if mode == "offline"
                 else spec.placement.served_env(cpus))
    if spec.placement.threads is not None:
        placement = {**placement, "NUMBA_NUM_THREADS": str(spec.placement.threads)}
    if allocator:
        placement = {**placement, **{k: env.get(k, v) for k, v in ALLOCATOR_ENV.items()}}
    env.update(placement)
    return env, placement
