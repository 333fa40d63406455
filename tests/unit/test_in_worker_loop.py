"""The in-worker drafter's drafting loop, on a scripted model (no engine): what it drafts, that it
asks the device for nothing mid-loop, and which errors cost speculation and which stop the engine.

The drafter is built without vLLM's set-up (`object.__new__`), with a model whose next token is
the input token + 1: its drafts are known in advance. vLLM's attention metadata and forward
context are stubbed: what is tested is the loop around them.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_smurfs.drafters import in_worker as module
from vllm_smurfs.drafters.in_worker import (
    DraftRows,
    FatalDrafterError,
    InWorkerDrafter,
    is_fatal_device_error,
)
from vllm_smurfs.drafters.process_client import DrafterHealth
from vllm_smurfs.drafters.sampling import RowSampling

VOCAB = 50
BLOCK = 4


class NextTokenModel(torch.nn.Module):
    """Hidden state = one-hot of (input + 1); logits = 10 x hidden: the greedy draft of a text
    ending in t is t+1, t+2, ... Records every forward's inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[list[int], list[int]]] = []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.calls.append((input_ids.tolist(), positions.tolist()))
        return torch.nn.functional.one_hot((input_ids.long() + 1) % VOCAB, VOCAB).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return 10.0 * hidden


def make_drafter(monkeypatch, vocab_limit: int = VOCAB,
                 context_vocab_limit: int | None = None) -> InWorkerDrafter:
    monkeypatch.setattr(module, "set_forward_context",
                        lambda *args, **kwargs: contextlib.nullcontext())
    drafter = object.__new__(InWorkerDrafter)
    drafter.name = "scripted"
    drafter.spec = SimpleNamespace(draft_vocab_size=None)
    drafter.device = torch.device("cpu")
    drafter.block_size = BLOCK
    drafter.max_num_tokens = 64
    drafter.max_context = 1000
    drafter.vocab_limit = vocab_limit
    drafter.context_vocab_limit = context_vocab_limit or vocab_limit
    drafter._context_ids = {}
    drafter.kv_cache_gid = 0
    drafter.health = DrafterHealth("scripted")
    drafter._synced = {}
    drafter._fail_after = -1
    drafter._fault_kind = ""
    drafter._stall_s = 0.0
    drafter._draft_attn_layer_names = set()
    drafter.vllm_config = None
    drafter.model = NextTokenModel()
    drafter.slot_mappings = []

    def metadata(common):
        drafter.slot_mappings.append(common.slot_mapping.tolist())
        return None, {}

    drafter.build_per_group_and_layer_attn_metadata = metadata
    return drafter


def batch(lengths: list[int], caps: list[int]) -> tuple[DraftRows, torch.Tensor]:
    contexts = [np.arange(n, dtype=np.int64) % 40 for n in lengths]
    rows = np.arange(len(lengths))
    # Request i owns blocks 100*i, 100*i + 1, ...: a slot's block says whose it is.
    table = torch.tensor([[100 * i + b for b in range(64)] for i in range(len(lengths))],
                         dtype=torch.int32)
    return DraftRows([f"r{i}" for i in range(len(lengths))], rows, contexts, caps), table


def expected(length: int, cap: int) -> list[int]:
    last = (length - 1) % 40
    return [(last + j) % VOCAB for j in range(1, cap + 1)]


def test_drafts_catch_up_in_chunks_and_extend_each_request_to_its_cap(monkeypatch):
    drafter = make_drafter(monkeypatch)
    rows, table = batch([10, 3, 7], [3, 0, 1])
    result = drafter.draft(rows, table, max_tokens_per_forward=8)
    assert result.tokens == [expected(10, 3), [], expected(7, 1)]
    assert all(len(c) == len(t) for c, t in zip(result.confidences, result.tokens))
    assert drafter._synced == {"r0": 10, "r2": 7}  # a request without a cap is not computed
    # 17 catch-up tokens in forwards of at most 8, then request 0 alone, twice.
    assert [p.num_tokens for p in result.passes] == [8, 8, 1, 1, 1]
    # Every written slot lies in the request's own blocks, at its position.
    slots = [s for forward in drafter.slot_mappings for s in forward]
    assert slots[:10] == [p // BLOCK * BLOCK + p % BLOCK for p in range(10)]
    assert slots[10:17] == [(200 + p // BLOCK) * BLOCK + p % BLOCK for p in range(7)]
    assert slots[17:] == [(10 + j) // BLOCK * BLOCK + (10 + j) % BLOCK for j in range(2)]
    # The next step catches up from the synced position only.
    rows, table = batch([12], [1])
    drafter.draft(rows, table)
    assert drafter.model.calls[-1] == ([10, 11], [10, 11])


def test_drafts_stay_below_the_vocabulary_limit(monkeypatch):
    # A drafter padded past the target: ids from 20 on have no row in the target.
    drafter = make_drafter(monkeypatch, vocab_limit=20)
    rows, table = batch([18], [4])
    assert all(t < 20 for t in drafter.draft(rows, table).tokens[0])


class PlainHeadModel(NextTokenModel):
    """The same model with its logits a plain product with an output layer (10 x identity): the
    drafter then computes only the output rows it may draft (`compute_logits` is not called)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = SimpleNamespace(weight=10.0 * torch.eye(VOCAB), bias=None)
        self.logits_processor = SimpleNamespace(soft_cap=None, scale=1.0)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the whole output layer was computed")


class ShardedHeadModel(NextTokenModel):
    """An output layer split over 2 tensor-parallel ranks (this rank holds ids 25-49): only
    `compute_logits`, which gathers the ranks' logits, knows the whole vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = SimpleNamespace(weight=10.0 * torch.eye(VOCAB)[VOCAB // 2:], bias=None,
                                       tp_size=2)
        self.logits_processor = SimpleNamespace(soft_cap=None, scale=1.0)


def rare_text_batch() -> tuple[DraftRows, torch.Tensor]:
    """Two requests: the first's text holds ids 24-27 (beyond a limit of 20) and ends in 24; the
    second's has none beyond 20."""
    rows, table = batch([5, 5], [5, 2])
    rows.contexts[0] = np.array([1, 25, 26, 27, 24], dtype=np.int64)
    return rows, table


@pytest.mark.parametrize("model", [NextTokenModel, PlainHeadModel, ShardedHeadModel])
def test_a_trimmed_vocabulary_still_drafts_the_ids_of_the_requests_own_texts(monkeypatch, model):
    drafter = make_drafter(monkeypatch, vocab_limit=20, context_vocab_limit=VOCAB)
    drafter.model = model()
    rows, table = rare_text_batch()
    result = drafter.draft(rows, table)
    # 24 -> 25, 26, 27 (ids of its text); 28 is in no text: the best id it may draft is 0 (all
    # its logits 0, the first wins), then 1. Without the text's ids: 0, 1, 2, 3, 4.
    assert result.tokens[0] == [25, 26, 27, 0, 1]
    assert result.tokens[1] == [5, 6]  # (text 0..4)
    assert drafter._context_ids["r0"][0] == 5
    assert drafter._context_ids["r0"][1].tolist() == [24, 25, 26, 27]
    # Only the new part of a text is read; a forgotten request's ids go with it.
    rows, table = rare_text_batch()
    rows.contexts[0] = np.array([1, 25, 26, 27, 24, 30, 29], dtype=np.int64)
    assert drafter.draft(rows, table).tokens[0][:2] == [30, 0]
    assert drafter._context_ids["r0"][1].tolist() == [24, 25, 26, 27, 29, 30]
    drafter.forget(["r0"])
    assert "r0" not in drafter._context_ids
    # Without a trimmed vocabulary nothing is kept.
    drafter = make_drafter(monkeypatch)
    drafter.draft(*rare_text_batch())
    assert drafter._context_ids == {}


def test_sampled_drafts_of_a_trimmed_vocabulary_keep_q_by_token_id(monkeypatch):
    drafter = make_drafter(monkeypatch, vocab_limit=20, context_vocab_limit=VOCAB)
    drafter.model = PlainHeadModel()
    rows, table = rare_text_batch()
    rows.sampling = RowSampling(np.array([1.0, 1.0]), np.array([0, 0]), np.array([1.0, 1.0]),
                                {})
    result = drafter.draft(rows, table)
    allowed = set(range(20)) | {24, 25, 26, 27}
    for tokens, conf, q in zip(result.tokens, result.confidences, result.probs):
        assert q is not None and q.shape == (len(tokens), 28)  # up to the largest id drafted
        torch.testing.assert_close(q.sum(dim=1), torch.ones(len(tokens)))
        assert set(torch.nonzero(q.sum(dim=0)).flatten().tolist()) == allowed
        for j, token in enumerate(tokens):
            assert token in allowed and q[j, token].item() == pytest.approx(conf[j])
    # q of the first draft after 24: softmax over the allowed ids of 10 x one-hot(25)
    expected = torch.zeros(28)
    expected[sorted(allowed)] = 1.0
    expected[25] = np.exp(10.0)
    torch.testing.assert_close(result.probs[0][0], expected / expected.sum())


class HostSyncCounter:
    """Counts the calls that copy a tensor's values to the host (on a GPU, each waits for every
    kernel queued before it)."""

    NAMES = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, **kwargs):
                self.count += 1
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)


def test_the_loop_copies_nothing_to_the_host_until_the_drafts_are_done(monkeypatch):
    drafter = make_drafter(monkeypatch)
    drafter.model.forward = lambda input_ids, positions: torch.nn.functional.one_hot(
        (input_ids.long() + 1) % VOCAB, VOCAB).float()  # the recording model would count
    drafter.build_per_group_and_layer_attn_metadata = lambda common: (None, {})
    rows, table = batch([9, 5, 6, 11], [5, 5, 2, 4])
    counter = HostSyncCounter(monkeypatch)
    result = drafter.draft(rows, table, max_tokens_per_forward=16)
    forwards = len(result.passes)
    assert forwards == 6  # two catch-up forwards, four extensions
    assert counter.count == 1  # the drafts and confidences, in one copy at the end
    assert result.tokens == [expected(9, 5), expected(5, 5), expected(6, 2), expected(11, 4)]


def test_a_stop_rule_costs_one_copy_per_forward(monkeypatch):
    drafter = make_drafter(monkeypatch)
    drafter.model.forward = lambda input_ids, positions: torch.nn.functional.one_hot(
        (input_ids.long() + 1) % VOCAB, VOCAB).float()
    drafter.build_per_group_and_layer_attn_metadata = lambda common: (None, {})
    seen: list[list[int]] = []

    def stop(active, confidences, spent_s):
        seen.append([len(confidences[i]) for i in active])
        return [i for i in active if i != 1 or len(confidences[1]) < 2]  # request 1 stops at 2

    rows, table = batch([9, 5], [4, 4])
    counter = HostSyncCounter(monkeypatch)
    result = drafter.draft(rows, table, stop=stop)
    assert result.tokens == [expected(9, 4), expected(5, 2)]
    assert seen == [[1, 1], [2, 2], [3]]  # the rule saw every forward's confidences
    assert counter.count == len(result.passes) + 1  # one per forward, and the drafts at the end


CUDA_ASSERT = ("CUDA error: device-side assert triggered\nCUDA kernel errors might be "
               "asynchronously reported at some other API call, so the stacktrace below might be "
               "incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1")


@pytest.mark.parametrize("message", [
    CUDA_ASSERT,
    "CUDA error: an illegal memory access was encountered",
    "CUDA error: unspecified launch failure",
    "HIP error: an illegal memory access was encountered",
])
def test_a_fatal_device_error_stops_the_engine_with_the_drafter_named(monkeypatch, message):
    drafter = make_drafter(monkeypatch)
    error_type = getattr(torch, "AcceleratorError", RuntimeError)

    def fail(*args, **kwargs):
        raise error_type(message)

    drafter.draft = fail
    runner = SimpleNamespace(input_batch=SimpleNamespace(
        num_reqs=1, block_table=[SimpleNamespace(get_device_tensor=lambda n: None)]))
    with pytest.raises(FatalDrafterError, match=r"drafter 'scripted' hit a fatal device error"
                                                r".*CUDA_LAUNCH_BLOCKING=1") as info:
        drafter.draft_safely(["r0"], np.array([0]), [np.arange(3)], [2], runner, None)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert not drafter.health.alive


@pytest.mark.parametrize("error", [
    RuntimeError("shape mismatch in drafter"),
    ValueError("bad value"),
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
])
def test_other_errors_cost_speculation_only(monkeypatch, error):
    drafter = make_drafter(monkeypatch)

    def fail(*args, **kwargs):
        raise error

    drafter.draft = fail
    runner = SimpleNamespace(input_batch=SimpleNamespace(
        num_reqs=1, block_table=[SimpleNamespace(get_device_tensor=lambda n: None)]))
    result = drafter.draft_safely(["r0"], np.array([0]), [np.arange(3)], [2], runner, None)
    assert result.tokens == [[]]
    assert not drafter.health.alive and drafter.health.last_error


def test_the_injected_device_assert_reads_as_cudas(monkeypatch):
    drafter = make_drafter(monkeypatch)
    drafter._fault_kind = "device_assert_after"
    assert is_fatal_device_error(drafter._injected_fault())
    drafter._fault_kind = "raise_after"
    assert not is_fatal_device_error(drafter._injected_fault())


def test_the_warm_up_runs_every_shape_twice_largest_first_into_the_null_block(monkeypatch):
    # Under torch.compile the first forward traces the drafter's graph, and a one-token trace
    # specializes it to one token (a later larger forward then wrote past its buffers: heap
    # corruption under `vllm serve`). The first forward is the largest the drafter's budget
    # allows; every shape runs twice (the second call is a cost sample); KV goes to block 0.
    drafter = make_drafter(monkeypatch)  # a budget of 64 tokens per forward
    calls = drafter.warm_up(max_lookahead=3)
    sizes = [len(positions) for _, positions in drafter.model.calls]
    assert sizes[0] == max(sizes) == 64
    assert [p.num_tokens for p in calls] == sizes and all(p.seconds >= 0 for p in calls)
    assert sizes[0::2] == sizes[1::2] and len(sizes) == 2 * (3 + 7 + 5)  # each shape twice
    assert sorted(set(sizes)) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64]
    assert all(slot < BLOCK for mapping in drafter.slot_mappings for slot in mapping)
