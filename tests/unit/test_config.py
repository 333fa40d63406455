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
    SuffixDrafterConfig,
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
    assert WeightUpdateRule(**config.vote.update_rule_kwargs()) == WeightUpdateRule()
    assert config.vote.mixture_sharpness == 1.0


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
                                       SuffixDrafterConfig, VoteConfig, LookaheadConfig])
def test_readme_documents_every_key(model_cls):
    documented = set(re.findall(r"^\| `(\w+)` \|", REFERENCE.read_text(), re.M))
    missing = set(model_cls.model_fields) - documented
    assert not missing, f"docs/configuration.md lacks {sorted(missing)}"


def test_ray_placement_and_its_options():
    config = SmurfsConfig.from_user_dict({
        "method": "smurfs", "num_speculative_tokens": 4,
        "drafters": [{"model": "/a"}, {"model": "/b", "placement": "ray",
                                        "ray_options": {"num_cpus": 1}, "num_threads": 2}]})
    assert config.process_drafters == [config.drafters[1]]  # it streams, as a process drafter
    assert config.worker_drafters == [config.drafters[0]]
    assert config.drafters[1].ray_options == {"num_cpus": 1}
    with pytest.raises(ValueError, match=r"ray_options .* only placement 'ray'.*'process'"):
        SmurfsConfig.from_user_dict({
            "method": "smurfs", "num_speculative_tokens": 4,
            "drafters": [{"model": "/b", "placement": "process", "ray_options": {}}]})
    with pytest.raises(ValueError, match=r"drafters\[0\]\.placement: .*'ray' \(got 'cluster'\)"):
        SmurfsConfig.from_user_dict({
            "method": "smurfs", "num_speculative_tokens": 4,
            "drafters": [{"model": "/b", "placement": "cluster"}]})


def test_a_target_split_over_workers_refuses_in_worker_drafters():
    from types import SimpleNamespace

    from vllm_smurfs.engine_setup import check_parallelism

    config = SmurfsConfig.from_user_dict({
        "method": "smurfs", "num_speculative_tokens": 4,
        "drafters": [{"model": "/r", "placement": "ray"}, {"model": "/a"}]})
    with pytest.raises(ValueError, match=r"drafters\[1\]\.placement: .* split over 2"):
        check_parallelism(config, SimpleNamespace(tensor_parallel_size=2,
                                                  pipeline_parallel_size=1))
    check_parallelism(config, SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))
    only_ray = SmurfsConfig.from_user_dict({
        "method": "smurfs", "num_speculative_tokens": 4,
        "drafters": [{"model": "/r", "placement": "ray"}, {"method": "ngram"}]})
    check_parallelism(only_ray, SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=2))
