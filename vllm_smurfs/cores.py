"""Where the target's compute threads run, and lending some of its cores to the drafters.

On a machine with cores the target does not use, model drafters run there and nothing here
matters. Without a spare core (2 cores, both bound to the target: the fastest setting for no
speculation), a pipelined drafter has to share one. `ElasticThreads` then lets the target give the
drafters' cores up only while model drafters are drafting: the target runs on its first
``lent_threads`` fewer OpenMP threads, and on all of them while speculation is off or model-free.
The length controller decides which mode pays, from step times it measures in each.

OpenMP binds thread ``i`` of a team to the ``i``-th place (vLLM sets ``GOMP_CPU_AFFINITY`` /
``OMP_PLACES`` in its worker); shrinking the team keeps threads ``0..n-1`` on their cores and
growing it back reuses the pooled threads on theirs (seen in /proc on this machine). vLLM's CPU
worker replaces ``torch.set_num_threads`` with a no-op warning after binding, so the original,
``torch._C.set_num_threads``, is called.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

logger = logging.getLogger(__name__)


def thread_affinities(pid: str = "self") -> list[set[int]]:
    out = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("Cpus_allowed_list:"):
                        out.append(parse_cpu_list(line.split(":", 1)[1]))
                        break
        except OSError:
            continue
    return out


def parse_cpu_list(text: str) -> set[int]:
    """``"0-2,5"`` -> {0, 1, 2, 5}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def target_cpus(num_threads: int, affinities: Sequence[set[int]] | None = None) -> list[int] | None:
    """The cores the target's ``num_threads`` compute threads are bound to; None if unbound.

    Bound OpenMP threads each allow one core: when the single-core threads of this process cover
    exactly ``num_threads`` cores, those are the target's. Otherwise the threads float (e.g. an
    in-process engine without OMP places) and no core is the target's own.
    """
    if affinities is None:
        affinities = thread_affinities()
    single = {next(iter(a)) for a in affinities if len(a) == 1}
    if num_threads >= 1 and len(single) == num_threads:
        return sorted(single)
    return None


def spin_up_threads() -> int:
    """Run one parallel region so the OpenMP team exists (and is bound); the thread count."""
    import torch

    a = torch.ones(256, 256)
    _ = a @ a
    return torch.get_num_threads()


def warm_gemms(model: Any, token_counts: Iterable[int]) -> int:
    """Run every CPU linear layer of ``model`` once per token count, at the present thread count;
    the number of calls made.

    vLLM's CPU linear layers (``cpu_linear``) cache one oneDNN primitive per token count, and a
    primitive keeps the thread count it was created with. Created here, before any core is
    lent, the primitives of these token counts use all the target's threads even when a later
    step of that size runs while a core is lent. Best effort: a layer that cannot be called so
    stops the warm-up with a log line, never the engine.
    """
    import torch

    calls = 0
    counts = list(token_counts)
    try:
        with torch.inference_mode():
            for module in model.modules():
                linear = getattr(module, "cpu_linear", None)
                weight = getattr(module, "weight", None)
                if linear is None or not isinstance(weight, torch.Tensor):
                    continue
                k = getattr(module, "input_size_per_partition", None)
                if not k and weight.dim() == 2 and weight.numel():
                    k = weight.shape[1]
                if not k:
                    continue
                for m in counts:
                    linear(torch.zeros(m, k, dtype=weight.dtype), None, None)
                    calls += 1
    except Exception as e:  # noqa: BLE001 - an optimisation must never stop the engine
        logger.warning("Smurfs: warming the target's GEMMs stopped after %d calls: %s", calls, e)
    return calls


class ElasticThreads:
    """The target's OpenMP thread count: all threads, or all but the ones lent to drafters."""

    def __init__(self, full_threads: int, lent_threads: int) -> None:
        if not 0 <= lent_threads < full_threads:
            raise ValueError(f"lent_threads must be in [0, {full_threads}), got {lent_threads}")
        self.full_threads = full_threads
        self.lent_threads = lent_threads
        self.lending = False
        self.switches = 0

    @property
    def enabled(self) -> bool:
        return self.lent_threads > 0

    def lend(self, lend: bool) -> None:
        """Lend the drafters' cores (``True``) or take them back; a no-op when unchanged."""
        if not self.enabled or lend == self.lending:
            return
        import torch

        torch._C.set_num_threads(self.full_threads - self.lent_threads if lend
                                 else self.full_threads)
        self.lending = lend
        self.switches += 1

    def close(self) -> None:
        self.lend(False)


def plan_placement(
    target: Sequence[int], every: Sequence[int], requested: Sequence[int] | None,
    num_threads: int, pipelined: bool,
) -> tuple[list[int], int]:
    """(the drafter's cores, target threads it borrows) for one model drafter.

    ``requested`` (the drafter's ``cpus`` setting) wins. Otherwise: cores the target leaves spare;
    without one, a pipelined drafter borrows the target's last ``num_threads`` cores (the target
    lends them only while model drafters draft) if the target keeps at least one; else (or
    synchronous drafting, which takes turns with the target's step) all the target's cores.
    """
    target_set = set(target)
    if requested:
        cpus = sorted(set(requested))
    else:
        spare = sorted(set(every) - target_set)
        if spare:
            return spare, 0
        if pipelined and len(target) > num_threads:
            cpus = sorted(target)[-num_threads:]
        else:
            return sorted(target), 0
    borrowed = sorted(target_set & set(cpus))
    if not pipelined or not borrowed or len(borrowed) >= len(target):
        return cpus, 0
    # Lending works on the team's last threads: only a borrow of the target's last cores is one.
    if borrowed != sorted(target)[-len(borrowed):]:
        return cpus, 0
    return cpus, len(borrowed)


def allowed_cpus() -> list[int]:
    """Every core some thread of this process may use (vLLM binds each compute thread to one)."""
    allowed: set[int] = set()
    for affinity in thread_affinities():
        allowed |= affinity
    try:
        allowed |= os.sched_getaffinity(0)
    except (AttributeError, OSError):
        pass
    return sorted(allowed) or list(range(os.cpu_count() or 1))
