"""Model-free voters: n-gram prompt lookup, and suffix decoding over all requests' outputs.

A model-free voter drafts by copying: if the last few tokens already occurred earlier, it
proposes the tokens that followed that occurrence. It costs no model call, and on repetitive text
(code edits, summaries quoting the input, agents re-sending what they said) it is often the best
drafter.

- `NgramVoter` looks in the request's own text only. vLLM ships an n-gram proposer, but it
  imports numba, and on these machines importing/JIT-ing numba raises torch's intra-op thread
  count mid-run. This implementation uses numpy only.
- `SuffixVoter` is vLLM's ``suffix`` method (Arctic Inference's suffix trees, the library vLLM
  drives in ``vllm/v1/spec_decode/suffix_decoding.py``): it matches the text's end against a tree
  of the request's prompt and a global tree of earlier outputs, and drafts the most frequent
  continuation while its estimated probability stays above a floor.

Pure module (numpy + stdlib, and arctic-inference for `SuffixVoter`; no vllm/torch).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["NgramVoter", "SuffixVoter", "ngram_lookup"]


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


class SuffixVoter:
    """Suffix decoding as a voter: vLLM's ``suffix`` proposer, one request at a time.

    State is Arctic's `SuffixDecodingCache`: a prompt tree per active request, and a global tree
    holding the output of every request seen (up to ``max_cached_requests``, oldest evicted
    first). The voter feeds the cache each request's new output tokens the first time it sees
    them, whether or not it is asked to draft, so the global tree holds the same streams as under
    vLLM's own proposer, which adds each step's sampled tokens.

    Lifecycle: `forget` stops a request (finished, aborted or preempted): its prompt tree goes,
    its output stays in the global tree. A request seen again after `forget` (resumed after a
    preemption) starts over: its cached output is replaced by the output it has now, so the
    global tree never holds a request twice. (vLLM's proposer restarts such a request from its
    prompt and loses the output produced before the preemption; here the output is kept.)
    """

    name: str = "suffix"

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1) -> None:
        """Defaults are vLLM's (``suffix_decoding_*`` in its speculative config).

        Raises:
            ImportError: arctic-inference is not installed (the config checks this first and
                says how to install it).
            ValueError: on a setting vLLM would refuse too.
        """
        if max_tree_depth < 1:
            raise ValueError(f"suffix_decoding_max_tree_depth must be >= 1, got {max_tree_depth}")
        if max_cached_requests < 0:
            raise ValueError("suffix_decoding_max_cached_requests must be >= 0, got "
                             f"{max_cached_requests}")
        if max_spec_factor < 0:
            raise ValueError(f"suffix_decoding_max_spec_factor must be >= 0, got {max_spec_factor}")
        if not 0 <= min_token_prob <= 1:
            raise ValueError(f"suffix_decoding_min_token_prob must be in [0, 1], got "
                             f"{min_token_prob}")
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.max_tree_depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.cache: Any = SuffixDecodingCache(max_tree_depth=max_tree_depth,
                                              max_cached_requests=max_cached_requests)
        self._fed: dict[str, int] = {}  # req_id -> tokens of its text the cache holds

    def observe(self, req_id: str, context: np.ndarray, num_prompt_tokens: int | None) -> None:
        """Bring the cache up to ``context`` (the request's prompt and output so far).

        ``num_prompt_tokens``: where the prompt ends in ``context``; None when unknown (the
        whole first context seen is then taken as the prompt)."""
        ctx = np.ascontiguousarray(context, dtype=np.int32)
        fed = self._fed.get(req_id)
        if fed is None or fed > len(ctx):
            if req_id in self.cache.active_requests:  # shorter text: not the request we knew
                self.cache.stop_request(req_id)
            prompt = len(ctx) if num_prompt_tokens is None else min(num_prompt_tokens, len(ctx))
            # Replaces any output cached under this id (a request resumed after preemption).
            self.cache.start_request(req_id, ctx[:prompt])
            fed = prompt
        if len(ctx) > fed:
            self.cache.add_active_response(req_id, ctx[fed:])
        self._fed[req_id] = len(ctx)

    def propose(self, req_id: str, context: np.ndarray, k: int,
                num_prompt_tokens: int | None = None) -> list[int]:
        """Up to ``k`` draft tokens continuing ``context`` (may be empty); feeds the cache."""
        ctx = np.ascontiguousarray(context, dtype=np.int32)  # once: observe reuses it uncopied
        self.observe(req_id, ctx, num_prompt_tokens)
        if k <= 0:
            return []
        draft = self.cache.speculate(
            req_id, ctx[-self.max_tree_depth:], max_spec_tokens=k,
            max_spec_factor=self.max_spec_factor, min_token_prob=self.min_token_prob)
        return [int(t) for t in draft.token_ids]

    def forget(self, req_ids: Iterable[str]) -> None:
        """Stop these requests (finished, aborted, preempted): their outputs stay cached."""
        for req_id in req_ids:
            if self._fed.pop(req_id, None) is not None and req_id in self.cache.active_requests:
                self.cache.stop_request(req_id)

    @property
    def active(self) -> int:
        """Requests with a prompt tree (seen and not forgotten)."""
        return len(self.cache.active_requests)

    def __repr__(self) -> str:
        return (f"SuffixVoter(max_tree_depth={self.max_tree_depth}, "
                f"max_spec_factor={self.max_spec_factor}, min_token_prob={self.min_token_prob})")
