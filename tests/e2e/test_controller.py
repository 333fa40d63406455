"""The one controller in the real engine (float32, tiny models): lossless when its cost curve is
poisoned by a slow first forward and when prompt chunks share its steps, and still drafting with
the model drafter in both cases (not while a chunked prompt is pending)."""

from __future__ import annotations

import json

import pytest

from smurfs_tools.jobs import Job, divergences, run_job
from smurfs_tools.tiny_models import TINY_PROMPTS
from conftest import default_config

pytestmark = pytest.mark.e2e

MAX_TOKENS = [48, 96, 32, 96, 16, 64, 96, 40]
#: A prompt of about 240 tokens: with 32-token chunks its prefill spans about eight steps.
LONG_PROMPT = " ".join([TINY_PROMPTS[6]] * 8)


def one_drafter(family, **extra) -> dict:
    """The default configuration with one model drafter and the n-gram voter."""
    config = default_config(family, **extra)
    config["drafters"] = config["drafters"][-2:]
    return config


def test_a_poisoned_first_forward_neither_costs_a_token_nor_shuts_the_drafter_out(family,
                                                                                   tmp_path):
    # The drafter's first forward after start-up takes 3 s longer (as a first call that builds
    # kernels may): the curve drops it, and the model drafter goes on drafting.
    trace = tmp_path / "trace.jsonl"
    common = dict(target=family.target, prompts=list(TINY_PROMPTS), max_tokens=MAX_TOKENS)
    reference = run_job(Job(**common))
    name = "draft-2"
    smurfs = run_job(Job(**common, speculative_config=one_drafter(family,
                                                                  trace_file=str(trace)),
                         env={"SMURFS_DRAFTER_FAULT": f"{name}=stall_first:3"}))
    assert divergences(reference.token_ids, smurfs.token_ids) == {}
    stats = smurfs.smurfs_stats
    controller = stats["controller"]
    passes = [p for line in trace.read_text().splitlines()
              for p in json.loads(line).get("passes", [])]
    assert max(s for _, _, s in passes) >= 3.0, "the stall was not injected"
    # Not one knot of the drafter's curve is near the stall, and it kept drafting after it.
    knots = controller["drafters"][0]["pass_cost"]["knots"]
    assert knots and max(y for _, y in knots) < 1.0, knots
    after = passes[[s for _, _, s in passes].index(max(s for _, _, s in passes)) + 1:]
    assert len(after) >= 20, f"the model drafter stopped drafting after the stall: {controller}"


def test_prompt_chunks_sharing_steps_neither_cost_a_token_nor_shut_the_drafter_out(family,
                                                                                   tmp_path):
    # Long prompts arrive while others decode, their prefill chunked over many steps: the
    # controller sees each step's prompt tokens exactly; while a prompt is pending (a chunk
    # still to come) it drafts nothing, and the model drafter drafts again after the chunks.
    trace = tmp_path / "trace.jsonl"
    prompts = list(TINY_PROMPTS) + [LONG_PROMPT, LONG_PROMPT + " again"]
    max_tokens = MAX_TOKENS + [24, 24]
    common = dict(target=family.target, prompts=prompts, max_tokens=max_tokens,
                  arrive_at={8: 10, 9: 25}, max_model_len=512,
                  engine_args={"max_num_batched_tokens": 32, "enable_chunked_prefill": True})
    reference = run_job(Job(**common))
    smurfs = run_job(Job(**common, speculative_config=one_drafter(family,
                                                                  trace_file=str(trace))))
    assert divergences(reference.token_ids, smurfs.token_ids) == {}
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    prompt_steps = [i for i, s in enumerate(steps) if s.get("prompt_tokens", 0) > 0]
    assert len(prompt_steps) >= 8, "the prompts were meant to be chunked over many steps"
    # Each line holds the plan its step verified and the drafter forwards made for it.
    pending = [i for i, s in enumerate(steps) if s.get("plan", {}).get("prompt_pending")]
    assert len(pending) >= 5, "the chunked prompts were not seen as pending"
    assert all(not steps[i].get("passes") and not any(steps[i]["plan"]["lookaheads"])
               for i in pending), [steps[i] for i in pending]
    assert smurfs.smurfs_stats["controller"]["prompt_pending_steps"] >= len(pending)
    drafted = [i for i, s in enumerate(steps) if s.get("passes")]
    assert any(i > max(prompt_steps) for i in drafted), "no model draft after the prompt chunks"


def test_the_one_controller_drives_a_process_drafter_losslessly(family):
    # The same controller with a pipelined process drafter (streaming, switched on and off by
    # what it brings) beside the n-gram voter, at the default settings.
    config = one_drafter(family)
    config["drafters"][0]["placement"] = "process"
    common = dict(target=family.target, prompts=list(TINY_PROMPTS), max_tokens=MAX_TOKENS)
    reference = run_job(Job(**common))
    smurfs = run_job(Job(**common, speculative_config=config))
    assert divergences(reference.token_ids, smurfs.token_ids) == {}
    stats = smurfs.smurfs_stats
    controller = stats["controller"]
    # One controller, pricing the drafter as a streaming one: it drafted while on (the switch
    # starts on), and on tiny models, where a drafter's engine step costs more than the
    # target's, it was switched off (its drafts came too late to pay).
    model = stats["drafters"][0]
    assert model["engine_steps"] > 0, stats
    assert controller["streaming"]["switches"] >= 1, controller["streaming"]
