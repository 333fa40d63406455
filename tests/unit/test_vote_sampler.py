"""Unit and property tests for vllm_smurfs.vote_sampler (pure, no engine)."""

from __future__ import annotations

import ast
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_smurfs.vote_sampler import (
    DrafterWeights,
    VoteResult,
    WeightUpdateRule,
    matched_prefix_len,
    score_draft,
    weighted_prefix_vote,
)

# Small vocabulary so random drafts share prefixes often enough to exercise the tree.
tokens_st = st.integers(min_value=0, max_value=4)
draft_st = st.lists(tokens_st, max_size=8)
weight_st = st.floats(min_value=0.01, max_value=50.0, allow_nan=False, allow_infinity=False)


@st.composite
def drafts_and_weights(draw: st.DrawFn) -> tuple[list[list[int]], list[float]]:
    n = draw(st.integers(min_value=1, max_value=8))
    drafts = draw(st.lists(draft_st, min_size=n, max_size=n))
    weights = draw(st.lists(weight_st, min_size=n, max_size=n))
    return drafts, weights


# ---------------------------------------------------------------- weighted_prefix_vote, by hand


def test_majority_wins_with_equal_weights() -> None:
    drafts = [[1, 2, 3], [1, 2, 3], [1, 9, 9], [7, 7]]
    res = weighted_prefix_vote(drafts, [1.0] * 4)
    assert res == VoteResult(tokens=[1, 2, 3], winner=0, support=[3.0, 2.0, 2.0])


def test_weight_overrides_count() -> None:
    drafts = [[1, 2], [1, 2], [5, 6, 7]]
    res = weighted_prefix_vote(drafts, [1.0, 1.0, 2.5])
    assert res.tokens == [5, 6, 7]
    assert res.winner == 2
    assert res.support == [2.5, 2.5, 2.5]


def test_shared_prefix_accumulates_weight_before_split() -> None:
    # Drafter 2 alone outweighs each of 0 and 1, but 0 and 1 share the first token, so their
    # combined weight wins depth 0; at depth 1 drafter 2 is no longer alive.
    drafts = [[1, 2], [1, 3], [4, 4]]
    res = weighted_prefix_vote(drafts, [1.0, 1.5, 2.0])
    assert res.tokens == [1, 3]
    assert res.winner == 1
    assert res.support == [2.5, 1.5]


def test_tie_break_prefers_lowest_index_supporter() -> None:
    res = weighted_prefix_vote([[8, 1], [3, 1]], [1.0, 1.0])
    assert res.tokens == [8, 1] and res.winner == 0
    res = weighted_prefix_vote([[3, 1], [8, 1]], [1.0, 1.0])
    assert res.tokens == [3, 1] and res.winner == 0
    # Tie decided by the lowest supporting index, not by where the child's heavier member sits:
    # token 5 is supported by drafters 1 and 2 (lowest 1), token 6 by drafters 0 and 3 (lowest 0).
    res = weighted_prefix_vote([[6], [5], [5], [6]], [1.0, 1.0, 1.0, 1.0])
    assert res.tokens == [6] and res.winner == 0
    # Tie at a deeper level, after a shared prefix.
    res = weighted_prefix_vote([[1, 2, 0], [1, 4]], [2.0, 2.0])
    assert res.tokens == [1, 2, 0] and res.winner == 0


def test_winner_is_lowest_index_with_full_chain() -> None:
    # Drafter 0 stops early (its draft is a proper prefix of the chain), so it is not the winner.
    drafts = [[1], [1, 2], [1, 2]]
    res = weighted_prefix_vote(drafts, [1.0, 1.0, 1.0])
    assert res.tokens == [1, 2]
    assert res.winner == 1
    assert res.support == [3.0, 2.0]


def test_chain_continues_while_any_supporter_continues() -> None:
    # Drafters 0 and 1 stop after one token; drafter 2 keeps going and carries the chain.
    res = weighted_prefix_vote([[1], [1], [1, 5, 6]], [3.0, 3.0, 0.1])
    assert res.tokens == [1, 5, 6]
    assert res.winner == 2
    assert res.support == pytest.approx([6.1, 0.1, 0.1])


def test_empty_drafts_contribute_nothing() -> None:
    res = weighted_prefix_vote([[], [4, 5], []], [10.0, 1.0, 10.0])
    assert res == VoteResult(tokens=[4, 5], winner=1, support=[1.0, 1.0])


def test_all_empty_and_no_drafters() -> None:
    assert weighted_prefix_vote([[], []], [1.0, 2.0]) == VoteResult([], -1, [])
    assert weighted_prefix_vote([], []) == VoteResult([], -1, [])


def test_max_len_truncates() -> None:
    drafts = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 9]]
    res = weighted_prefix_vote(drafts, [1.0, 1.0, 1.0], max_len=2)
    assert res.tokens == [1, 2]
    assert res.winner == 0
    assert res.support == [3.0, 2.0]
    assert weighted_prefix_vote(drafts, [1.0] * 3, max_len=0) == VoteResult([], -1, [])
    assert weighted_prefix_vote(drafts, [1.0] * 3, max_len=100).tokens == [1, 2, 3, 4]


def test_accepts_non_list_sequences() -> None:
    res = weighted_prefix_vote(((1, 2), (1, 3)), (1.0, 2.0))
    assert res.tokens == [1, 3]
    assert all(type(t) is int for t in res.tokens)


@pytest.mark.parametrize(
    ("drafts", "weights", "max_len", "match"),
    [
        ([[1], [2]], [1.0], None, "weights has 1 entries but there are 2 drafts"),
        ([[1], [2]], [1.0, 0.0], None, r"weights\[1\] must be finite and > 0"),
        ([[1], [2]], [-1.0, 1.0], None, r"weights\[0\]"),
        ([[1]], [math.nan], None, r"weights\[0\]"),
        ([[1]], [math.inf], None, r"weights\[0\]"),
        ([[1]], [1.0], -1, "max_len must be >= 0"),
    ],
)
def test_vote_value_errors(
    drafts: list[list[int]], weights: list[float], max_len: int | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        weighted_prefix_vote(drafts, weights, max_len=max_len)


# ---------------------------------------------------------------- weighted_prefix_vote, properties


@settings(max_examples=300, deadline=None)
@given(drafts_and_weights(), st.one_of(st.none(), st.integers(min_value=0, max_value=10)))
def test_chain_is_winners_draft(
    dw: tuple[list[list[int]], list[float]], max_len: int | None
) -> None:
    drafts, weights = dw
    res = weighted_prefix_vote(drafts, weights, max_len=max_len)
    assert len(res.support) == len(res.tokens)
    if not res.tokens:
        assert res.winner == -1
        # Empty only when nobody drafted anything, or max_len forbids any token.
        assert max_len == 0 or all(len(d) == 0 for d in drafts)
        return
    assert drafts[res.winner][: len(res.tokens)] == res.tokens
    # The walk stops only where no supporter continues, so the chain is the winner's full draft
    # (up to max_len).
    limit = len(drafts[res.winner]) if max_len is None else min(max_len, len(drafts[res.winner]))
    assert len(res.tokens) == limit
    # Winner is the lowest index having the chain as prefix.
    holders = [i for i, d in enumerate(drafts) if d[: len(res.tokens)] == res.tokens]
    assert res.winner == holders[0]
    # Support at each depth equals the summed weight of drafters through that node.
    for j, s in enumerate(res.support):
        expected = sum(
            w for d, w in zip(drafts, weights, strict=True) if d[: j + 1] == res.tokens[: j + 1]
        )
        assert s == pytest.approx(expected)
    assert all(a >= b for a, b in zip(res.support[:-1], res.support[1:], strict=True))


@settings(max_examples=200, deadline=None)
@given(
    majority_draft=st.lists(tokens_st, min_size=1, max_size=8),
    n_majority=st.integers(min_value=1, max_value=5),
    minority=st.lists(draft_st, max_size=4),
    data=st.data(),
)
def test_strict_majority_wins_with_equal_weights(
    majority_draft: list[int], n_majority: int, minority: list[list[int]], data: st.DataObject
) -> None:
    # Minority drafts differ from the majority at the first token (or are empty).
    minority = [d for d in minority if not d or d[0] != majority_draft[0]]
    if n_majority <= len(minority):
        n_majority = len(minority) + 1
    drafts = [list(majority_draft) for _ in range(n_majority)] + minority
    drafts = data.draw(st.permutations(drafts))
    res = weighted_prefix_vote(drafts, [1.0] * len(drafts))
    assert res.tokens == majority_draft
    assert res.support == [float(n_majority)] * len(majority_draft)


@settings(max_examples=100, deadline=None)
@given(drafts_and_weights(), st.one_of(st.none(), st.integers(min_value=0, max_value=10)))
def test_vote_is_deterministic(
    dw: tuple[list[list[int]], list[float]], max_len: int | None
) -> None:
    drafts, weights = dw
    first = weighted_prefix_vote(drafts, weights, max_len=max_len)
    again = weighted_prefix_vote([list(d) for d in drafts], list(weights), max_len=max_len)
    assert first == again


# ---------------------------------------------------------------- scoring


def test_matched_prefix_len() -> None:
    assert matched_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert matched_prefix_len([1, 2], [1, 2, 3]) == 2
    assert matched_prefix_len([], [1]) == 0
    assert matched_prefix_len([5], [1]) == 0


def test_score_draft() -> None:
    # Target accepted 2 tokens then corrected: [1, 2, 7]; draft agreed on 2 of 3 judgeable.
    assert score_draft([1, 2, 3, 4], [1, 2, 7]) == pytest.approx(2 / 3)
    # Draft shorter than target output: fully right on what it proposed.
    assert score_draft([1, 2], [1, 2, 3]) == 1.0
    assert score_draft([9, 2], [1, 2, 3]) == 0.0
    # No evidence.
    assert score_draft([], [1, 2]) is None
    assert score_draft([1, 2], []) is None


@settings(max_examples=300, deadline=None)
@given(draft_st, draft_st)
def test_score_draft_in_unit_interval_or_none(draft: list[int], target: list[int]) -> None:
    s = score_draft(draft, target)
    if min(len(draft), len(target)) == 0:
        assert s is None
    else:
        assert s is not None and 0.0 <= s <= 1.0
        assert s == matched_prefix_len(draft, target) / min(len(draft), len(target))


# ---------------------------------------------------------------- weight updates


def test_update_rule_values() -> None:
    rule = WeightUpdateRule()
    assert rule.updated(1.0, 1.0) == pytest.approx(math.exp(0.2 * 0.5))
    assert rule.updated(1.0, 0.0) == pytest.approx(math.exp(-0.2 * 0.5))
    assert rule.updated(1.0, 0.5) == pytest.approx(1.0)
    assert rule.updated(3.0, None) == 3.0
    # Forgetting pulls a weight back towards 1 when the score sits at the threshold.
    assert rule.updated(4.0, 0.5) == pytest.approx(4.0**0.9)
    assert rule.updated(0.25, 0.5) == pytest.approx(0.25**0.9)
    plain = WeightUpdateRule(learning_rate=0.5, forgetting=0.0)
    assert plain.updated(1.0, 1.0) == pytest.approx(math.exp(0.25))
    assert plain.updated(plain.max_weight, 1.0) == plain.max_weight
    assert plain.updated(plain.min_weight, 0.0) == plain.min_weight
    # A huge learning rate clips instead of overflowing.
    big = WeightUpdateRule(learning_rate=1e6)
    assert big.updated(1.0, 1.0) == big.max_weight
    assert big.updated(1.0, 0.0) == big.min_weight


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"learning_rate": -0.1}, "learning_rate"),
        ({"learning_rate": math.nan}, "learning_rate"),
        ({"threshold": 1.5}, "threshold"),
        ({"forgetting": 1.5}, "forgetting"),
        ({"threshold": -0.1}, "threshold"),
        ({"min_weight": 0.0}, "min_weight"),
        ({"min_weight": 5.0, "max_weight": 1.0}, "max_weight"),
        ({"max_weight": math.inf}, "max_weight"),
    ],
)
def test_update_rule_validation(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        WeightUpdateRule(**kwargs)


def test_update_rule_rejects_bad_inputs() -> None:
    rule = WeightUpdateRule()
    with pytest.raises(ValueError, match="score"):
        rule.updated(1.0, 1.5)
    with pytest.raises(ValueError, match="weight"):
        rule.updated(0.0, 0.5)


def test_drafter_weights_init_clip_copy_and_errors() -> None:
    dw = DrafterWeights([100.0, 1.0, 0.001])
    assert dw.weights == [20.0, 1.0, 0.05]
    assert len(dw) == 3
    # `weights` is a copy.
    dw.weights[0] = 123.0
    assert dw.weights[0] == 20.0
    other = dw.copy()
    other.update([0.0, 0.0, 0.0])
    assert dw.weights == [20.0, 1.0, 0.05]
    assert other.weights != dw.weights
    with pytest.raises(ValueError, match=r"initial\[1\]"):
        DrafterWeights([1.0, 0.0])
    with pytest.raises(ValueError, match="2 scores for 3 drafters"):
        dw.update([1.0, 1.0])
    before = dw.weights
    with pytest.raises(ValueError, match="score"):
        dw.update([1.0, 2.0, 1.0])
    assert dw.weights == before  # a rejected update changes nothing


def test_none_score_leaves_weight_alone() -> None:
    dw = DrafterWeights([1.0, 1.0])
    dw.update([None, 1.0])
    assert dw.weights[0] == 1.0
    assert dw.weights[1] > 1.0


@settings(max_examples=200, deadline=None)
@given(
    initial=st.lists(
        st.floats(min_value=1e-6, max_value=1e6, allow_nan=False), min_size=1, max_size=8
    ),
    data=st.data(),
)
def test_weights_stay_in_bounds(initial: list[float], data: st.DataObject) -> None:
    rule = WeightUpdateRule(
        learning_rate=data.draw(st.floats(min_value=0.0, max_value=50.0)),
        threshold=data.draw(st.floats(min_value=0.0, max_value=1.0)),
    )
    dw = DrafterWeights(initial, rule)
    score_st = st.one_of(st.none(), st.floats(min_value=0.0, max_value=1.0))
    steps = data.draw(
        st.lists(st.lists(score_st, min_size=len(initial), max_size=len(initial)), max_size=30)
    )
    for scores in steps:
        dw.update(scores)
        for w in dw.weights:
            assert rule.min_weight <= w <= rule.max_weight
            assert w > 0


def test_consistently_better_drafter_gains_weight() -> None:
    # Drafter 1 always matches the target; drafter 0 is right on the first token only.
    target = [1, 2, 3, 4, 5]
    dw = DrafterWeights([1.0, 1.0])
    for _ in range(10):
        dw.update([score_draft([1, 9, 9, 9], target), score_draft([1, 2, 3, 4], target)])
    w = dw.weights
    assert w[1] > w[0]
    # And the heavier drafter now wins the vote even against a 2-drafter bloc of the weaker kind.
    dw3 = DrafterWeights([1.0, 1.0, 1.0])
    for _ in range(10):
        dw3.update([0.25, 0.25, 1.0])
    res = weighted_prefix_vote([[1, 9], [1, 9], [1, 2]], dw3.weights)
    assert res.tokens == [1, 2]
    assert res.winner == 2


# ---------------------------------------------------------------- purity of the pure modules

_PKG = Path(__file__).resolve().parents[2] / "vllm_smurfs"


PURE_MODULES = ["vote_sampler.py", "length_controller.py", "control/plan_search.py",
                "control/planner.py",
                "control/fixed.py", "control/feedback.py", "control/acceptance.py",
                "control/drafting_rules.py", "control/step_costs.py", "control/plan.py",
                "control/streaming_mode.py", "control/model_drafting.py", "drafters/model_free.py",
                "drafters/protocol.py", "trace/format.py", "trace/simulator.py", "trace/report.py",
                "trace/reconstruct.py", "step_outcomes.py", "runner_hooks.py", "metrics.py"]


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_modules_import_only_stdlib_and_numpy(module: str) -> None:
    # These modules must stay importable and testable without vllm/torch.
    tree = ast.parse((_PKG / module).read_text())
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module} uses a relative import"
            name = node.module or ""
            if name.startswith("vllm_smurfs."):  # only the other pure modules
                path = name.split(".", 1)[1].replace(".", "/") + ".py"
                assert path in PURE_MODULES, f"{module} imports {name}"
                continue
            roots.add(name.split(".")[0])
    allowed = set(sys.stdlib_module_names) | {"numpy", "__future__"} | ALSO_ALLOWED.get(module,
                                                                                    set())
    assert roots <= allowed, f"{module} imports {sorted(roots - allowed)}"


# The suffix voter's library: its suffix trees import numpy and a native module, no vllm/torch.
ALSO_ALLOWED = {"drafters/model_free.py": {"arctic_inference"}}


def test_the_suffix_voters_library_imports_neither_vllm_nor_torch() -> None:
    out = subprocess.run([sys.executable, "-c", "import sys, arctic_inference.suffix_decoding; "
                          "print(sorted({'vllm', 'torch'} & set(sys.modules)))"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
