"""Drafters are checked against the target by tokenizer, not by embedding size (tiny tokenizers
and configs written to disk; no model weights, no engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from smurfs_tools.tiny_models import _build_tokenizer
from vllm_smurfs.config import SmurfsConfig


def model_folder(path: Path, vocab_size: int, tokenizer_seed: int | None = 0) -> str:
    """A folder with a Qwen2 config of ``vocab_size`` rows and (unless None) a tokenizer."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": vocab_size,
        "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "intermediate_size": 256}))
    if tokenizer_seed is not None:
        _build_tokenizer(seed=tokenizer_seed).save_pretrained(path)
    return str(path)


def config(*drafters: str) -> SmurfsConfig:
    return SmurfsConfig.from_user_dict({"method": "smurfs", "num_speculative_tokens": 4,
                                        "drafters": [{"model": d} for d in drafters]})


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "target": model_folder(root / "target-640", 640),  # padded past its drafter
        "drafter": model_folder(root / "drafter-600", 600),
        "other": model_folder(root / "other-600", 600, tokenizer_seed=1),
        "bare": model_folder(root / "bare-600", 600, tokenizer_seed=None),
    }


def test_one_tokenizer_with_padded_embeddings_is_accepted(folders):
    config(folders["drafter"]).check_against_target(folders["target"], 640)


def test_another_tokenizer_of_the_same_size_is_refused_naming_both_models(folders):
    with pytest.raises(ValueError) as info:
        config(folders["other"]).check_against_target(folders["drafter"], 600)
    message = str(info.value)
    assert "drafters[0].model" in message
    assert folders["other"] in message and folders["drafter"] in message
    assert "another tokenizer" in message and "600 tokens against 600" in message
    assert "with another id, e.g." in message


def test_a_drafter_without_a_tokenizer_needs_the_targets_embedding_size(folders, tmp_path):
    # Read with the target's tokenizer (as vLLM reads a draft model): the size is all there is.
    config(folders["bare"]).check_against_target(folders["drafter"], 600)
    with pytest.raises(ValueError, match=r"drafter '.*bare-600' has no tokenizer to compare "
                                         r"with the target '.*target-640', and its config gives "
                                         r"600 vocabulary rows where the target has 640.*copy "
                                         r"the target's tokenizer files"):
        config(folders["bare"]).check_against_target(folders["target"], 640)


def test_the_target_tokenizer_may_live_apart_from_its_weights(folders, tmp_path):
    weights_only = model_folder(tmp_path / "weights-only", 640, tokenizer_seed=None)
    config(folders["drafter"]).check_against_target(weights_only, 640,
                                                    target_tokenizer=folders["target"])
