"""What the benchmark tool says about losslessness and about failed load points, on synthetic
result files: never "identical" when nothing was compared, every divergence judged against the
target's logits (near-tie or not), no speedup from a load point that is not ok, and repeats
that count such a pass as missing and show its status."""

from __future__ import annotations

import json

import pytest

from benchmarks.analysis import OVERALL
from benchmarks.margins import add_to_run, main as margins_main, text_query
from benchmarks.report import fmt_identity, render_markdown
from benchmarks.repeats import aggregate, render
from benchmarks.summary import attach_margins, divergence_queries, summarize

from test_benchmarks import _pass, synthetic_result


def summarized(result: dict) -> dict:
    result = json.loads(json.dumps(result))  # keys as a saved file has them
    result["summary"] = summarize(result)
    return result


def test_a_partial_or_failed_load_point_gets_no_speedup():
    result = synthetic_result()
    smurfs = result["methods"][2]["loads"]
    smurfs["batch1"]["status"], smurfs["batch1"]["error"] = "partial", "1 of 2 prompts"
    smurfs["served@c16"]["status"] = "partial"
    summary = summarize(result)
    batch1, served = summary["batch1"]["smurfs:4@1thread"], summary["served@c16"]["smurfs:4@1thread"]
    assert batch1["families"][OVERALL]["speedup"] is None
    assert all(f["speedup"] is None for f in batch1["families"].values())
    assert batch1["families"][OVERALL]["tokens_per_s"] == pytest.approx(6.0)  # still shown
    assert batch1["speedup_withheld"] == "status partial"
    assert served["totals"]["speedup"] is None and served["speedup_withheld"] == "status partial"
    # A baseline that is not ok: nobody's speedup at that load point.
    result = synthetic_result()
    result["methods"][0]["loads"]["batch1"]["status"] = "partial"
    summary = summarize(result)
    assert summary["batch1"]["none@1thread"]["families"][OVERALL]["speedup"] is None
    assert (summary["batch1"]["smurfs:4@1thread"]["speedup_withheld"]
            == "baseline none@2threads status partial")
    assert summary["served@c16"]["smurfs:4@1thread"]["totals"]["speedup"] == pytest.approx(2.5)


def test_repeats_count_a_pass_that_is_not_ok_as_missing_and_show_its_status():
    bad = _pass(18.0)
    # An old summary: the speedup of a partial load point was kept. Repeats must not use it.
    row = bad["summary"]["served@c4"]["smurfs:4@1thread"]
    row["status"] = "partial"
    assert row["totals"]["speedup"] == pytest.approx(0.9)
    agg = aggregate([_pass(30.0), bad, _pass(24.0)])
    c4 = agg["loads"]["served@c4"]["smurfs:4@1thread"]
    assert c4["speedups"] == pytest.approx([1.5, 1.2]) and c4["missing"] == 1
    assert c4["statuses"] == ["ok", "partial", "ok"]
    assert c4["per_pass"] == pytest.approx([1.5, None, 1.2])
    assert "| smurfs:4@1thread | ok partial ok | 1.50x - 1.20x | 1.342x |" in render(agg)


def test_the_report_never_calls_outputs_identical_when_none_was_compared():
    result = synthetic_result()
    # No `none` run: every method's reference would be the baseline, here smurfs itself.
    result["methods"] = [m for m in result["methods"] if m["name"] != "none"]
    result["settings"]["baseline"] = "smurfs:4@1thread"
    text = render_markdown(summarized(result))
    assert "identical to its reference" not in text
    assert "No output was compared with a reference: identity is unknown" in text
    assert "| smurfs:4@1thread | ok |" in text and "| - |" in text


def test_the_report_counts_what_it_compared_and_names_what_it_did_not():
    result = synthetic_result()
    smurfs = result["methods"][2]["loads"]
    smurfs["batch1"]["per_prompt"]["1"]["output_token_ids"] = [4, 5, 6]  # now identical
    smurfs["served@c16"]["requests"]["1"]["text"] = "y"
    text = render_markdown(summarized(result))
    # smurfs: 2 batch1 + 2 served; none@1thread: 2 batch1 (against none@2threads)
    assert "Every compared output is identical to its reference: 6 outputs of 3 method/load rows" \
        in text
    # suffix failed at batch 1 and none@1thread has no served run: nothing compared there, and
    # the report says so rather than counting them as identical.
    assert "Not compared (no reference output at their load point): suffix:4@2threads at batch1" \
        in text


def test_divergences_are_judged_near_ties_or_not_from_the_targets_logits():
    result = summarized(synthetic_result())
    row = result["summary"]["batch1"]["smurfs:4@1thread"]
    assert row["identity"]["unchecked"] == 1 and fmt_identity(row["identity"]) == \
        "1/2 (1 unchecked)"
    text = render_markdown(result)
    assert "margins: not computed (--no-margins)" in text and "5 -> 9" in text  # tokens shown
    divergence_queries(result, result["summary"])
    attach_margins(result["summary"], {"none@1thread|batch1|1|1": {
        "margin": 2.0, "logits": {"5": 3.0, "9": 1.0}}})
    result["margins"] = {"status": "ok"}
    assert row["identity"]["divergences"][0]["verdict"] == "not a near-tie"
    assert fmt_identity(row["identity"]) == "1/2 (1 NOT a near-tie)"
    text = render_markdown(result)
    assert "NOT near-ties: 1;" in text and "not explained by rounding: check it" in text
    assert "| not a near-tie |" in text
    # float32 runs must be identical: a gap of 0.25 is no near-tie there, and it is in bf16.
    for dtype, verdict in (("float32", "not a near-tie"), ("bfloat16", "near-tie")):
        again = synthetic_result()
        again["settings"]["dtype"] = dtype
        again = summarized(again)
        divergence_queries(again, again["summary"])
        attach_margins(again["summary"], {"none@1thread|batch1|1|1": {
            "margin": 0.25, "logits": {"5": 3.0, "9": 2.75}}})
        d = again["summary"]["batch1"]["smurfs:4@1thread"]["identity"]["divergences"][0]
        assert d["verdict"] == verdict, dtype


def test_a_served_divergence_is_found_in_tokens_by_tokenizing_both_texts():
    def encode(text: str) -> list[int]:  # a character-level tokenizer
        return [ord(c) for c in text]

    query = {"key": "k", "prompt_token_ids": [1, 2], "reference_text": "abcd", "text": "abxd"}
    assert text_query(query, encode, eos_token_id=0) == {
        "key": "k", "prompt_token_ids": [1, 2], "prefix_token_ids": [97, 98],
        "tokens": [99, 120],
        "served": {"token_position": 2, "reference_token": 99, "token": 120}}
    ended = text_query({**query, "text": "ab"}, encode, eos_token_id=0)
    assert ended["served"] == {"token_position": 2, "reference_token": 99, "token": 0}
    assert text_query({**query, "text": "abcd"}, encode, eos_token_id=0) is None


def test_margins_can_be_added_to_a_run_already_made(tmp_path, monkeypatch):
    from benchmarks import margins

    run = tmp_path / "pass-1"
    run.mkdir()
    (run / "result.json").write_text(json.dumps(summarized(synthetic_result())))
    seen = {}

    def fake_compute(request):
        seen.update(request)
        return {q["key"]: {"margin": 0.1, "logits": {"5": 3.0, "9": 2.9}}
                for q in request["queries"] if "prefix_token_ids" in q}

    monkeypatch.setattr(margins, "compute", fake_compute)
    margins_main(["--add", str(run), "--target", "/moved/target"])
    assert seen["target"] == "/moved/target" and seen["dtype"] == "bfloat16"
    saved = json.loads((run / "result.json").read_text())
    assert saved["margins"]["status"] == "ok" and saved["margins"]["added_after_the_run"]
    d = saved["summary"]["batch1"]["smurfs:4@1thread"]["identity"]["divergences"][0]
    assert d["verdict"] == "near-tie" and d["top2_margin"] == 0.1
    summary_md = (run / "summary.md").read_text()
    assert "Near-ties (the two tokens' logits within 0.50): 1;" in summary_md
    assert "unchecked: 1 (margins: ok)" in summary_md  # the served one: no margin here
    assert add_to_run(str(run / "result.json"))["margins"]["num_queries"] == 2


def test_margins_of_a_served_divergence_on_a_real_tokenizer_and_model(tmp_path):
    """`margins.compute` on the tiny test target (Hugging Face, float32; a few seconds)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.margins import compute
    from smurfs_tools.jobs import first_divergence
    from smurfs_tools.tiny_models import build_tiny_family

    target = build_tiny_family(tmp_path, num_drafts=1).target
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompt = tokenizer.encode("the river runs to the", add_special_tokens=False)
    reference, text = "the sea and the hills", "the sea and the river"
    ref_ids = tokenizer.encode(reference, add_special_tokens=False)
    my_ids = tokenizer.encode(text, add_special_tokens=False)
    pos = first_divergence(ref_ids, my_ids)
    out = compute({"target": target, "dtype": "float32", "queries": [
        {"key": "served", "prompt_token_ids": prompt, "reference_text": reference,
         "text": text},
        {"key": "same", "prompt_token_ids": prompt, "reference_text": text, "text": text}]})
    assert set(out) == {"served"}  # identical texts: nothing to measure
    found = out["served"]
    assert (found["token_position"], found["reference_token"], found["token"]) == (
        pos, ref_ids[pos], my_ids[pos])
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + ref_ids[:pos]])).logits[0, -1]
    top = torch.topk(logits, 2).values
    assert found["margin"] == pytest.approx(float(top[0] - top[1]), abs=1e-4)
    assert found["logits"][str(my_ids[pos])] == pytest.approx(float(logits[my_ids[pos]]),
                                                               abs=1e-4)
