"""Unit and property tests for vllm_smurfs.drafters.model_free (pure, no engine)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_smurfs.drafters.model_free import NgramVoter, ngram_lookup


def _ctx(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int64)


def naive_ngram_lookup(context: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Reference: the specification written out as plain loops."""
    length = len(context)
    if k <= 0 or length < min_n + 1:
        return []
    for n in range(max_n, min_n - 1, -1):
        if n > length - 1:
            continue
        suffix = context[length - n :]
        # Occurrence starting at i must be followed by a token: i + n <= length - 1.
        for i in range(length - n - 1, -1, -1):
            if context[i : i + n] == suffix:
                return context[i + n : i + n + k]
    return []


def test_basic_lookup() -> None:
    # Suffix [1, 2] occurred at the start, followed by 3, 4, 5.
    assert ngram_lookup(_ctx(1, 2, 3, 4, 5, 1, 2), 2, 4, 3) == [3, 4, 5]


def test_longest_n_preferred() -> None:
    # The 2-gram [8, 9] last occurs at index 6 (followed by 1), but the 3-gram [7, 8, 9] only at
    # index 0 (followed by 5): the longer match wins even though it is older.
    ctx = _ctx(7, 8, 9, 5, 5, 0, 8, 9, 1, 7, 8, 9)
    assert ngram_lookup(ctx, 2, 4, 1) == [5]
    assert ngram_lookup(ctx, 2, 2, 1) == [1]


def test_most_recent_occurrence() -> None:
    ctx = _ctx(1, 2, 10, 1, 2, 20, 1, 2, 30, 1, 2)
    assert ngram_lookup(ctx, 2, 2, 1) == [30]


def test_k_truncation_at_context_end() -> None:
    # The only earlier [4, 5] starts at index 2 and is followed by just 2 tokens (the suffix
    # itself), so a larger k returns what is there.
    ctx = _ctx(1, 2, 4, 5, 4, 5)
    assert ngram_lookup(ctx, 2, 2, 10) == [4, 5]
    assert ngram_lookup(ctx, 2, 2, 1) == [4]
    # Overlapping repeat: [7, 7] occurs ending at index 2, followed by one token only.
    assert ngram_lookup(_ctx(7, 7, 7, 7), 2, 2, 5) == [7]


def test_no_match_and_degenerate_inputs() -> None:
    assert ngram_lookup(_ctx(1, 2, 3, 4), 2, 4, 3) == []
    assert ngram_lookup(_ctx(1, 2, 1, 2), 2, 4, 0) == []
    assert ngram_lookup(_ctx(1, 2, 1, 2), 2, 4, -1) == []
    assert ngram_lookup(_ctx(1, 1), 2, 4, 3) == []  # shorter than min_n + 1
    assert ngram_lookup(_ctx(), 1, 4, 3) == []
    assert ngram_lookup(np.array([], dtype=np.int32), 1, 1, 3) == []
    # A match of length below min_n does not count.
    assert ngram_lookup(_ctx(5, 1, 9, 1), 2, 4, 3) == []
    assert ngram_lookup(_ctx(5, 1, 9, 1), 1, 4, 3) == [9, 1]


def test_returns_python_ints_and_accepts_int32() -> None:
    out = ngram_lookup(np.array([3, 4, 5, 3, 4], dtype=np.int32), 2, 2, 2)
    assert out == [5, 3]
    assert all(type(t) is int for t in out)


def test_bad_context_rejected() -> None:
    with pytest.raises(ValueError, match="1-D"):
        ngram_lookup(np.zeros((2, 3), dtype=np.int64), 1, 2, 1)
    with pytest.raises(ValueError, match="integer"):
        ngram_lookup(np.array([1.0, 2.0, 1.0]), 1, 2, 1)


@pytest.mark.parametrize(
    ("min_n", "max_n", "match"),
    [(0, 4, "prompt_lookup_min"), (-1, 2, "prompt_lookup_min"), (5, 4, "prompt_lookup_max")],
)
def test_min_max_validation(min_n: int, max_n: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        NgramVoter(min_n=min_n, max_n=max_n)
    with pytest.raises(ValueError, match=match):
        ngram_lookup(_ctx(1, 2, 1, 2), min_n, max_n, 2)


def test_voter_propose() -> None:
    voter = NgramVoter()
    assert (voter.min_n, voter.max_n) == (2, 4)
    assert voter.name == "ngram"
    assert voter.propose(_ctx(1, 2, 3, 4, 5, 1, 2), 2) == [3, 4]
    assert NgramVoter(min_n=3, max_n=3).propose(_ctx(1, 2, 3, 4, 5, 1, 2), 2) == []


@settings(max_examples=500, deadline=None)
@given(
    context=st.lists(st.integers(min_value=0, max_value=3), max_size=40),
    min_n=st.integers(min_value=1, max_value=5),
    extra=st.integers(min_value=0, max_value=4),
    k=st.integers(min_value=-1, max_value=8),
)
def test_matches_naive_reference(context: list[int], min_n: int, extra: int, k: int) -> None:
    max_n = min_n + extra
    got = ngram_lookup(np.array(context, dtype=np.int64), min_n, max_n, k)
    assert got == naive_ngram_lookup(context, min_n, max_n, k)
