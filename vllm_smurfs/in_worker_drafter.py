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

Lossless by construction: drafts are only proposals, which the target's rejection sampler
verifies; a drafter's KV cache is its own (the target's is never written here).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm.config import SpeculativeConfig, VllmConfig
from vllm.forward_context import set_forward_context
from vllm.model_executor.model_loader import get_model
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.draft_model import DraftModelProposer

from vllm_smurfs.config import ModelDrafterConfig
from vllm_smurfs.drafter_client import DrafterHealth

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


@dataclass
class DraftResult:
    tokens: list[list[int]]  # [n][<= cap] draft tokens per request
    confidences: list[list[float]]  # [n][same] the drafter's probability of each token
    passes: list[PassTiming] = field(default_factory=list)


#: stop(active, confidences, drafted_s) -> the requests (indices into DraftRows) that get one more
#: draft token; called after every forward with the requests still below their cap, every
#: request's confidences so far, and the seconds the forwards took so far.
StopRule = Callable[[list[int], list[list[float]], float], list[int]]


def _speculative_config(spec: ModelDrafterConfig, vllm_config: VllmConfig,
                        num_speculative_tokens: int) -> SpeculativeConfig:
    """vLLM's own ``draft_model`` configuration for this drafter (validates the model)."""
    target_parallel = vllm_config.parallel_config
    config = SpeculativeConfig(
        method="draft_model",
        model=spec.model,
        num_speculative_tokens=num_speculative_tokens,
        draft_tensor_parallel_size=target_parallel.tensor_parallel_size,
        max_model_len=spec.max_model_len,
        target_model_config=vllm_config.model_config,
        target_parallel_config=target_parallel,
    )
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
        # Fault injection for the fault tests (as for process drafters, see drafter_server):
        # SMURFS_DRAFTER_FAULT=NAME=raise_after:N makes drafter NAME fail its N+1-th step.
        # SMURFS_DRAFTER_FAULT=NAME=stall_first:SECONDS makes drafter NAME's first forward after
        # start-up take SECONDS longer (a first call that built kernels: a poisoned cost curve).
        target, _, fault = os.environ.get("SMURFS_DRAFTER_FAULT", "").partition("=")
        kind, _, count = fault.partition(":")
        mine = target == self.name
        self._fail_after = int(count) if mine and kind == "raise_after" else -1
        self._stall_s = float(count) if mine and kind == "stall_first" else 0.0

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
                     caps: list[int], runner: Any, stop: StopRule | None) -> DraftResult:
        """`draft` through the runner's block table; an error costs speculation only: it is
        logged, the drafter left out for the rest of the run, and no draft returned."""
        empty = DraftResult([[] for _ in req_ids], [[] for _ in req_ids])
        if not self.health.alive:
            return empty
        try:
            if self._fail_after == self.health.steps_answered:
                raise RuntimeError("injected fault (SMURFS_DRAFTER_FAULT)")
            table = runner.input_batch.block_table[self.kv_cache_gid].get_device_tensor(
                runner.input_batch.num_reqs)
            result = self.draft(DraftRows(req_ids, rows, contexts, caps), table, stop)
        except Exception as exc:  # noqa: BLE001 - a drafter's failure must not fail the step
            self.fail(f"{type(exc).__name__}: {exc}")
            logger.exception("Smurfs in-worker drafter %s failed", self.name)
            return empty
        self.health.steps_answered += 1
        self.health.busy_s += sum(p.seconds for p in result.passes)
        return result

    def fail(self, reason: str) -> None:
        if self.health.alive:
            logger.error("Smurfs drafter %s is left out for the rest of the run: %s", self.name,
                         reason)
        self.health.alive = False
        self.health.last_error = reason
        self._synced.clear()

    @torch.inference_mode()
    def draft(self, batch: DraftRows, block_table: torch.Tensor, stop: StopRule | None = None,
              max_tokens_per_forward: int | None = None) -> DraftResult:
        """Draft for every request of ``batch``: up to ``caps[i]`` greedy tokens each.

        ``block_table``: [num_rows, max_blocks] the block table of this drafter's KV cache group
        (the target's); row ``rows[i]`` addresses request i. ``stop`` decides after each forward
        which requests go on (default: all, to their cap).
        """
        n = len(batch.req_ids)
        tokens: list[list[int]] = [[] for _ in range(n)]
        confs: list[list[float]] = [[] for _ in range(n)]
        result = DraftResult(tokens, confs)
        todo = [i for i in range(n) if batch.caps[i] > 0]
        if not todo:
            return result
        lengths = np.array([len(batch.contexts[i]) for i in range(n)], dtype=np.int64)
        budget = max_tokens_per_forward or self.max_num_tokens
        # First forward(s): from each request's synced position to the end of its text.
        starts = {i: min(self._synced.get(batch.req_ids[i], 0), int(lengths[i]) - 1)
                  for i in todo}
        for chunk in _pack(todo, starts, lengths, budget):
            t0 = time.perf_counter()
            if self._stall_s:
                time.sleep(self._stall_s)  # injected (SMURFS_DRAFTER_FAULT)
                self._stall_s = 0.0
            rows_in = [i for i, _, _ in chunk]
            ids = np.concatenate([batch.contexts[i][s:e] for i, s, e in chunk])
            positions = np.concatenate([np.arange(s, e) for i, s, e in chunk])
            query_lens = np.array([e - s for _, s, e in chunk], dtype=np.int64)
            seq_lens = np.array([e for _, _, e in chunk], dtype=np.int64)
            last = [i for i, _, e in chunk if e == lengths[i]]  # segments that end the text
            hidden = self._forward(ids, positions, query_lens, seq_lens,
                                   batch.rows[rows_in], block_table)
            if last:
                ends = np.cumsum(query_lens) - 1
                pick = [int(ends[k]) for k, (i, _, e) in enumerate(chunk) if e == lengths[i]]
                new, conf = self._sample(hidden[pick])
                for i, t, c in zip(last, new, conf):
                    tokens[i].append(t)
                    confs[i].append(c)
            for i, _, e in chunk:
                self._synced[batch.req_ids[i]] = e
            result.passes.append(PassTiming(len(ids), len(chunk), time.perf_counter() - t0,
                                            first=True))
        # Further forwards: one token per request still going, fed back at the next position.
        active = [i for i in todo if batch.caps[i] > 1 and lengths[i] + 1 < self.max_context]
        step = 1
        while active:
            if stop is not None:
                spent = sum(p.seconds for p in result.passes)
                active = [i for i in stop(active, confs, spent)
                          if len(tokens[i]) < batch.caps[i]]
            if not active:
                break
            t0 = time.perf_counter()
            ids = np.array([tokens[i][-1] for i in active], dtype=np.int64)
            positions = lengths[active] - 1 + step
            hidden = self._forward(ids, positions, np.ones(len(active), dtype=np.int64),
                                   positions + 1, batch.rows[active], block_table)
            new, conf = self._sample(hidden)
            for i, t, c in zip(active, new, conf):
                tokens[i].append(t)
                confs[i].append(c)
            result.passes.append(PassTiming(len(active), len(active),
                                            time.perf_counter() - t0, first=False))
            step += 1
            active = [i for i in active if len(tokens[i]) < batch.caps[i]
                      and lengths[i] + step < self.max_context]
        return result

    def _forward(self, ids: np.ndarray, positions: np.ndarray, query_lens: np.ndarray,
                 seq_lens: np.ndarray, rows: np.ndarray, block_table: torch.Tensor
                 ) -> torch.Tensor:
        """One forward of the drafter: ``ids`` at ``positions``, requests laid out by
        ``query_lens``, attending to ``seq_lens`` positions each through ``block_table[rows]``;
        the KV of every input position is written. Returns [num_tokens, hidden] states."""
        device = self.device
        num_tokens = len(ids)
        bs = self.block_size
        table = block_table[torch.from_numpy(np.asarray(rows, dtype=np.int64))]
        req_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
        table_np = table.cpu().numpy() if table.device.type != "cpu" else table.numpy()
        slots = (table_np[req_of_token, positions // bs].astype(np.int64) * bs
                 + positions % bs)
        query_start = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start[1:])
        qsl_cpu = torch.from_numpy(query_start)
        seq_cpu = torch.from_numpy(seq_lens.astype(np.int32))
        slot_mapping = torch.from_numpy(slots).to(device)
        metadata = CommonAttentionMetadata(
            query_start_loc=qsl_cpu.to(device),
            query_start_loc_cpu=qsl_cpu,
            seq_lens=seq_cpu.to(device),
            seq_lens_cpu_upper_bound=seq_cpu,
            num_reqs=len(query_lens),
            num_actual_tokens=num_tokens,
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            block_table_tensor=table.to(device),
            slot_mapping=slot_mapping,
            causal=True,
        )
        _, per_layer = self.build_per_group_and_layer_attn_metadata(metadata)
        input_ids = torch.from_numpy(ids.astype(np.int32)).to(device)
        pos = torch.from_numpy(positions.astype(np.int64)).to(device)
        with set_forward_context(per_layer, self.vllm_config, num_tokens=num_tokens,
                                 slot_mapping={name: slot_mapping
                                               for name in self._draft_attn_layer_names}):
            return self.model(input_ids=input_ids, positions=pos)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, vocab] logits; with ``draft_vocab_size``, of the first tokens only (the output
        layer's first rows: a plain matrix product, when the model's logits are one)."""
        limit = self.spec.draft_vocab_size
        head = getattr(self.model, "lm_head", None)
        processor = getattr(self.model, "logits_processor", None)
        weight = getattr(head, "weight", None)
        if (limit is None or weight is None or processor is None
                or getattr(processor, "soft_cap", None) is not None
                or getattr(processor, "scale", 1.0) != 1.0
                or getattr(head, "bias", None) is not None or limit >= weight.shape[0]):
            return self.model.compute_logits(hidden)
        return torch.nn.functional.linear(hidden, weight[:limit])

    def _sample(self, hidden: torch.Tensor) -> tuple[list[int], list[float]]:
        """Greedy tokens and the drafter's probability of each."""
        logits = self._logits(hidden).float()
        probs = torch.softmax(logits, dim=-1)
        conf, token = probs.max(dim=-1)
        return token.tolist(), conf.tolist()

    # -- warm-up (called once the KV cache exists) ---------------------------------------------
    @torch.inference_mode()
    def warm_up(self, max_lookahead: int) -> list[tuple[int, float]]:
        """Run the forwards drafting will run, each shape twice, and return every call's
        ``(tokens, seconds)``: the first call at a shape builds its kernels (oneDNN primitives on
        CPU, compilation on GPU) and says nothing of its cost; the second is the controller's
        first measurement. Shapes: one request catching up 1 to ``max_lookahead + 2`` tokens
        (the first forward after a step it drafted in) and 16 to 512 (after a pause, a prompt);
        2 to 8 requests extended by one token each. The KV writes go to block 0, vLLM's null block,
        which no request owns. Best effort: a failure ends the warm-up with a log line."""
        calls: list[tuple[int, float]] = []
        bs = self.block_size
        table = torch.zeros((8, 512 // bs + 2), dtype=torch.int32, device=self.device)
        shapes = ([(1, c) for c in range(1, max_lookahead + 3)]
                  + [(1, c) for c in (16, 32, 64, 128, 256, 512)] + [(m, 1) for m in range(2, 9)])
        try:
            for num_reqs, each in shapes:
                for _ in range(2):
                    t0 = time.perf_counter()
                    ids = np.zeros(num_reqs * each, dtype=np.int64)
                    positions = np.tile(np.arange(each), num_reqs) + (0 if num_reqs == 1 else 8)
                    query_lens = np.full(num_reqs, each, dtype=np.int64)
                    seq_lens = query_lens + (0 if num_reqs == 1 else 8)
                    hidden = self._forward(ids, positions, query_lens, seq_lens,
                                           np.arange(num_reqs), table)
                    ends = np.cumsum(query_lens) - 1
                    self._sample(hidden[torch.from_numpy(ends)])
                    calls.append((num_reqs * each, time.perf_counter() - t0))
        except Exception as exc:  # noqa: BLE001 - an optimisation must never stop the engine
            logger.warning("Smurfs in-worker drafter %s: warm-up stopped after %d forwards: %s",
                           self.name, len(calls), exc)
        return calls


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
