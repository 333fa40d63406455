"""The drafter runtime: N drafters, each drafting for every request of a step.

A model drafter sits in the target's worker (`drafters.in_worker`, the default: synchronous, on
vLLM's draft-model machinery; the proposer drives it), in a process of its own, or in a Ray
actor (`drafters.ray_actor`). Process and Ray drafters (`drafters.process_server`) each run their
own vLLM engine and stream their drafts: per request a drafter keeps a *path* (the text it expects,
its own greedy continuation of a context), extended one engine step at a time while the target
verifies. Their clients (`drafters.process_client`) mirror those
paths; a step takes from each path what is ready and consistent with the request's current text,
and tells the drafters where the text goes next (`track`).
Model-free voters (`drafters.model_free`: n-gram and suffix) run in this process: they cost
microseconds.

Faults cost speculation, never a request: a drafter with nothing ready gives no draft for the
step; one that crashes, or stays silent past ``draft_timeout_s`` while it owes an answer, is
stopped and left out for the rest of the run. Both show in the log and in `DrafterHealth`.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from vllm_smurfs import cores
from vllm_smurfs.config import (
    ModelDrafterConfig,
    NgramDrafterConfig,
    SmurfsConfig,
    SuffixDrafterConfig,
)
from vllm_smurfs.cores import ElasticThreads
from vllm_smurfs.drafters.model_free import NgramVoter, SuffixVoter
from vllm_smurfs.drafters.process_client import DrafterHealth, ModelDrafterClient

logger = logging.getLogger(__name__)

# Polling granularity while a step waits for drafts (the wait ends as soon as they are there).
_WAIT_SLICE_S = 0.005


@dataclass(frozen=True)
class DraftRequest:
    req_id: str
    context: np.ndarray  # [num_tokens] int: prompt + output so far
    k: int  # most draft tokens wanted
    num_prompt_tokens: int | None = None  # where the prompt ends in context (None: unknown)


class ModelFreeDrafter:
    """A model-free voter behind the same interface as a model drafter."""

    def __init__(self, spec: NgramDrafterConfig | SuffixDrafterConfig) -> None:
        self.spec = spec
        self.name = spec.display_name
        self.health = DrafterHealth(self.name)
        self._suffix: SuffixVoter | None = None
        self._ngram: NgramVoter | None = None
        if isinstance(spec, SuffixDrafterConfig):
            self._suffix = SuffixVoter(spec.suffix_decoding_max_tree_depth,
                                       spec.suffix_decoding_max_cached_requests,
                                       spec.suffix_decoding_max_spec_factor,
                                       spec.suffix_decoding_min_token_prob)
        else:
            self._ngram = NgramVoter(spec.prompt_lookup_min, spec.prompt_lookup_max)

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        self.health.steps_answered += 1
        return [self.draft(r) for r in requests]

    def draft(self, request: DraftRequest) -> list[int]:
        if self._suffix is not None:
            return self._suffix.propose(request.req_id, request.context, request.k,
                                        request.num_prompt_tokens)
        assert self._ngram is not None
        return self._ngram.propose(request.context, request.k)

    def forget(self, req_ids: Sequence[str]) -> None:
        """The requests ended (or were preempted): a suffix voter keeps their outputs only."""
        if self._suffix is not None:
            self._suffix.forget(req_ids)


class DrafterPool:
    """Every drafter's drafts for every request; the vote happens in the proposer.

    Not a vLLM worker: the proposer's pool of drafters, model-free voters, in-worker drafters and
    process drafters' clients."""

    def __init__(self, config: SmurfsConfig, dtype: str, max_model_len: int, max_num_seqs: int,
                 trust_remote_code: bool = False,
                 in_worker: Callable[[int, ModelDrafterConfig], Any] | None = None) -> None:
        """``in_worker(index, spec)`` builds the in-worker drafter of ``config.drafters[index]``
        (`drafters.in_worker.InWorkerDrafter`: it needs the engine's config)."""
        self.config = config
        self.drafters: list[Any] = []
        full, placements = _place_drafters(config) if config.process_drafters else (1, {})
        lent = 0
        for index, spec in enumerate(config.drafters):
            if isinstance(spec, ModelDrafterConfig) and spec.placement == "worker":
                if in_worker is None:
                    raise ValueError(f"speculative_config.drafters[{index}]: an in-worker "
                                     "drafter needs the target's worker")
                self.drafters.append(in_worker(index, spec))
            elif isinstance(spec, ModelDrafterConfig):
                cpus, borrowed, threads = placements[index]
                lent = max(lent, borrowed)
                client = ModelDrafterClient
                if spec.placement == "ray":
                    from vllm_smurfs.drafters.ray_actor import RayDrafterClient as client
                self.drafters.append(client(
                    spec, dtype, max_model_len, max_num_seqs, trust_remote_code,
                    hang_timeout_s=config.draft_timeout_s, cpus=cpus, num_threads=threads))
            else:
                self.drafters.append(ModelFreeDrafter(spec))
        #: The target's threads, lent in part to pipelined drafters sharing its cores.
        self.elastic = ElasticThreads(full, min(lent, full - 1))
        if placements:
            logger.info("Smurfs placement: target %d threads, drafters on cores %s; %s",
                        full, [p[0] for p in placements.values()],
                        f"the target lends {self.elastic.lent_threads} thread(s) while model "
                        "drafters draft" if self.elastic.enabled else "no core is shared")

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.drafters]

    @property
    def model_drafters(self) -> list[ModelDrafterClient]:
        """The process drafters."""
        return [d for d in self.drafters if isinstance(d, ModelDrafterClient)]

    @property
    def model_free_indices(self) -> list[int]:
        """Positions of the model-free voters in `names` (and in each request's drafts)."""
        return [i for i, d in enumerate(self.drafters) if isinstance(d, ModelFreeDrafter)]

    @property
    def in_worker_indices(self) -> list[int]:
        """Positions of the in-worker drafters in `names` (and in each request's drafts)."""
        return [i for i, d in enumerate(self.drafters)
                if not isinstance(d, (ModelDrafterClient, ModelFreeDrafter))]

    @property
    def lends_cores(self) -> bool:
        """Whether the target lends cores to the model drafters while they draft."""
        return self.elastic.enabled

    @property
    def model_indices(self) -> list[int]:
        """Positions of the model drafters in `names` (and in each request's drafts)."""
        return [i for i, d in enumerate(self.drafters) if isinstance(d, ModelDrafterClient)]

    def start(self, timeout_s: float = 600.0) -> None:
        """Start all model drafters at once and wait until each is ready or left out."""
        for drafter in self.model_drafters:
            drafter.start()
        # Closed when this runtime goes (the engine shut down and let its runner go) or at exit,
        # whichever comes first; the finalizer holds the drafters, not the runtime.
        self._finalizer = weakref.finalize(self, _close_all, self.elastic, self.model_drafters)
        deadline = time.monotonic() + timeout_s
        for drafter in self.model_drafters:
            drafter.wait_ready(max(1.0, deadline - time.monotonic()))
        if self.model_drafters and not any(d.health.alive for d in self.model_drafters):
            logger.error("No Smurfs model drafter started; only model-free voters will draft.")

    def poll(self) -> None:
        for drafter in self.model_drafters:
            drafter.poll()

    @property
    def models_alive(self) -> bool:
        """Whether any model drafter (streaming or in-worker) can still draft."""
        return (any(d.alive for d in self.model_drafters)
                or any(self.drafters[i].health.alive for i in self.in_worker_indices))

    def model_free_drafts(self, requests: Sequence[DraftRequest]) -> list[list[list[int]]]:
        """drafts[i][d] as `ready` gives them, from the model-free voters only (microseconds;
        model drafters' entries empty)."""
        drafts: list[list[list[int]]] = [[[] for _ in self.drafters] for _ in requests]
        for d, drafter in enumerate(self.drafters):
            if isinstance(drafter, ModelFreeDrafter):
                for i, tokens in enumerate(drafter.propose(requests)):
                    drafts[i][d] = tokens
        return drafts

    def use_models(self, on: bool) -> None:
        """Model drafters draft (the target lends them the cores it shares with them) or are
        paused (their processes stopped, and the target takes its cores back)."""
        for drafter in self.model_drafters:
            if on:
                drafter.resume()
            else:
                drafter.pause()
        self.elastic.lend(on)

    def ready(self, requests: Sequence[DraftRequest], models: bool = True,
              free: Sequence[list[list[int]]] | None = None) -> list[list[list[int]]]:
        """drafts[i][d]: drafter d's draft for requests[i] now (empty when it has none; model
        drafters' are left empty unless ``models``). ``free``: `model_free_drafts` of the same
        requests taken earlier in the step at lookaheads >= their k, cut here to k (an n-gram
        draft's prefix is the shorter draft), instead of drafting them again."""
        if free is None:
            drafts = self.model_free_drafts(requests)
        else:
            drafts = [[tokens[: r.k] for tokens in per] for r, per in zip(requests, free,
                                                                             strict=True)]
        if models:
            for d, drafter in enumerate(self.drafters):
                if isinstance(drafter, ModelDrafterClient):
                    for i, r in enumerate(requests):
                        drafts[i][d] = drafter.draft_for(r.req_id, r.context, r.k)
        return drafts

    def late(self, requests: Sequence[DraftRequest]) -> list[tuple[int, int]]:
        """(index, tokens ready) of the requests with fewer than k draft tokens ready from any
        model drafter while one is still drafting for their current text."""
        out = []
        for i, r in enumerate(requests):
            ready = max((len(d.draft_for(r.req_id, r.context, r.k)) for d in self.model_drafters),
                        default=0)
            if ready < r.k and any(d.is_drafting(r.req_id, r.context)
                                   for d in self.model_drafters):
                out.append((i, ready))
        return out

    def wait(self, requests: Sequence[DraftRequest], timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until every model drafter has k tokens for every request, or
        has nothing more coming for it; True if nothing was still missing at the end."""
        deadline = time.monotonic() + timeout_s
        while True:
            missing = [d for d in self.model_drafters if self._missing(d, requests)]
            if not missing:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                for drafter in missing:
                    drafter.health.steps_late += 1
                return False
            for drafter in missing:
                drafter.poll(min(left, _WAIT_SLICE_S) / len(missing))

    @staticmethod
    def _missing(drafter: ModelDrafterClient, requests: Sequence[DraftRequest]) -> bool:
        return any(len(drafter.draft_for(r.req_id, r.context, r.k)) < r.k
                   and drafter.is_drafting(r.req_id, r.context) for r in requests)

    def track(self, requests: Sequence[DraftRequest], chains: Sequence[Sequence[int]],
              max_lead: Sequence[int]) -> None:
        """Tell the model drafters each request's text continues with ``chains`` (the voted
        drafts now being verified): they draft on past them, up to ``max_lead`` tokens."""
        items = [(r.req_id, np.concatenate([r.context, np.asarray(chain, r.context.dtype)]),
                  lead, len(r.context)) for r, chain, lead in zip(requests, chains, max_lead)]
        for drafter in self.model_drafters:
            drafter.track(items)

    def step_timings(self) -> list[tuple[int, float]]:
        """(num_reqs, seconds) of every model drafter's engine steps since the last call."""
        out: list[tuple[int, float]] = []
        for drafter in self.model_drafters:
            out.extend(drafter.step_timings)
            drafter.step_timings.clear()
        return out

    def forget(self, req_ids: Sequence[str]) -> None:
        for drafter in self.model_drafters:
            drafter.forget(req_ids)
        for index in self.in_worker_indices + self.model_free_indices:
            self.drafters[index].forget(req_ids)

    def health(self) -> list[DrafterHealth]:
        return [d.health for d in self.drafters]

    def close(self) -> None:
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        else:
            _close_all(self.elastic, self.model_drafters)


def collect_streamed(pool: DrafterPool, config: SmurfsConfig, requests: Sequence[DraftRequest],
                     drafts: list[list[list[int]]], rows: Sequence[int], lookaheads: Sequence[int],
                     in_hand: bool, wait_s: Callable[[list[tuple[int, int]], float], float]
                     ) -> float:
    """The process drafters' drafts for ``requests[rows]`` at ``lookaheads[row]``, written into
    ``drafts``: pipelined, what is ready (after waiting one drafter step at a time while
    ``wait_s(late rows and their tokens ready, seconds left)`` says so, within
    ``config.draft_wait_s``); synchronous, exactly the lookaheads, waited for
    (``config.draft_timeout_s``). Returns the seconds waited."""
    started = time.perf_counter()
    wanted = [replace(requests[i], k=lookaheads[i]) for i in rows]
    if config.pipeline:
        if not in_hand:
            return 0.0  # just switched on: they start drafting while the target verifies
        chosen = [j for j, r in enumerate(wanted) if r.k > 0]
        while (late := pool.late([wanted[j] for j in chosen])):
            left = config.draft_wait_s - (time.perf_counter() - started)
            seconds = wait_s([(rows[chosen[j]], ready) for j, ready in late], max(0.0, left))
            if seconds <= 0:
                break
            pool.wait([wanted[chosen[j]] for j, _ in late], seconds)
    else:
        pool.track(wanted, [[] for _ in wanted], [r.k for r in wanted])
        pool.wait(wanted, config.draft_timeout_s)
    ready = pool.ready(wanted, True, [drafts[i] for i in rows])
    for i, new in zip(rows, ready, strict=True):
        for d in pool.model_indices:
            drafts[i][d] = new[d]
    return time.perf_counter() - started


def _close_all(elastic: ElasticThreads, drafters: Sequence[ModelDrafterClient]) -> None:
    elastic.close()
    for drafter in drafters:
        drafter.close()


def _place_drafters(config: SmurfsConfig) -> tuple[int, dict[int, tuple[list[int], int, int]]]:
    """The target's thread count and, per model drafter (by index in ``config.drafters``), (its
    cores, target threads it borrows, its threads). See `cores.plan_placement`: cores the target
    leaves spare first; a synchronous drafter on the target's cores takes the target's thread
    count."""
    threads = cores.spin_up_threads()
    bound = cores.target_cpus(threads)
    every = cores.allowed_cpus()
    out = {}
    for index, spec in enumerate(config.drafters):
        if not isinstance(spec, ModelDrafterConfig) or spec.placement == "worker":
            continue
        own = spec.num_threads or 1
        if bound is None:
            # The target's threads float over every core: nothing to lend, nothing is spare.
            cpus, borrowed = (sorted(set(spec.cpus)) if spec.cpus else every), 0
        else:
            cpus, borrowed = cores.plan_placement(bound, every, spec.cpus, own, config.pipeline)
        shares_turns = bound is not None and not config.pipeline and set(cpus) <= set(bound)
        out[index] = (cpus, borrowed, spec.num_threads or (threads if shares_turns else 1))
    return threads, out
