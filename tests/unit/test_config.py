"""SmurfsConfig validation without an engine, and the configuration reference staying complete."""

import json
import re
from pathlib import Path

import pytest

from vllm_smurfs.config import (
    LookaheadConfig,
    ModelDrafterConfig,
    NgramDrafterConfig,
    SmurfsConfig,
    VoteConfig,
    load_user_config,
)
from vllm_smurfs.vote_sampler import WeightUpdateRule

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_defaults_and_drafter_kinds():
    config = SmurfsConfig.from_user_dict({
        "method": "smurfs", "num_speculative_tokens": 6,
        "drafters": [{"model": "/a"}, {"method": "ngram"}]})
    assert isinstance(config.drafters[0], ModelDrafterConfig)
    assert isinstance(config.drafters[1], NgramDrafterConfig)
    assert config.model_drafters == [config.drafters[0]]
    assert config.drafters[0].display_name == "a"
    assert config.drafters[1].display_name == "ngram[2,4]"
    # The config's vote defaults are the vote module's documented defaults.
    assert WeightUpdateRule(**config.vote.model_dump()) == WeightUpdateRule()


def test_round_trip_through_additional_config():
    config = SmurfsConfig.from_user_dict({
        "method": "smurfs", "num_speculative_tokens": 3, "drafters": [{"method": "ngram"}]})
    again = SmurfsConfig.from_additional_config({"smurfs": json.loads(config.model_dump_json())})
    assert again == config
    with pytest.raises(ValueError, match="no 'smurfs' entry in additional_config"):
        SmurfsConfig.from_additional_config({})


def test_user_config_from_file_or_inline(tmp_path):
    path = tmp_path / "s.json"
    path.write_text('{"method": "smurfs"}')
    assert load_user_config(str(path)) == {"method": "smurfs"}
    assert load_user_config(' {"method": "smurfs"} ') == {"method": "smurfs"}
    with pytest.raises(ValueError, match="expected a JSON object"):
        load_user_config("[1, 2]")


@pytest.mark.parametrize("model_cls", [SmurfsConfig, ModelDrafterConfig, NgramDrafterConfig,
                                       VoteConfig, LookaheadConfig])
def test_readme_documents_every_key(model_cls):
    documented = set(re.findall(r"^\| `(\w+)` \|", REFERENCE.read_text(), re.M))
    missing = set(model_cls.model_fields) - documented
    assert not missing, f"docs/configuration.md lacks {sorted(missing)}"
