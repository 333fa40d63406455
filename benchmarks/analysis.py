"""The benchmark's arithmetic, pure (no vLLM, no torch): unit-tested in tests/unit.

Definitions (vLLM's, so figures match `vllm bench serve` and `llm.get_metrics()`):
- output tokens/s: output tokens / generation seconds, summed over prompts before dividing
  (a long prompt weighs by its length, not one vote per prompt);
- speedup: a method's tokens/s over the baseline's on the same prompts of the same run (prompts
  missing from either side are left out of both);
- decode speedup: the same over decoding alone, output tokens after the first / seconds from the
  first token to the last (the engine's own timestamps, `RequestOutput.metrics`), so that a
  prompt's prefill does not weigh on it by how many tokens its sampled output happened to have;
- mean acceptance length: 1 + accepted draft tokens / drafts (tokens produced per verified
  draft; a step where a method proposed nothing is not a draft);
- acceptance at position i: drafts whose token i was accepted / drafts;
- percentiles: linear interpolation between order statistics (numpy's default);
- identity: two greedy outputs are identical when their token ids are equal *and* their lengths
  are (Spec-Bench's zip-based check lets a truncated output pass).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from smurfs_tools.jobs import first_divergence

OVERALL = "overall"


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters over some requests."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __add__(self, other: SpecCounters) -> SpecCounters:
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        a = self.accepted_per_position + [0] * (width - len(self.accepted_per_position))
        b = other.accepted_per_position + [0] * (width - len(other.accepted_per_position))
        return SpecCounters(self.num_drafts + other.num_drafts,
                            self.num_draft_tokens + other.num_draft_tokens,
                            self.num_accepted_tokens + other.num_accepted_tokens,
                            [x + y for x, y in zip(a, b)])

    @classmethod
    def of(cls, record: dict[str, Any]) -> SpecCounters:
        return cls(int(record.get("num_drafts", 0)), int(record.get("num_draft_tokens", 0)),
                   int(record.get("num_accepted_tokens", 0)),
                   [int(v) for v in record.get("accepted_per_position", [])])

    @property
    def mean_acceptance_length(self) -> float | None:
        return acceptance_length(self.num_drafts, self.num_accepted_tokens)

    @property
    def acceptance_per_position(self) -> list[float]:
        return acceptance_per_position(self.accepted_per_position, self.num_drafts)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft tokens / draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


def acceptance_length(num_drafts: int, num_accepted_tokens: int) -> float | None:
    """1 + accepted / drafts; None without drafts (no speculation, or nothing proposed)."""
    if num_drafts < 0 or num_accepted_tokens < 0:
        raise ValueError(f"negative counters: {num_drafts} drafts, {num_accepted_tokens} accepted")
    return 1 + num_accepted_tokens / num_drafts if num_drafts else None


def acceptance_per_position(accepted_per_position: Sequence[int], num_drafts: int) -> list[float]:
    """Fraction of drafts whose token at each position was accepted (non-increasing for a
    prefix-accepting verifier); empty without drafts."""
    if not num_drafts:
        return []
    return [a / num_drafts for a in accepted_per_position]


def sum_counters(records: Iterable[dict[str, Any]]) -> SpecCounters:
    total = SpecCounters()
    for record in records:
        total = total + SpecCounters.of(record)
    return total


def tokens_per_s(num_tokens: int, seconds: float) -> float | None:
    return num_tokens / seconds if seconds > 0 else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def percentile(values: Sequence[float], p: float) -> float | None:
    """p-th percentile (0-100), linear interpolation (numpy's default); None for no values."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} is outside 0-100")
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def percentiles(values: Sequence[float], ps: Sequence[float] = (50, 90, 99)) -> dict[str, Any]:
    return {f"p{p:g}": percentile(values, p) for p in ps} | {
        "mean": statistics.fmean(values) if values else None, "n": len(values)}


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Mean, median, standard deviation (sample), min, max of per-prompt figures."""
    if not values:
        return {"n": 0, "mean": None, "median": None, "stdev": None, "min": None, "max": None}
    return {"n": len(values), "mean": statistics.fmean(values),
            "median": statistics.median(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def group_by_family(prompt_families: dict[int, str],
                    indices: Iterable[int]) -> dict[str, list[int]]:
    """{family: prompt indices} plus OVERALL, families in first-seen order."""
    groups: dict[str, list[int]] = {}
    all_indices = []
    for i in indices:
        groups.setdefault(prompt_families[i], []).append(i)
        all_indices.append(i)
    groups[OVERALL] = all_indices
    return groups


# ----------------------------------------------------------------------------------------------
# Offline, one prompt at a time


def summarize_batch1(records: dict[int, dict[str, Any]], prompt_families: dict[int, str],
                     baseline: dict[int, dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Per family and overall: tokens/s, speedup over `baseline`, acceptance, spread.

    records: {prompt index: {"num_output_tokens", "elapsed_s", counters...}}.
    """
    summary: dict[str, dict[str, Any]] = {}
    for family, indices in group_by_family(prompt_families, sorted(records)).items():
        rows = [records[i] for i in indices]
        tokens = sum(r["num_output_tokens"] for r in rows)
        seconds = sum(r["elapsed_s"] for r in rows)
        counters = sum_counters(rows)
        entry: dict[str, Any] = {
            "num_prompts": len(rows), "output_tokens": tokens, "elapsed_s": seconds,
            "tokens_per_s": tokens_per_s(tokens, seconds),
            "per_prompt_tokens_per_s": spread([r["num_output_tokens"] / r["elapsed_s"]
                                               for r in rows if r["elapsed_s"] > 0]),
            "mean_acceptance_length": counters.mean_acceptance_length,
            "acceptance_rate": counters.acceptance_rate,
            "acceptance_per_position": counters.acceptance_per_position,
            "num_drafts": counters.num_drafts,
            "decode_tokens_per_s": decode_tokens_per_s(rows),
            "speedup": None,
            "decode_speedup": None,
        }
        if baseline is not None:
            entry["speedup"] = speedup(records, baseline, indices)
            entry["decode_speedup"] = decode_speedup(records, baseline, indices)
        summary[family] = entry
    return summary


def _rate_ratio(records: dict[int, dict[str, Any]], baseline: dict[int, dict[str, Any]],
                indices: Iterable[int],
                rate: Callable[[Iterable[dict[str, Any]]], float | None],
                counts: Callable[[dict[str, Any]], bool] = lambda r: True) -> float | None:
    """``rate`` of `records` over ``rate`` of `baseline`, on the prompts both have and both
    ``counts``."""
    common = [i for i in indices if i in records and i in baseline
              and counts(records[i]) and counts(baseline[i])]
    if not common:
        return None
    return ratio(rate(records[i] for i in common), rate(baseline[i] for i in common))


def _call_tokens_per_s(rows: Iterable[dict[str, Any]]) -> float | None:
    rows = list(rows)
    return tokens_per_s(sum(r["num_output_tokens"] for r in rows),
                        sum(r["elapsed_s"] for r in rows))


def speedup(records: dict[int, dict[str, Any]], baseline: dict[int, dict[str, Any]],
            indices: Iterable[int]) -> float | None:
    """tokens/s of `records` over tokens/s of `baseline`, on the prompts both have."""
    return _rate_ratio(records, baseline, indices, _call_tokens_per_s)


def _decodes(record: dict[str, Any]) -> bool:
    return record.get("decode_s") is not None and record["num_output_tokens"] >= 2


def decode_tokens_per_s(rows: Iterable[dict[str, Any]]) -> float | None:
    """Output tokens after the first / seconds from the first token to the last, summed over the
    rows that have both (None: no row has a decode)."""
    rows = [r for r in rows if _decodes(r)]
    return tokens_per_s(sum(r["num_output_tokens"] - 1 for r in rows),
                        sum(r["decode_s"] for r in rows)) if rows else None


def decode_speedup(records: dict[int, dict[str, Any]], baseline: dict[int, dict[str, Any]],
                   indices: Iterable[int]) -> float | None:
    """decode tokens/s of `records` over the baseline's, on the prompts both decoded."""
    return _rate_ratio(records, baseline, indices, decode_tokens_per_s, _decodes)


# ----------------------------------------------------------------------------------------------
# Served (vllm bench serve), many requests in flight


def summarize_served(requests: dict[int, dict[str, Any]], prompt_families: dict[int, str],
                     baseline: dict[int, dict[str, Any]] | None,
                     ps: Sequence[float] = (50, 90, 99)) -> dict[str, dict[str, Any]]:
    """Per family and overall: per-request decode speed, TTFT / ITL / TPOT percentiles.

    requests: {prompt index: {"output_len", "ttft_s", "itls_s", "latency_s", "error"}}; failed
    requests (error set) are counted and left out. Whole-run throughput (tokens / wall time of
    the run) comes from vLLM's own report, not from here: it only exists overall.
    """
    ok = {i: r for i, r in requests.items() if not r.get("error")}
    summary: dict[str, dict[str, Any]] = {}
    for family, indices in group_by_family(prompt_families, sorted(requests)).items():
        rows = [ok[i] for i in indices if i in ok]
        tokens = sum(r["output_len"] for r in rows)
        busy = sum(r["latency_s"] for r in rows)
        itls = [x for r in rows for x in r["itls_s"]]
        tpots = [tpot(r) for r in rows]
        summary[family] = {
            "num_requests": len(indices), "failed": len(indices) - len(rows),
            "output_tokens": tokens,
            "per_request_tokens_per_s": tokens_per_s(tokens, busy),
            "ttft_ms": _scaled(percentiles([r["ttft_s"] for r in rows], ps), 1000),
            "itl_ms": _scaled(percentiles(itls, ps), 1000),
            "tpot_ms": _scaled(percentiles([t for t in tpots if t is not None], ps), 1000),
            "speedup": None,
        }
        if baseline is not None:
            base_ok = {i: r for i, r in baseline.items() if not r.get("error")}
            common = [i for i in indices if i in ok and i in base_ok]
            summary[family]["speedup"] = ratio(
                tokens_per_s(sum(ok[i]["output_len"] for i in common),
                             sum(ok[i]["latency_s"] for i in common)),
                tokens_per_s(sum(base_ok[i]["output_len"] for i in common),
                             sum(base_ok[i]["latency_s"] for i in common))) if common else None
    return summary


def tpot(request: dict[str, Any]) -> float | None:
    """Time per output token after the first: (latency - TTFT) / (output tokens - 1).

    Unlike ITL (time between streamed chunks), it does not depend on how many tokens a chunk
    carries, which speculation changes.
    """
    if request["output_len"] < 2:
        return None
    return (request["latency_s"] - request["ttft_s"]) / (request["output_len"] - 1)


def _scaled(stats: dict[str, Any], factor: float) -> dict[str, Any]:
    return {k: (v * factor if v is not None and k != "n" else v) for k, v in stats.items()}


# ----------------------------------------------------------------------------------------------
# Losslessness


def identity(reference: dict[int, Sequence[Any]], other: dict[int, Sequence[Any]]
             ) -> dict[str, Any]:
    """Compare outputs prompt by prompt (token id lists, or texts), on the prompts both have.

    Returns the number compared, identical, the identity rate, and per divergent prompt its
    first divergent position and both lengths.
    """
    common = sorted(set(reference) & set(other))
    found = []
    for i in common:
        position = first_divergence(list(reference[i]), list(other[i]))
        if position is not None:
            found.append({"prompt_index": i, "position": position,
                          "reference_length": len(reference[i]), "length": len(other[i])})
    identical = len(common) - len(found)
    return {"compared": len(common), "identical": identical,
            "identity_rate": identical / len(common) if common else None, "divergences": found}


def pipeline_figures(records: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """Smurfs' own pipeline figures over batch-1 records (their ``smurfs_stats``), or None.

    - ``no_draft_share``: of the (request, step) pairs given a lookahead > 0, the share no drafter
      had anything ready for (those steps decode one token normally);
    - ``drafter_busy_s``: seconds the model drafters spent in engine steps (summed over them);
    - ``wait_s``: seconds the target's worker waited for drafts (in ``propose``);
    - ``hidden_share``: 1 - wait_s / drafter_busy_s, the share of drafting time that ran while
      the target computed (synchronous drafting waits for all of it: about 0; clamped to [0, 1]);
    - ``wait_share``: wait_s over the generation seconds;
    - ``no_models_share``: the share of steps the lookahead policy left the model drafters out of
      (model-free drafts only, or none; None for stats without that counter);
    - ``no_models_free_chain_share``, ``no_models_no_chain_share``: of the (request, step)
      pairs, the share the model drafters did not draft for where the model-free voters had a
      chain, and where they had none (None for stats without those counters).
    """
    stats = [(r["smurfs_stats"], r.get("elapsed_s", 0.0)) for r in records
             if r.get("smurfs_stats")]
    if not stats:
        return None
    drafted = sum(s["requests_drafted"] for s, _ in stats)
    without = sum(s["requests_without_draft"] for s, _ in stats)
    wait_s = sum(s["wait_s"] for s, _ in stats)
    busy_s = sum(d.get("busy_s", 0.0) for s, _ in stats for d in s["drafters"])
    elapsed_s = sum(e for _, e in stats)
    steps = sum(s.get("steps", 0) for s, _ in stats)
    no_models = (sum(s["steps_without_models"] for s, _ in stats)
                 if all("steps_without_models" in s for s, _ in stats) else None)
    split = all("request_steps" in s for s, _ in stats)
    request_steps = sum(s.get("request_steps", 0) for s, _ in stats)
    hidden = None if busy_s <= 0 else min(1.0, max(0.0, 1.0 - wait_s / busy_s))
    return {"requests_drafted": drafted, "requests_without_draft": without,
            "no_draft_share": ratio(without, drafted), "drafter_busy_s": round(busy_s, 3),
            "wait_s": round(wait_s, 3), "hidden_share": hidden,
            "wait_share": ratio(wait_s, elapsed_s),
            "no_models_share": None if no_models is None else ratio(no_models, steps),
            "no_models_free_chain_share": ratio(sum(
                s["request_steps_without_models_free_chain"] for s, _ in stats),
                request_steps) if split else None,
            "no_models_no_chain_share": ratio(sum(
                s["request_steps_without_models_no_chain"] for s, _ in stats),
                request_steps) if split else None,
            "engine_steps": sum(d.get("engine_steps", 0) for s, _ in stats
                                for d in s["drafters"])}
