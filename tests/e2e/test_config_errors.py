"""Each configuration mistake gets a message naming the setting and what was expected."""

import json
import os

import pytest
from vllm.engine.arg_utils import EngineArgs

from vllm_smurfs.patches.cli_speculative_config import parse_speculative_config

pytestmark = pytest.mark.e2e


def engine_config(target: str, spec: dict):
    return EngineArgs(model=target, dtype="float32", max_model_len=256,
                      speculative_config=spec).create_engine_config()


def smurfs(drafters, **extra):
    return {"method": "smurfs", "num_speculative_tokens": 4, "drafters": drafters, **extra}


def test_valid_config_becomes_custom_class(family):
    config = engine_config(family.target, smurfs([{"model": d} for d in family.drafts]
                                                 + [{"method": "ngram"}]))
    assert config.speculative_config.method == "custom_class"
    assert config.speculative_config.model == "vllm_smurfs.proposer.SmurfsProposer"
    assert config.speculative_config.num_speculative_tokens == 4
    assert len(config.additional_config["smurfs"]["drafters"]) == 4


@pytest.mark.parametrize(
    ("make_spec", "expected"),
    [
        (lambda f: smurfs([{"model": f.drafts[0]}], drafter="x"),
         r"speculative_config\.drafter: unknown key; allowed keys: method, num_speculative_tokens"),
        (lambda f: smurfs([{"model": f.drafts[0], "temperature": 0}]),
         r"drafters\[0\]\.temperature: unknown key; allowed keys: method, model"),
        (lambda f: smurfs([]), r"speculative_config\.drafters: List should have at least 1 item"),
        (lambda f: smurfs([{"model": "/no/such/model"}]),
         r"drafters\[0\]\.model: path '/no/such/model' does not exist"),
        (lambda f: smurfs([{"model": f.drafts[0]}], num_speculative_tokens=0),
         r"num_speculative_tokens: Input should be greater than or equal to 1"),
        (lambda f: smurfs([{"model": f.drafts[0]}], num_speculative_tokens=64),
         r"num_speculative_tokens: Input should be less than or equal to 16"),
        (lambda f: smurfs([{"method": "eagle"}]), r"drafters\[0\]: unknown drafter method"),
        (lambda f: smurfs([{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}]),
         r"prompt_lookup_min \(5\) must be <= prompt_lookup_max \(2\)"),
        (lambda f: smurfs([{"model": f.drafts[0], "placement": "gpu"}]),
         r"drafters\[0\]\.placement: Input should be 'worker', 'process' or 'ray' \(got 'gpu'\)"),
        (lambda f: smurfs([{"model": f.drafts[0], "cpus": [1], "num_threads": 1}]),
         r"drafters\[0\]: .*num_threads, cpus set an engine of the drafter's own, which only "
         r"placement 'process' \(or 'ray'\) has"),
    ],
)
def test_config_error_messages(family, make_spec, expected):
    with pytest.raises(ValueError, match=expected):
        engine_config(family.target, make_spec(family))


def test_async_scheduling_is_refused_naming_the_setting(family):
    with pytest.raises(ValueError, match=r"async_scheduling \(--async-scheduling\): "
                                         r"speculative_config method 'smurfs' needs"):
        EngineArgs(model=family.target, dtype="float32", max_model_len=256,
                   async_scheduling=True,
                   speculative_config=smurfs([{"model": family.drafts[0]}])
                   ).create_engine_config()


def test_the_target_gets_every_core_unless_a_placement_is_set(family, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    engine_config(family.target, smurfs([{"model": family.drafts[0]}]))
    assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"  # vLLM's auto binding: all cores
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")  # the user's choice stands
    engine_config(family.target, smurfs([{"model": family.drafts[0]}]))
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ


def test_drafter_with_other_vocabulary_is_refused(family, tmp_path):
    other = tmp_path / "other-vocab"
    other.mkdir()
    config = json.loads((__import__("pathlib").Path(family.target) / "config.json").read_text())
    config["vocab_size"] = 1234
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as info:
        engine_config(family.target, smurfs([{"model": str(other)}]))
    message = str(info.value)
    assert str(other) in message and family.target in message
    assert "1234" in message and "600" in message


def test_drafter_vllm_cannot_run_in_the_worker_is_refused(family, tmp_path):
    other = tmp_path / "unknown-arch"
    other.mkdir()
    config = json.loads((__import__("pathlib").Path(family.target) / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"drafters\[0\]\.model: .* has architecture "
                                         r"\['NoSuchModelForCausalLM'\], which vLLM cannot run"):
        engine_config(family.target, smurfs([{"model": str(other)}]))


def test_cli_value_is_a_path_or_inline_json(tmp_path):
    spec = smurfs([{"model": "/m"}])
    path = tmp_path / "smurfs.json"
    path.write_text(json.dumps(spec))
    assert parse_speculative_config(str(path)) == spec
    assert parse_speculative_config(json.dumps(spec)) == spec
    with pytest.raises(Exception, match="expected inline JSON or the path of a JSON file"):
        parse_speculative_config(str(tmp_path / "missing.json"))


# -- the same mistakes through the other entry points -----------------------------------------
def _session_processes(sid: int) -> list[int]:
    """Processes still in session ``sid`` (a command started in a session of its own)."""
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # fields after the name: state, ppid, pgrp, session
            left.append(int(pid))
    return left


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("malformed-file", r"--speculative-config: expected inline JSON or the path of a JSON "
                           r"file; could not parse file '.*bad\.json'"),
        ("inline-unknown-key", r"speculative_config\.drafter: unknown key"),
        ("file-missing-model", r"drafters\[0\]\.model: path '/no/such/model' does not exist"),
        ("file-wrong-type", r"num_speculative_tokens: Input should be a valid integer"),
        ("file-too-many-tokens", r"num_speculative_tokens: Input should be less than or equal"),
    ],
)
def test_vllm_serve_refuses_a_bad_config_naming_the_key_and_leaves_nothing(family, tmp_path,
                                                                           value, expected):
    import re
    import subprocess

    from serving import vllm_command

    configs = {
        "inline-unknown-key": json.dumps(smurfs([{"model": family.drafts[0]}], drafter="x")),
        "file-missing-model": smurfs([{"model": "/no/such/model"}]),
        "file-wrong-type": smurfs([{"model": family.drafts[0]}], num_speculative_tokens="four"),
        "file-too-many-tokens": smurfs([{"model": family.drafts[0]}],
                                       num_speculative_tokens=1000),
    }
    path = tmp_path / "bad.json"
    if value == "malformed-file":
        path.write_text('{"method": "smurfs", "drafters": [')
        argument = str(path)
    elif value.startswith("inline"):
        argument = configs[value]
    else:
        path.write_text(json.dumps(configs[value]))
        argument = str(path)
    proc = subprocess.Popen(
        vllm_command() + ["serve", family.target, "--speculative-config", argument,
                          "--dtype", "float32", "--max-model-len", "256",
                          "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, output[-3000:]
    assert re.search(expected, output), output[-3000:]
    assert _session_processes(proc.pid) == []


def test_llm_refuses_bad_configs_naming_the_key(family):
    from vllm import LLM

    for spec, expected in [
        (smurfs([{"model": family.drafts[0]}], drafter="x"),
         r"speculative_config\.drafter: unknown key"),
        (smurfs([{"model": family.drafts[0]}], num_speculative_tokens=1000),
         r"num_speculative_tokens: Input should be less than or equal to 16"),
        (smurfs([{"model": family.drafts[0], "placement": 3}]),
         r"drafters\[0\]\.placement: Input should be 'worker', 'process' or 'ray'"),
    ]:
        with pytest.raises(ValueError, match=expected):
            LLM(model=family.target, dtype="float32", max_model_len=256,
                speculative_config=spec)
