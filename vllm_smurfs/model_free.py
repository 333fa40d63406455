"""Model-free voters: n-gram prompt lookup over the request's own context.

A model-free voter drafts by copying: if the last few tokens already occurred earlier in the
prompt or output, it proposes the tokens that followed that occurrence. It costs no model call,
and on repetitive text (code edits, summaries quoting the input) it is often the best drafter.

vLLM ships an n-gram proposer, but it imports numba, and on these machines importing/JIT-ing
numba raises torch's intra-op thread count mid-run. This implementation uses numpy only.

Pure module (numpy + stdlib, no vllm/torch).
"""

from __future__ import annotations

import numpy as np

__all__ = ["NgramVoter", "ngram_lookup"]


def _validate_n(min_n: int, max_n: int) -> None:
    # Named after vLLM's speculative_config fields so the error points at the user's setting.
    if min_n < 1:
        raise ValueError(f"prompt_lookup_min must be >= 1, got {min_n}")
    if min_n > max_n:
        raise ValueError(f"prompt_lookup_min ({min_n}) must be <= prompt_lookup_max ({max_n})")


def ngram_lookup(context: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the context's suffix.

    For ``n`` from ``max_n`` down to ``min_n``: look for earlier occurrences of the last ``n``
    tokens that are followed by at least one token (so the suffix itself never matches, but
    overlapping occurrences do); take the most recent one and return up to ``k`` tokens after it.
    The longest ``n`` with a match wins. Returns ``[]`` when nothing matches, ``k <= 0``, or the
    context has fewer than ``min_n + 1`` tokens.

    Raises:
        ValueError: on bad ``min_n``/``max_n`` or a context that is not 1-D integers.
    """
    _validate_n(min_n, max_n)
    ctx = np.asarray(context)
    if ctx.ndim != 1:
        raise ValueError(f"context must be 1-D, got shape {ctx.shape}")
    length = ctx.shape[0]
    if k <= 0 or length < min_n + 1:
        return []
    if ctx.dtype.kind not in "iu":
        raise ValueError(f"context must hold integer token ids, got dtype {ctx.dtype}")

    # Candidates are identified by the index `e` of their last token, e in [0, length - 2] so a
    # token follows. Instead of comparing every window for every n (O(len * max_n^2)), grow the
    # match backwards one token at a time and only keep candidates still matching: after step j
    # `ends` holds the ends of the occurrences of the last j + 1 tokens. Most positions drop out
    # at the first comparison, so this is ~one vectorised pass over the context.
    ends = np.flatnonzero(ctx[:-1] == ctx[-1])
    best_n = 0
    best_end = -1
    for j in range(max_n):
        if j > 0:
            ends = ends[ends >= j]  # the occurrence must start inside the context
            ends = ends[ctx[ends - j] == ctx[length - 1 - j]]
        if ends.size == 0:
            break
        # `ends` is ascending, so the last one is the most recent occurrence of this length.
        best_n = j + 1
        best_end = int(ends[-1])
    if best_n < min_n:
        return []
    start = best_end + 1
    return [int(t) for t in ctx[start : start + k]]


class NgramVoter:
    """A drafter that proposes by n-gram prompt lookup (see :func:`ngram_lookup`)."""

    # One n-gram voter per drafter set is the expected configuration, so a fixed name suffices
    # for logs and metrics.
    name: str = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        """Raises ValueError (naming prompt_lookup_min/max) if ``min_n < 1`` or ``min_n > max_n``.

        Defaults (2, 4): a single-token match is weak evidence (common tokens recur everywhere),
        so at least two tokens must agree; a longer match is preferred when there is one, and 4
        is long enough to pin down a repeated span while keeping the backward match loop short.
        """
        _validate_n(min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, context: np.ndarray, k: int) -> list[int]:
        """Up to ``k`` draft tokens continuing ``context`` (may be empty)."""
        return ngram_lookup(context, self.min_n, self.max_n, k)

    def __repr__(self) -> str:
        return f"NgramVoter(min_n={self.min_n}, max_n={self.max_n})"
