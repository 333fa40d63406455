"""Reconstruction of a recorded trace for the simulator: per request, at every output position,
how many tokens a model draft starting there gets accepted, and what the model-free voters have
ready there and how much of it is accepted.

With greedy decoding the text, hence each drafter's agreement with the target at every position,
does not depend on the policy. A draft of ``t`` tokens at position ``p`` that matched ``m`` of the
target's tokens says the drafter agrees at ``p .. p+m-1`` and, when the target's tokens reach
past ``p+m`` (``m`` below the tokens the step produced), disagrees at ``p+m``. Unknown positions
take the nearest known agreement (ties: the later one); the accepted run of a draft starting at
``x`` is then the run of agreements from ``x``. The model-free chain's length at a position is
known where a step was recorded there (0 where the request had no chain), and imputed likewise.

Record traces with a fixed lookahead (``lookahead.policy: fixed``: the model drafters draft in
every step, every position is observed); an adaptive run's trace leaves the positions where the
models sat out to imputation.

Pure module (stdlib + numpy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_smurfs.trace.format import TraceRequest, TraceStep

__all__ = ["ReplayRequest", "acc_from_agreement", "reconstruct"]


def acc_from_agreement(agree: np.ndarray) -> np.ndarray:
    """``acc[x]``: length of the run of 1s in ``agree`` starting at ``x`` (0/1 array)."""
    agree = np.asarray(agree).astype(bool)
    acc = np.zeros(len(agree), dtype=np.int64)
    run = 0
    for x in range(len(agree) - 1, -1, -1):
        run = run + 1 if agree[x] else 0
        acc[x] = run
    return acc


@dataclass(frozen=True)
class ReplayRequest:
    """A request to replay: its prompt, its output length, and per output position the model
    drafts' accepted run and the model-free voters' chain (length, accepted run)."""

    req_id: str
    prompt: int  # context length at its first step
    acc: np.ndarray  # acc[x]: tokens a model draft starting at output position x gets accepted
    free_len: np.ndarray  # free_len[x]: tokens of the model-free chain at x (0: none)
    free_acc: np.ndarray  # free_acc[x]: of those, accepted (a run, like acc)
    conflicts: int = 0  # positions observed both agreeing and disagreeing (a non-greedy trace)

    @property
    def length(self) -> int:
        return len(self.acc)

    @classmethod
    def synthetic(cls, req_id: str, agree: Sequence[int], free_len: Sequence[int] | None = None,
                  free_agree: Sequence[int] | None = None, prompt: int = 64) -> ReplayRequest:
        """From fully known agreements (a synthetic ground truth); no model-free chain unless
        given."""
        n = len(agree)
        return cls(req_id, prompt, acc_from_agreement(np.asarray(agree)),
                   np.asarray(free_len if free_len is not None else [0] * n, dtype=np.int64),
                   acc_from_agreement(np.asarray(free_agree if free_agree is not None
                                                 else [0] * n)))


def _impute(values: np.ndarray, default: int = 0) -> np.ndarray:
    """Unknown entries (< 0) take the nearest known value (ties: the later one)."""
    known = np.flatnonzero(values >= 0)
    if len(known) == 0:
        return np.full(len(values), default, dtype=values.dtype)
    out = values.copy()
    unknown = np.flatnonzero(values < 0)
    if len(unknown):
        right = np.searchsorted(known, unknown)
        after = known[np.minimum(right, len(known) - 1)]
        before = known[np.maximum(right - 1, 0)]
        d_after = np.where(right < len(known), after - unknown, np.iinfo(np.int64).max)
        d_before = np.where(right > 0, unknown - before, np.iinfo(np.int64).max)
        out[unknown] = values[np.where(d_after <= d_before, after, before)]
    return out


def _mark(agree: np.ndarray, x: int, tokens: int, matched: int, produced: int) -> int:
    """Marks of one draft at ``x``; returns the conflicts with earlier marks."""
    conflicts = 0
    marks = [(x + j, 1) for j in range(min(matched, tokens))]
    if matched < min(tokens, produced):
        marks.append((x + matched, 0))
    for pos, v in marks:
        if pos >= len(agree):
            continue
        if agree[pos] < 0:
            agree[pos] = v
        elif agree[pos] != v:
            conflicts += 1  # keep the first observation
    return conflicts


def reconstruct(trace: Sequence[TraceStep]) -> list[ReplayRequest]:
    """Per request (in order of first appearance), see the module docstring. A step's model
    draft is the best of the in-worker drafters' own drafts recorded for it, or the verified
    chain where model drafts were in its vote and none was recorded (streaming drafters)."""
    per_req: dict[str, list[TraceRequest]] = {}
    for step in trace:
        for r in step.requests:
            per_req.setdefault(r.req_id, []).append(r)
    out = []
    for req_id, obs in per_req.items():
        base = min(r.position for r in obs)
        length = max(r.position - base + r.accepted + 1 for r in obs)
        agree = np.full(length, -1, dtype=np.int64)
        free_agree = np.full(length, -1, dtype=np.int64)
        free_len = np.full(length, -1, dtype=np.int64)
        conflicts = 0
        for r in obs:
            x = r.position - base
            produced = r.accepted + 1
            drafts = [d for d in r.drafts if d is not None]
            if drafts:
                tokens, matched = max(drafts, key=lambda d: (d[1], d[0]))
                conflicts += _mark(agree, x, tokens, matched, produced)
            elif r.models and r.k:
                conflicts += _mark(agree, x, r.k, r.accepted, produced)
            if r.free is not None:
                free_len[x] = max(free_len[x], r.free[0])
                conflicts += _mark(free_agree, x, r.free[0], r.free[1], produced)
            elif free_len[x] < 0:
                free_len[x] = 0
        out.append(ReplayRequest(req_id, base, acc_from_agreement(_impute(agree)),
                                 _impute(free_len), acc_from_agreement(_impute(free_agree)),
                                 conflicts))
    return out
