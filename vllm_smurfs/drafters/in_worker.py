"""A model drafter in the target's worker, on vLLM's own draft-model machinery.

`InWorkerDrafter` is a `DraftModelProposer` (``vllm/v1/spec_decode/draft_model.py``): its weights
load into the target's worker through vLLM's model loader, its attention layers register in the
runner's forward context, so the runner sizes and allocates their KV cache beside the target's
and the drafter reads and writes it through the target's block tables; its forwards run on the
target's threads, one forward per draft position for every request it drafts for. Several can
live in one worker (each registers its layers under its own prefix).

What differs from vLLM's `draft_model` is when the drafter computes. vLLM's drafter runs over
every token the target computes, every step. Here a drafter keeps, per request, how far its KV
cache is in step with the request's text (``synced``) and catches up only when it drafts: its
first forward of a step computes the tokens from ``synced`` to the end of the text (a few tokens
after a step it drafted in, the whole text after a long pause) and yields the first draft token;
each further forward extends the drafts of the requests still going by one token. So a drafter
can sit out steps (when the model-free voters already have a draft worth taking, or when drafting
does not pay) at no cost but a longer catch-up later, and the stopping rule can end each
request's draft at any position, from the drafter's confidence.

A lazy catch-up writes old positions, so the drafter's KV cache must live as long as the
request: local-attention layers (sliding window, chunked) keep a full-attention cache
(`drafters.in_worker_kv`; vLLM's sliding-window manager would free those blocks and hand them to
other requests while the runner's block table still names them), and kinds no such cache can stand
for are refused. Like vLLM's own drafter, a draft costs no host sync per forward (`draft`).

Lossless by construction: drafts are only proposals, which the target's rejection sampler
verifies, and only ids the target has a row for; a drafter's KV cache is its own (the target's
is never written here). A failing drafter costs speculation only, except for a fatal device
error (a CUDA device-side assert, an illegal memory access), after which nothing on the device
can run: it stops the engine with a message naming the drafter.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.config import SpeculativeConfig, VllmConfig, get_layers_from_vllm_config
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.model_loader import get_model
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.draft_model import DraftModelProposer

from vllm_smurfs.config import ModelDrafterConfig
from vllm_smurfs.drafters.in_worker_kv import keep_kv_for_request_lifetime
from vllm_smurfs.drafters.process_client import DrafterHealth
from vllm_smurfs.drafters.sampling import RowSampling, sample_draft_rows

logger = logging.getLogger(__name__)


@dataclass
class PassTiming:
    """One forward of an in-worker drafter."""

    num_tokens: int  # tokens computed (catch-up + draft tokens fed back)
    num_reqs: int  # requests in the forward
    seconds: float
    first: bool  # the step's first forward (catch-up), else a one-token-per-request extension


@dataclass
class DraftRows:
    """The requests one drafting step works on, in the input batch's row order."""

    req_ids: list[str]
    rows: np.ndarray  # [n] int: each request's row in the input batch (and its block table)
    contexts: list[np.ndarray]  # [n][num_tokens] int: each request's text so far
    caps: list[int]  # [n] most draft tokens per request
    sampling: RowSampling | None = None  # the requests' sampling settings (None: all greedy)


@dataclass
class DraftResult:
    tokens: list[list[int]]  # [n][<= cap] draft tokens per request
    confidences: list[list[float]]  # [n][same] the drafter's probability of each token
    passes: list[PassTiming] = field(default_factory=list)
    # [n] for a request that samples: q [len(tokens[i]), vocab] its tokens were drawn from, on
    # the device; None for greedy requests (and when no request samples: an empty list)
    probs: list[torch.Tensor | None] = field(default_factory=list)


_NO_IDS = np.zeros(0, dtype=np.int64)


#: The extra output rows of a draft come in multiples of this (the last id repeated, its copies'
#: logits masked): a matrix product of a shape not seen before costs ~0.5 ms on CPU (oneDNN
#: builds its primitive), and the number of the texts' ids changes with every new request.
_COLUMN_QUANTUM = 64


@dataclass
class _ContextColumns:
    """Output rows a draft computes beyond the vocabulary limit: ids of the requests' texts."""

    ids: torch.Tensor  # [m] int64, on the device: the id of column limit + j (ascending; padded)
    weight: torch.Tensor | None  # [m, hidden] their output-layer rows (None: logits computed whole)
    count: int  # the ids that are not padding (the first ones)
    width: int  # the largest id + 1

    def mask_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [n, m] of these columns with the padding's at -inf (never drafted)."""
        if self.count < logits.shape[1]:
            logits[:, self.count:] = float("-inf")
        return logits

    def token_ids(self, columns: torch.Tensor, limit: int) -> torch.Tensor:
        """The token id of each logits column index in ``columns``."""
        extra = self.ids[(columns - limit).clamp(min=0)]
        return torch.where(columns < limit, columns, extra)

    def probs_by_id(self, probs: torch.Tensor, limit: int) -> torch.Tensor:
        """[n, width] ``probs`` [n, limit + m] with each column at its token id."""
        out = probs.new_zeros((probs.shape[0], self.width))
        out[:, :limit] = probs[:, :limit]
        out[:, self.ids[:self.count]] = probs[:, limit:limit + self.count]
        return out


#: stop(active, confidences, drafted_s) -> the requests (indices into DraftRows) that get one more
#: draft token; called after every forward with the requests still below their cap, every
#: request's confidences so far, and the seconds the forwards took so far.
StopRule = Callable[[list[int], list[list[float]], float], list[int]]


def _speculative_config(spec: ModelDrafterConfig, vllm_config: VllmConfig,
                        num_speculative_tokens: int) -> SpeculativeConfig:
    """vLLM's own ``draft_model`` configuration for this drafter (validates the model)."""
    target_parallel = vllm_config.parallel_config
    settings: dict[str, Any] = dict(
        method="draft_model",
        model=spec.model,
        num_speculative_tokens=num_speculative_tokens,
        draft_tensor_parallel_size=target_parallel.tensor_parallel_size,
        max_model_len=spec.max_model_len,
        target_model_config=vllm_config.model_config,
        target_parallel_config=target_parallel,
    )
    try:
        config = SpeculativeConfig(**settings)
    except ValueError as exc:  # pydantic's ValidationError is one
        if "same vocabulary size" not in str(exc):
            raise
        # One tokenizer, embeddings padded to other sizes (the tokenizers were compared at
        # start-up: SmurfsConfig.check_against_target). vLLM's draft_model refuses such a pair
        # unless told the vocabularies differ; its id mapping (unused here) is then the
        # identity, and drafts stay below both sizes (`vocab_limit`).
        config = SpeculativeConfig(**settings, use_heterogeneous_vocab=True)
    if spec.dtype != "auto":
        draft = copy.copy(config.draft_model_config)
        draft.dtype = _torch_dtype(spec.dtype)
        config.draft_model_config = draft
    return config


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


class InWorkerDrafter(DraftModelProposer):
    """One small draft model in the target's worker (``placement: "worker"``)."""

    def __init__(self, spec: ModelDrafterConfig, index: int, vllm_config: VllmConfig,
                 num_speculative_tokens: int) -> None:
        self.spec = spec
        self.name = spec.display_name
        self.layer_prefix = f"smurfs_drafter_{index}"
        # The drafter's view of the engine config: the target's, with vLLM's draft_model
        # speculative config for this drafter (a shallow copy: the forward context, where its
        # layers register and the runner finds them, stays the runner's).
        view = copy.copy(vllm_config)
        object.__setattr__(view, "speculative_config",
                           _speculative_config(spec, vllm_config, num_speculative_tokens))
        super().__init__(view, torch.device(vllm_config.device_config.device))
        self.draft_dtype = self.draft_model_config.dtype
        #: Context length the drafter can draft at (its own limit, at most the target's).
        self.max_context = int(self.draft_model_config.max_model_len)
        self.kv_cache_gid = -1
        self.health = DrafterHealth(self.name)
        # Per request: positions whose KV this drafter has computed for the request's text.
        self._synced: dict[str, int] = {}
        # Fault injection for the fault tests (as for process drafters, see
        # drafters.process_server):
        # SMURFS_DRAFTER_FAULT=NAME=raise_after:N makes drafter NAME fail its N+1-th step
        # (device_assert_after:N: with CUDA's device-side assert message, which is fatal);
        # NAME=stall_first:SECONDS makes its first forward after start-up take SECONDS longer
        # (a first call that built kernels: a poisoned cost curve).
        target, _, fault = os.environ.get("SMURFS_DRAFTER_FAULT", "").partition("=")
        kind, _, count = fault.partition(":")
        mine = target == self.name
        faulty = mine and kind in ("raise_after", "device_assert_after")
        self._fault_kind = kind if faulty else ""
        self._fail_after = int(count) if faulty else -1
        self._stall_s = float(count) if mine and kind == "stall_first" else 0.0
        #: Ids it may draft: below the target's vocabulary size (one tokenizer, but embeddings
        #: padded to different sizes) and below ``draft_vocab_size``, ...
        target_vocab = int(vllm_config.model_config.get_vocab_size())
        self.vocab_limit = min(target_vocab, spec.draft_vocab_size or sys.maxsize)
        #: ... or, up to this, an id of the drafted requests' own texts (`_context_columns`;
        #: no more than the vocabulary limit when the whole vocabulary is drafted).
        self.context_vocab_limit = min(target_vocab, self.draft_model_config.get_vocab_size())
        # Per request: (length of its text read, its ids in [vocab_limit, context_vocab_limit)).
        self._context_ids: dict[str, tuple[int, np.ndarray]] = {}

    # -- set-up (called through the Smurfs proposer) -------------------------------------------
    def _get_model(self) -> torch.nn.Module:
        """vLLM's draft-model loading, under this drafter's own layer prefix (several drafters,
        even of one model, must not collide in the forward context)."""
        from vllm.compilation.backends import set_model_tag

        with set_model_tag(self.layer_prefix):
            return get_model(vllm_config=self._create_draft_vllm_config(),
                             prefix=self.layer_prefix)

    def load(self, target_model: torch.nn.Module) -> None:
        started = time.perf_counter()
        self.load_model(target_model)
        # Before the runner sizes the KV cache: local-attention layers get a cache vLLM keeps for
        # the request's whole life (a lazy catch-up writes old positions; see in_worker_kv).
        layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase,
                                             sorted(self._draft_attn_layer_names))
        promoted = keep_kv_for_request_lifetime(layers, self.vllm_config, self.name)
        if promoted:
            logger.info("Smurfs in-worker drafter %s: %d local-attention layers keep a "
                        "full-attention KV cache in the worker", self.name, len(promoted))
        logger.info("Smurfs in-worker drafter %s loaded (%s, %d attention layers) in %.1f s",
                    self.name, self.draft_dtype, len(self._draft_attn_layer_names),
                    time.perf_counter() - started)

    @property
    def layer_names(self) -> set[str]:
        return set(self._draft_attn_layer_names)

    # -- per request state ---------------------------------------------------------------------
    def forget(self, req_ids: Sequence[str]) -> None:
        for req_id in req_ids:
            self._synced.pop(req_id, None)
            self._context_ids.pop(req_id, None)

    def catch_up_tokens(self, req_id: str, num_tokens: int) -> int:
        """Tokens the first forward would compute for this request now (its text is
        ``num_tokens`` long)."""
        return num_tokens - min(self._synced.get(req_id, 0), num_tokens - 1)

    # -- drafting -------------------------------------------------------------------------------
    def can_draft(self, num_tokens: int) -> bool:
        """Whether it drafts for a request whose text is ``num_tokens`` long (alive, and the text
        plus a draft token within its context limit)."""
        return self.health.alive and num_tokens < self.max_context

    def draft_safely(self, req_ids: list[str], rows: np.ndarray, contexts: list[np.ndarray],
                     caps: list[int], runner: Any, stop: StopRule | None,
                     sampling: RowSampling | None = None) -> DraftResult:
        """`draft` through the runner's block table; an error costs speculation only: it is
        logged, the drafter left out for the rest of the run, and no draft returned. A fatal
        device error (a CUDA device-side assert, an illegal memory access: the device's state is
        lost for every later kernel, the target's too) stops the engine instead, with a message
        that says which drafter and why."""
        empty = DraftResult([[] for _ in req_ids], [[] for _ in req_ids])
        if not self.health.alive:
            return empty
        try:
            if self._fail_after == self.health.steps_answered:
                raise self._injected_fault()
            table = runner.input_batch.block_table[self.kv_cache_gid].get_device_tensor(
                runner.input_batch.num_reqs)
            result = self.draft(DraftRows(req_ids, rows, contexts, caps, sampling), table, stop)
        except Exception as exc:  # noqa: BLE001 - a drafter's failure must not fail the step
            self.fail(f"{type(exc).__name__}: {exc}")
            if is_fatal_device_error(exc):
                raise FatalDrafterError(
                    f"Smurfs in-worker drafter '{self.name}' hit a fatal device error "
                    f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). "
                    "Errors of this kind leave the device unusable for every later kernel, the "
                    "target's too, so the engine stops instead of going on without the drafter. "
                    "Rerun with CUDA_LAUNCH_BLOCKING=1 to locate the kernel; to keep serving "
                    "meanwhile, leave the drafter out or run it in a process of its own "
                    "(\"placement\": \"process\").") from exc
            logger.exception("Smurfs in-worker drafter %s failed", self.name)
            return empty
        self.health.steps_answered += 1
        self.health.busy_s += sum(p.seconds for p in result.passes)
        return result

    def _injected_fault(self) -> Exception:
        if self._fault_kind == "device_assert_after":
            # CUDA's own wording (torch raises it as a RuntimeError subclass).
            return RuntimeError("CUDA error: device-side assert triggered (injected fault, "
                                "SMURFS_DRAFTER_FAULT)")
        return RuntimeError("injected fault (SMURFS_DRAFTER_FAULT)")

    def fail(self, reason: str) -> None:
        if self.health.alive:
            logger.error("Smurfs drafter %s is left out for the rest of the run: %s", self.name,
                         reason)
        self.health.alive = False
        self.health.last_error = reason
        self._synced.clear()
        self._context_ids.clear()

    @torch.inference_mode()
    def draft(self, batch: DraftRows, block_table: torch.Tensor, stop: StopRule | None = None,
              max_tokens_per_forward: int | None = None) -> DraftResult:
        """Draft for every request of ``batch``: up to ``caps[i]`` tokens each, greedy, or sampled
        at the request's settings (``batch.sampling``; then its q rows are kept).

        ``block_table``: [num_rows, max_blocks] the block table of this drafter's KV cache group
        (the target's); row ``rows[i]`` addresses request i. ``stop`` decides after each forward
        which requests go on (default: all, to their cap).

        No host sync per forward, as in vLLM's draft_model: what the host knows (the texts,
        positions, lengths) goes to the device in pinned, non-blocking copies; the slot mapping
        is computed on the device; sampled tokens stay there and are fed back from there. The
        drafts come to the host once, at the end. A ``stop`` rule reads the confidences of each
        forward: one device-to-host copy per forward, and only then.
        """
        n = len(batch.req_ids)
        result = DraftResult([[] for _ in range(n)], [[] for _ in range(n)])
        todo = [i for i in range(n) if batch.caps[i] > 0]
        if not todo:
            return result
        lengths = np.array([len(batch.contexts[i]) for i in range(n)], dtype=np.int64)
        budget = max_tokens_per_forward or self.max_num_tokens
        clock = _PassClock(self.device)
        # Each forward's sampled tokens, on the device: (requests, tokens [m], confidences [m],
        # q [m, vocab] or None when the batch is greedy).
        sampled: list[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        sampling = batch.sampling
        columns = self._context_columns(batch, todo)
        last = torch.zeros(n, dtype=torch.int64, device=self.device)  # latest draft token
        drafted = [0] * n
        confs = result.confidences  # filled per forward only for a stop rule

        def keep(reqs: list[int], tokens: torch.Tensor, conf: torch.Tensor,
                 probs: torch.Tensor | None) -> None:
            sampled.append((reqs, tokens, conf, probs))
            last[self._to_device(np.asarray(reqs, dtype=np.int64))] = tokens
            for i in reqs:
                drafted[i] += 1
            if stop is not None:
                for i, c in zip(reqs, conf.tolist()):  # the one copy per forward a rule needs
                    confs[i].append(c)

        # First forward(s): from each request's synced position to the end of its text.
        starts = {i: min(self._synced.get(batch.req_ids[i], 0), int(lengths[i]) - 1)
                  for i in todo}
        for chunk in _pack(todo, starts, lengths, budget):
            clock.start()
            if self._stall_s:
                time.sleep(self._stall_s)  # injected (SMURFS_DRAFTER_FAULT)
                self._stall_s = 0.0
            ids = np.concatenate([batch.contexts[i][s:e] for i, s, e in chunk])
            positions = np.concatenate([np.arange(s, e) for i, s, e in chunk])
            query_lens = np.array([e - s for _, s, e in chunk], dtype=np.int64)
            seq_lens = np.array([e for _, _, e in chunk], dtype=np.int64)
            hidden = self._forward(ids, positions, query_lens, seq_lens,
                                   batch.rows[[i for i, _, _ in chunk]], block_table)
            ends = np.cumsum(query_lens) - 1
            last_of = [(i, int(ends[k])) for k, (i, _, e) in enumerate(chunk) if e == lengths[i]]
            if last_of:  # segments that end the text yield the first draft token
                pick = self._to_device(np.array([row for _, row in last_of], dtype=np.int64))
                reqs = [i for i, _ in last_of]
                keep(reqs, *self._sample(hidden[pick], sampling, reqs, columns))
            for i, _, e in chunk:
                self._synced[batch.req_ids[i]] = e
            clock.stop(len(ids), len(chunk), first=True)
        # Further forwards: one token per request still going, fed back at the next position.
        active = [i for i in todo if batch.caps[i] > 1 and lengths[i] + 1 < self.max_context]
        step = 1
        while active:
            if stop is not None:
                active = [i for i in stop(active, confs, clock.spent_s())
                          if drafted[i] < batch.caps[i]]
            if not active:
                break
            clock.start()
            positions = lengths[active] - 1 + step
            hidden = self._forward(last[self._to_device(np.asarray(active, dtype=np.int64))],
                                   positions, np.ones(len(active), dtype=np.int64),
                                   positions + 1, batch.rows[active], block_table)
            keep(active, *self._sample(hidden, sampling, active, columns))
            clock.stop(len(active), len(active), first=False)
            step += 1
            active = [i for i in active if drafted[i] < batch.caps[i]
                      and lengths[i] + step < self.max_context]
        self._collect(sampled, result, with_confidences=stop is None,
                      sampling_rows=None if sampling is None else sampling.sampled)
        result.passes = clock.passes()
        return result

    @staticmethod
    def _collect(sampled: list[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor | None]],
                 result: DraftResult, with_confidences: bool,
                 sampling_rows: np.ndarray | None) -> None:
        """Every forward's tokens (and confidences) to the host in one copy, in order; the q
        rows of the requests that sample stay on the device, one [len, vocab] tensor each."""
        if not sampled:
            return
        values = torch.cat([torch.stack((t.double(), c.double())) for _, t, c, _ in sampled],
                           dim=1).tolist()  # token ids are exact in float64
        k = 0
        rows: dict[int, list[torch.Tensor]] = {}
        for reqs, _, _, probs in sampled:
            for local, i in enumerate(reqs):
                result.tokens[i].append(int(values[0][k]))
                if with_confidences:
                    result.confidences[i].append(values[1][k])
                if sampling_rows is not None and sampling_rows[i]:
                    assert probs is not None
                    rows.setdefault(i, []).append(probs[local])
                k += 1
        if sampling_rows is not None:
            result.probs = [torch.stack(rows[i]) if i in rows else None
                            for i in range(len(result.tokens))]

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array on the drafter's device without a host sync: a pinned staging copy and a
        non-blocking transfer (a pageable one would wait for the device)."""
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _forward(self, ids: np.ndarray | torch.Tensor, positions: np.ndarray,
                 query_lens: np.ndarray, seq_lens: np.ndarray, rows: np.ndarray,
                 block_table: torch.Tensor) -> torch.Tensor:
        """One forward of the drafter: ``ids`` (host, or already on the device) at
        ``positions``, requests laid out by ``query_lens``, attending to ``seq_lens`` positions
        each through ``block_table[rows]``; the KV of every input position is written. Returns
        [num_tokens, hidden] states."""
        num_tokens = len(positions)
        bs = self.block_size
        query_start = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start[1:])
        seq_lens32 = seq_lens.astype(np.int32)
        table = block_table[self._to_device(np.asarray(rows, dtype=np.int64))]
        pos = self._to_device(positions.astype(np.int64))
        req_of_token = self._to_device(np.repeat(np.arange(len(query_lens)), query_lens))
        slot_mapping = table[req_of_token, pos // bs].to(torch.int64) * bs + pos % bs
        metadata = CommonAttentionMetadata(
            query_start_loc=self._to_device(query_start),
            query_start_loc_cpu=torch.from_numpy(query_start),
            seq_lens=self._to_device(seq_lens32),
            seq_lens_cpu_upper_bound=torch.from_numpy(seq_lens32),
            num_reqs=len(query_lens),
            num_actual_tokens=num_tokens,
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            block_table_tensor=table,
            slot_mapping=slot_mapping,
            causal=True,
        )
        _, per_layer = self.build_per_group_and_layer_attn_metadata(metadata)
        input_ids = (ids.to(torch.int32) if isinstance(ids, torch.Tensor)
                     else self._to_device(ids.astype(np.int32)))
        with set_forward_context(per_layer, self.vllm_config, num_tokens=num_tokens,
                                 slot_mapping={name: slot_mapping
                                               for name in self._draft_attn_layer_names}):
            return self.model(input_ids=input_ids, positions=pos)

    def _context_columns(self, batch: DraftRows, todo: list[int]) -> _ContextColumns | None:
        """The ids beyond the vocabulary limit that the texts of requests ``todo`` hold (each
        request's are read once per token: kept per request), as extra output rows for this
        draft: a request then drafts the rare ids of its own text too (a name, a word of its
        prompt's language), for a few rows more than the limit. None when there are none."""
        low, high = self.vocab_limit, self.context_vocab_limit
        if high <= low:
            return None
        found = []
        for i in todo:
            req_id, text = batch.req_ids[i], batch.contexts[i]
            read, ids = self._context_ids.get(req_id, (0, _NO_IDS))
            if len(text) < read:  # not the text read before (cannot happen: texts only grow)
                read, ids = 0, _NO_IDS
            if len(text) > read:
                new = text[read:]
                new = new[(new >= low) & (new < high)]
                if len(new):
                    ids = np.union1d(ids, new)
                self._context_ids[req_id] = (len(text), ids)
            found.append(ids)
        extra = np.unique(np.concatenate(found)) if found else _NO_IDS
        if not len(extra):
            return None
        count = len(extra)
        padded = np.full(-(-count // _COLUMN_QUANTUM) * _COLUMN_QUANTUM, extra[-1], np.int64)
        padded[:count] = extra
        ids = self._to_device(padded)
        weight = self._head_weight()
        return _ContextColumns(ids, None if weight is None else weight[ids], count,
                               int(extra[-1]) + 1)

    def _head_weight(self) -> torch.Tensor | None:
        """The output layer's weight when the logits are a plain matrix product with it (no
        soft cap, scale or bias) and it is whole (not split over tensor-parallel ranks: a rank
        holds only its share of the rows, and `compute_logits` gathers them): then only the
        rows drafted need computing."""
        head = getattr(self.model, "lm_head", None)
        processor = getattr(self.model, "logits_processor", None)
        weight = getattr(head, "weight", None)
        if (weight is None or processor is None
                or getattr(processor, "soft_cap", None) is not None
                or getattr(processor, "scale", 1.0) != 1.0
                or getattr(head, "bias", None) is not None
                or getattr(head, "tp_size", 1) != 1):
            return None
        return weight

    def _logits(self, hidden: torch.Tensor, columns: _ContextColumns | None = None
                ) -> torch.Tensor:
        """[n, vocab_limit (+ extra)] logits over the ids this drafter may draft: below the
        target's vocabulary size (a drafter whose embedding is padded further must not draft ids
        the target has no row for) and below ``draft_vocab_size``, then the ``columns`` of the
        requests' own texts beyond it. Where the limit cuts the output layer short and the
        model's logits are a plain matrix product, only those rows are computed."""
        limit = self.vocab_limit
        weight = self._head_weight()
        if weight is None or limit >= weight.shape[0]:
            logits = self.model.compute_logits(hidden)
            head = logits[:, :limit] if logits.shape[-1] > limit else logits
            extra = None if columns is None else logits[:, columns.ids]
        else:
            head = torch.nn.functional.linear(hidden, weight[:limit])
            extra = (None if columns is None
                     else torch.nn.functional.linear(hidden, columns.weight))
        if extra is None:
            return head
        return torch.cat((head, columns.mask_padding(extra)), dim=1)

    def _sample(self, hidden: torch.Tensor, sampling: RowSampling | None = None,
                reqs: list[int] | None = None, columns: _ContextColumns | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Draft tokens [n] and the drafter's probability of each [n], on the device: greedy, or
        sampled at the settings of requests ``reqs`` of ``sampling`` (then also q [n, ids], in
        token ids: its columns beyond the limit moved to the ids they stand for)."""
        logits = self._logits(hidden, columns).float()
        if sampling is not None and reqs is not None:
            rows = sampling.take(reqs)
            if rows.sampled.any():
                tokens, conf, probs = sample_draft_rows(logits, rows)
                if columns is None:
                    return tokens, conf, probs
                return (columns.token_ids(tokens, self.vocab_limit), conf,
                        columns.probs_by_id(probs, self.vocab_limit))
        conf, token = torch.softmax(logits, dim=-1).max(dim=-1)
        if columns is not None:
            token = columns.token_ids(token, self.vocab_limit)
        return token, conf, None

    # -- warm-up (called once the KV cache exists) ---------------------------------------------
    @torch.inference_mode()
    def warm_up(self, max_lookahead: int) -> list[PassTiming]:
        """Run the forwards drafting will run, each shape twice, and return every call's timing
        (as drafting times them: `_PassClock`): the first call at a shape builds its kernels
        (oneDNN primitives on CPU, compilation on GPU) and says nothing of its cost; the second
        is the controller's first measurement. Shapes: one request catching up 1 to
        ``max_lookahead + 2`` tokens (the first forward after a step it drafted in) and 16 to 512
        (after a pause, a prompt); 2 to 8 requests extended by one token each. The KV writes go
        to block 0, vLLM's null block, which no request owns. Best effort: a failure ends the
        warm-up with a log line."""
        clock = _PassClock(self.device)
        bs = self.block_size
        table = torch.zeros((8, 512 // bs + 2), dtype=torch.int32, device=self.device)
        # Largest first: under torch.compile the first call traces the graph, and a trace of
        # one token specializes it to one token (vLLM's own warm-up traces at its largest size);
        # no forward larger than drafting runs (its token budget).
        big = [c for c in (512, 256, 128, 64, 32, 16) if c <= self.max_num_tokens]
        shapes = ([(1, c) for c in big] + [(m, 1) for m in range(8, 1, -1)]
                  + [(1, c) for c in range(max_lookahead + 2, 0, -1)])
        try:
            for num_reqs, each in shapes:
                for _ in range(2):
                    clock.start()
                    ids = np.zeros(num_reqs * each, dtype=np.int64)
                    positions = np.tile(np.arange(each), num_reqs) + (0 if num_reqs == 1 else 8)
                    query_lens = np.full(num_reqs, each, dtype=np.int64)
                    seq_lens = query_lens + (0 if num_reqs == 1 else 8)
                    hidden = self._forward(ids, positions, query_lens, seq_lens,
                                           np.arange(num_reqs), table)
                    ends = np.cumsum(query_lens) - 1
                    self._sample(hidden[self._to_device(ends)])
                    clock.stop(num_reqs * each, num_reqs, first=num_reqs == 1)
        except Exception as exc:  # noqa: BLE001 - an optimisation must never stop the engine
            logger.warning("Smurfs in-worker drafter %s: warm-up stopped after %d forwards: %s",
                           self.name, len(clock.passes()), exc)
        return clock.passes()


class FatalDrafterError(RuntimeError):
    """A drafter's error that the engine cannot survive (see `is_fatal_device_error`)."""


#: The CUDA (and HIP) errors that are sticky: once raised, every later kernel of the process
#: fails too (cudaErrorAssert, IllegalAddress, LaunchFailure, IllegalInstruction,
#: MisalignedAddress, InvalidPc, HardwareStackError, ECCUncorrectable, LaunchTimeout,
#: InvalidAddressSpace), as cudaGetErrorString words them.
_STICKY_DEVICE_ERRORS = (
    "device-side assert triggered",
    "an illegal memory access was encountered",
    "unspecified launch failure",
    "an illegal instruction was encountered",
    "misaligned address",
    "invalid program counter",
    "hardware stack error",
    "uncorrectable ecc error encountered",
    "the launch timed out and was terminated",
    "operation not supported on global/shared address space",
)


def is_fatal_device_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a device error the process cannot go on after (torch raises CUDA
    errors as RuntimeError, or its subclass AcceleratorError)."""
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(phrase in text for phrase in _STICKY_DEVICE_ERRORS)


class _PassClock:
    """The seconds of each forward of one draft, without a host sync per forward: host time on
    CPU (each forward is done when it returns); on a CUDA device, device events, read once the
    drafts are on the host (the stream has then run them all)."""

    def __init__(self, device: torch.device) -> None:
        self._events = device.type == "cuda"
        self._open: Any = None
        self._passes: list[tuple[int, int, bool, Any, Any]] = []

    def _now(self) -> Any:
        if not self._events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._open = self._now()

    def stop(self, num_tokens: int, num_reqs: int, first: bool) -> None:
        self._passes.append((num_tokens, num_reqs, first, self._open, self._now()))

    def _seconds(self, begin: Any, end: Any) -> float:
        if not self._events:
            return end - begin
        end.synchronize()  # already done when called after a copy to the host
        return begin.elapsed_time(end) / 1000.0

    def spent_s(self) -> float:
        """Seconds of the forwards so far (for a stop rule, after it read the confidences)."""
        return sum(self._seconds(b, e) for *_, b, e in self._passes)

    def passes(self) -> list[PassTiming]:
        return [PassTiming(t, r, self._seconds(b, e), first) for t, r, first, b, e
                in self._passes]


def _pack(todo: list[int], starts: dict[int, int], lengths: np.ndarray,
          budget: int) -> list[list[tuple[int, int, int]]]:
    """Split the catch-up segments ``[starts[i], lengths[i])`` into forwards of at most
    ``budget`` tokens (a long segment spans several, in order), keeping requests whole where
    they fit."""
    chunks: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    room = budget
    for i in todo:
        s, e = starts[i], int(lengths[i])
        while s < e:
            if room == 0:
                chunks.append(current)
                current, room = [], budget
            take = min(room, e - s)
            current.append((i, s, s + take))
            s += take
            room -= take
    if current:
        chunks.append(current)
    return chunks
