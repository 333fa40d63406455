"""Reconstruction of a recorded trace for the simulator: per request, how many tokens a draft
starting at each output position gets accepted (see `trace_sim`'s docstring for the method).

Pure module (stdlib + numpy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_smurfs.trace import TraceRequest, TraceStep

__all__ = ["ReplayRequest", "acc_from_agreement", "reconstruct"]


# -------------------------------------------------------------------------------- reconstruction


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
    """A request to replay: its output length and per-position accepted run."""

    req_id: str
    acc: np.ndarray  # acc[x]: tokens a draft starting at output position x gets accepted
    agree: np.ndarray | None = None  # 1 / 0 / -1 (unknown) before imputation, when reconstructed
    conflicts: int = 0  # positions observed both agreeing and disagreeing (non-greedy trace)
    # The model-free voters at output position x (None: unknown, they never draft): the tokens
    # they have ready, and how many of them the target accepts (from steps without model
    # drafting: `TraceStep.drafting` False).
    free_len: np.ndarray | None = None
    free_acc: np.ndarray | None = None

    @property
    def length(self) -> int:
        return len(self.acc)

    @classmethod
    def from_agreement(cls, req_id: str, agree: Sequence[int]) -> ReplayRequest:
        """From a fully known agreement string (synthetic ground truth)."""
        arr = np.asarray(agree, dtype=np.int8)
        return cls(req_id, acc_from_agreement(arr), arr)


def _impute(agree: np.ndarray) -> np.ndarray:
    known = np.flatnonzero(agree >= 0)
    if len(known) == 0:
        # Nothing was ever drafted: assume every draft is rejected (speculation cannot help).
        return np.zeros(len(agree), dtype=np.int8)
    out = agree.copy()
    unknown = np.flatnonzero(agree < 0)
    if len(unknown):
        right = np.searchsorted(known, unknown)  # first known index > each unknown
        after = known[np.minimum(right, len(known) - 1)]
        before = known[np.maximum(right - 1, 0)]
        d_after = np.where(right < len(known), after - unknown, np.iinfo(np.int64).max)
        d_before = np.where(right > 0, unknown - before, np.iinfo(np.int64).max)
        pick = np.where(d_after <= d_before, after, before)
        out[unknown] = agree[pick]
    return out


def reconstruct(trace: Sequence[TraceStep]) -> list[ReplayRequest]:
    """Per request (in order of first appearance) the agreement and accepted runs, see module doc.

    Positions are relative to the request's first recorded step; its length is the furthest
    position the trace shows it producing (``position + accepted + 1`` of its steps). Steps
    recorded without model drafting (``drafting`` False) are the model-free voters' drafts: they
    give the request's ``free_acc`` the same way, and ``free_len`` (the draft lengths seen,
    imputed like the agreement), instead of the model drafters' agreement.
    """
    per_req: dict[str, list[tuple[TraceRequest, bool]]] = {}
    for s in trace:
        for r in s.requests:
            per_req.setdefault(r.req_id, []).append((r, s.drafting is False))
    out = []
    for req_id, obs in per_req.items():
        base = min(r.position for r, _ in obs)
        length = max(r.position - base + r.accepted + 1 for r, _ in obs)
        agree, conflicts = _agreement([r for r, free in obs if not free], base, length)
        free = [r for r, free in obs if free]
        free_len = free_acc = None
        if free:
            free_agree, more = _agreement(free, base, length)
            conflicts += more
            free_acc = acc_from_agreement(_impute(free_agree))
            lens = np.full(length, -1, dtype=np.int16)
            for r in free:
                lens[r.position - base] = max(lens[r.position - base], r.k)
            free_len = _impute(lens)
        out.append(ReplayRequest(req_id, acc_from_agreement(_impute(agree)), agree, conflicts,
                                 free_len, free_acc))
    return out


def _agreement(obs: Sequence[TraceRequest], base: int, length: int) -> tuple[np.ndarray, int]:
    """1 / 0 / -1 (unknown) per position from the observed drafts, and the conflicts."""
    agree = np.full(length, -1, dtype=np.int8)
    conflicts = 0
    for r in obs:
        p = r.position - base
        marks = [(p + j, 1) for j in range(r.accepted)]
        if r.accepted < r.k:
            marks.append((p + r.accepted, 0))
        for x, v in marks:
            if agree[x] < 0:
                agree[x] = v
            elif agree[x] != v:
                conflicts += 1  # keep the first observation
    return agree, conflicts
