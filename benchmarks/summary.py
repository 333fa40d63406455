"""From a run's raw records to its summary: per load, per method, per family (pure, tested).

Load points: `batch1`, `batched` (offline) and one `served@c<N>` per --concurrency value N
(one server per method, one `vllm bench serve` per N). Speedups are over the run's baseline
(`settings.baseline`, no speculation by default) at the same load point -- served@c4 over the
baseline's served@c4; identity is against the `none` run with the same thread placement when the
run has one (bf16 output changes with the thread count even without speculation), else the
baseline, also at the same load point.

A load point whose status is not `ok` (partial: some prompts failed or were not reached; error;
not run), or whose baseline's is not, gets no speedup: its figures cover other prompts than the
baseline's, or none. Each divergence gets a verdict once the target's logits at it are known
(`attach_margins`): a near-tie when the two tokens' logits are within `near_tie_logit_gap` of each
other (what a different computation shape can flip in the run's dtype), else not a near-tie (a
method that is not lossless would show there), unchecked while margins are not computed.
"""

from __future__ import annotations

from typing import Any

from benchmarks.analysis import (
    OVERALL,
    SpecCounters,
    identity,
    pipeline_figures,
    ratio,
    summarize_batch1,
    summarize_served,
    tokens_per_s,
)

OFFLINE_LOADS = ("batch1", "batched")
#: Logit gap below which a divergence counts as a near-tie, by the run's dtype: bf16 keeps 8
#: significant bits, so logits of 10-30 move by 0.05-0.1 with one rounding and by a few tenths
#: when a different computation shape (batch, threads, a verification step of k+1 tokens) rounds
#: every layer differently; float32 runs must be identical, so any real gap there is flagged.
NEAR_TIE_LOGIT_GAP = {"bfloat16": 0.5, "float16": 0.5, "float32": 0.01}
VERDICTS = ("near_ties", "not_near_ties", "unchecked")
#: The load kinds --loads names; `served` expands to one load point per concurrency.
LOADS = (*OFFLINE_LOADS, "served")
SERVED_PREFIX = "served@c"


def served_load(concurrency: int) -> str:
    """The load point of served runs at `concurrency` requests in flight: served@c<N>."""
    return f"{SERVED_PREFIX}{concurrency}"


def is_served(load: str) -> bool:
    return load == "served" or load.startswith(SERVED_PREFIX)


def served_concurrency(load: str) -> int | None:
    """N of served@c<N>; None for any other load point."""
    if load.startswith(SERVED_PREFIX) and load[len(SERVED_PREFIX):].isdigit():
        return int(load[len(SERVED_PREFIX):])
    return None


def concurrencies(settings: dict[str, Any]) -> list[int]:
    """The run's --concurrency values, in order (schema 1 saved a single int)."""
    value = settings.get("concurrency", 16)
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def load_points(settings: dict[str, Any]) -> list[str]:
    """The run's load points in report order: batch1, batched, then served@c<N> per --concurrency
    value in the order given."""
    loads = settings["loads"]
    points = [load for load in OFFLINE_LOADS if load in loads]
    if "served" in loads:
        points += [served_load(c) for c in concurrencies(settings)]
    return points


def summary_loads(summary: dict[str, Any]) -> list[str]:
    """The load points a summary has, in its order."""
    return [key for key in summary if key in OFFLINE_LOADS or is_served(key)]


def load_records(method: dict[str, Any] | None, load: str) -> Any:
    """The per-prompt records of a method at a load point, or None when it has none."""
    if method is None:
        return None
    entry = method.get("loads", {}).get(load)
    if not entry:
        return None
    if load == "batch1":
        records = {int(k): v for k, v in entry.get("per_prompt", {}).items()}
    elif load == "batched":
        records = {int(k): v for k, v in entry.get("outputs", {}).items()}
    else:
        records = {int(k): v for k, v in entry.get("requests", {}).items()}
    return records or None


def identity_reference(method: dict[str, Any], methods: dict[str, dict[str, Any]],
                       baseline: str, load: str) -> str | None:
    same_placement = f"none@{method['placement']}"
    for label in (same_placement, baseline):
        if label != method["label"] and load_records(methods.get(label), load) is not None:
            return label
    return None


def _outputs(records: dict[int, dict[str, Any]], load: str) -> dict[int, Any]:
    if is_served(load):
        return {i: r["text"] for i, r in records.items() if not r.get("error")}
    return {i: r["output_token_ids"] for i, r in records.items()}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    families = {p["index"]: p["family"] for p in result["prompts"]}
    baseline = result["settings"]["baseline"]
    methods = {m["label"]: m for m in result["methods"]}
    summary: dict[str, Any] = {"baseline": baseline}
    for load in load_points(result["settings"]):
        base_records = load_records(methods.get(baseline), load)
        per_method: dict[str, Any] = {}
        for label, method in methods.items():
            entry = method.get("loads", {}).get(load, {})
            records = load_records(method, load)
            row: dict[str, Any] = {"status": entry.get("status", "not run"),
                                   "error": entry.get("error") or method.get("error")}
            if records is not None:
                if load == "batch1":
                    row["families"] = summarize_batch1(records, families, base_records)
                    pipeline = pipeline_figures(records.values())
                    if pipeline is not None:
                        row["pipeline"] = pipeline
                elif load == "batched":
                    row.update(_summarize_batched(entry, methods.get(baseline, {}), load))
                else:
                    row.update(_summarize_served_totals(entry, methods.get(baseline, {}), load))
                    row["families"] = summarize_served(records, families, base_records)
                reference = identity_reference(method, methods, baseline, load)
                if reference is not None:
                    ref_records = load_records(methods[reference], load)
                    row["identity"] = {"reference": reference,
                                       **identity(_outputs(ref_records, load),
                                                  _outputs(records, load))}
                    if not is_served(load):
                        _divergent_tokens(row["identity"], ref_records, records)
                withheld = _speedup_withheld(entry, methods.get(baseline), baseline, load)
                if withheld:
                    _withhold_speedups(row, withheld)
            per_method[label] = row
        summary[load] = per_method
    summary["near_tie_logit_gap"] = near_tie_logit_gap(result["settings"].get("dtype"))
    classify_divergences(summary)
    return summary


def near_tie_logit_gap(dtype: str | None) -> float:
    """The near-tie bound for a run's dtype (bf16's for auto or an unknown one)."""
    return NEAR_TIE_LOGIT_GAP.get(str(dtype).removeprefix("torch."), NEAR_TIE_LOGIT_GAP["bfloat16"])


def _speedup_withheld(entry: dict[str, Any], baseline: dict[str, Any] | None, label: str,
                      load: str) -> str | None:
    """Why a row gets no speedup (its status or its baseline's is not ok), or None."""
    status = entry.get("status", "not run")
    if status != "ok":
        return f"status {status}"
    base_status = ((baseline or {}).get("loads", {}).get(load) or {}).get("status", "not run")
    if base_status != "ok":
        return f"baseline {label} status {base_status}"
    return None


def _withhold_speedups(row: dict[str, Any], reason: str) -> None:
    for part in [row.get(OVERALL), row.get("totals"), *(row.get("families") or {}).values()]:
        if isinstance(part, dict) and "speedup" in part:
            part["speedup"] = None
    row["speedup_withheld"] = reason


def _divergent_tokens(ident: dict[str, Any], reference: dict[int, dict[str, Any]],
                      mine: dict[int, dict[str, Any]]) -> None:
    """Both outputs' tokens at each divergent position (None past an output's end)."""
    for d in ident["divergences"]:
        i, pos = d["prompt_index"], d["position"]
        ref_ids, my_ids = reference[i]["output_token_ids"], mine[i]["output_token_ids"]
        d["reference_token"] = ref_ids[pos] if pos < len(ref_ids) else None
        d["token"] = my_ids[pos] if pos < len(my_ids) else None


def _rows(summary: dict[str, Any]):
    for load in summary_loads(summary):
        for label, row in summary[load].items():
            yield load, label, row


def classify_divergences(summary: dict[str, Any]) -> None:
    """Each divergence's verdict (near-tie, not a near-tie, unchecked: no logits known), from
    the gap between the reference's token's logit and the method's token's at the divergent
    position (the top-2 margin when one of the two logits is unknown), and the counts per row
    in its identity (keys `VERDICTS`)."""
    gap_bound = summary.get("near_tie_logit_gap", NEAR_TIE_LOGIT_GAP["bfloat16"])
    for _, _, row in _rows(summary):
        ident = row.get("identity")
        if not ident:
            continue
        counts = dict.fromkeys(VERDICTS, 0)
        for d in ident["divergences"]:
            gap = d.get("reference_minus_token_logit")
            gap = abs(gap) if gap is not None else d.get("top2_margin")
            d["verdict"] = ("unchecked" if gap is None
                            else "near-tie" if gap < gap_bound else "not a near-tie")
            counts[{"unchecked": "unchecked", "near-tie": "near_ties"}.get(
                d["verdict"], "not_near_ties")] += 1
        ident.update(counts)


def _summarize_batched(entry: dict[str, Any], baseline: dict[str, Any], load: str
                       ) -> dict[str, Any]:
    tokens = sum(o["num_output_tokens"] for o in entry["outputs"].values())
    counters = SpecCounters.of(entry)
    mine = tokens_per_s(tokens, entry["elapsed_s"])
    base_entry = baseline.get("loads", {}).get(load) or {}
    theirs = None
    if base_entry.get("outputs") and set(base_entry["outputs"]) == set(entry["outputs"]):
        theirs = tokens_per_s(sum(o["num_output_tokens"] for o in base_entry["outputs"].values()),
                              base_entry["elapsed_s"])
    return {OVERALL: {"output_tokens": tokens, "elapsed_s": entry["elapsed_s"],
                      "tokens_per_s": mine, "speedup": ratio(mine, theirs),
                      "mean_acceptance_length": counters.mean_acceptance_length,
                      "acceptance_rate": counters.acceptance_rate,
                      "acceptance_per_position": counters.acceptance_per_position,
                      "num_drafts": counters.num_drafts}}


def _summarize_served_totals(entry: dict[str, Any], baseline: dict[str, Any], load: str
                             ) -> dict[str, Any]:
    """Whole-run figures of one `vllm bench serve` run; speedup over the baseline's run at the
    same load point. Its acceptance counters are that run's own: the harness scrapes the server's
    /metrics before and after its requests and reports the differences, so the earlier load points
    on the same server do not count."""
    totals = entry.get("totals", {})
    base_entry = baseline.get("loads", {}).get(load) or {}
    base_totals = base_entry.get("totals", {})
    same_prompts = base_entry.get("requests", {}).keys() == entry.get("requests", {}).keys()
    throughput = totals.get("output_throughput")
    counters = SpecCounters(int(totals.get("spec_decode_num_drafts", 0)),
                            int(totals.get("spec_decode_draft_tokens", 0)),
                            int(totals.get("spec_decode_accepted_tokens", 0)))
    per_pos = totals.get("spec_decode_per_position_acceptance_rates") or []
    return {"totals": {
        "output_throughput": throughput, "duration_s": totals.get("duration"),
        "completed": totals.get("completed"), "failed": totals.get("failed"),
        "speedup": (ratio(throughput, base_totals.get("output_throughput")) if same_prompts
                    else None),
        "mean_acceptance_length": counters.mean_acceptance_length,
        "acceptance_rate": counters.acceptance_rate,
        # vLLM's report gives these as fractions of drafts already.
        "acceptance_per_position": [float(x) for x in per_pos],
        "num_drafts": counters.num_drafts}}


def divergence_queries(result: dict[str, Any], summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One margin query per distinct (reference, load, prompt, position) among the divergences,
    with the key written into each divergence entry of `summary`.

    Offline loads have token ids: the query is the reference's output before the divergent
    position. Served loads have texts only: the query carries both texts, and `margins`
    tokenizes them with the target's tokenizer to find the first divergent token (an
    approximation: re-tokenized text may be split otherwise than the server generated it)."""
    methods = {m["label"]: m for m in result["methods"]}
    prompts = {p["index"]: p for p in result["prompts"]}
    queries: dict[str, dict[str, Any]] = {}
    for load, label, row in _rows(summary):
        ident = row.get("identity")
        if not ident:
            continue
        reference = load_records(methods[ident["reference"]], load)
        mine = load_records(methods[label], load)
        for d in ident["divergences"]:
            i, pos = d["prompt_index"], d["position"]
            key = f"{ident['reference']}|{load}|{i}|{pos}"
            d["margin_key"] = key
            if is_served(load):
                queries.setdefault(key, {"key": key,
                                         "prompt_token_ids": prompts[i]["prompt_token_ids"],
                                         "reference_text": reference[i]["text"],
                                         "text": mine[i]["text"]})
                continue
            ref_ids = reference[i]["output_token_ids"]
            _divergent_tokens({"divergences": [d]}, reference, mine)
            query = queries.setdefault(key, {"key": key,
                                             "prompt_token_ids": prompts[i]["prompt_token_ids"],
                                             "prefix_token_ids": ref_ids[:pos], "tokens": []})
            for token in (d["reference_token"], d["token"]):
                if token is not None and token not in query["tokens"]:
                    query["tokens"].append(token)
    return list(queries.values())


def attach_margins(summary: dict[str, Any], margins: dict[str, Any]) -> None:
    """Write the target's top-2 margin (and the two tokens' logit gap) into each divergence, and
    its verdict (`classify_divergences`). Served divergences also get the tokens `margins` found
    by re-tokenizing the texts, and their position in tokens."""
    for load, _, row in _rows(summary):
        for d in (row.get("identity") or {}).get("divergences", []):
            found = margins.get(d.get("margin_key", ""))
            if found is None:
                continue
            if is_served(load):
                d["reference_token"], d["token"] = found.get("reference_token"), found.get("token")
                d["token_position"] = found.get("token_position")
            d["top2_margin"] = found["margin"]
            logits = found["logits"]
            a, b = str(d.get("reference_token")), str(d.get("token"))
            d["reference_minus_token_logit"] = (logits[a] - logits[b]
                                                if a in logits and b in logits else None)
    classify_divergences(summary)
