"""Reports on recorded traces: compare lookahead policies by replaying them, and where a recorded
run's time went; the command line of the simulator.

CLI: ``python -m vllm_smurfs.trace TRACE.jsonl [--concurrency 1,4,16,32] [--max-lookahead 8]``
prints a markdown table of the adaptive controller vs fixed k=1..max with the model drafter vs the
model-free voters alone vs no speculation, and at concurrency 1 the hindsight ceilings;
``--summary`` prints instead where the recorded run's time went (:func:`summarize`).

The simulator itself is `trace.simulator`; this module only formats and drives it. Pure module
(stdlib + numpy through `trace.simulator`, no vllm/torch); the runtime never imports it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_smurfs.trace.format import TraceRequest, TraceStep, read_trace
from vllm_smurfs.trace.simulator import (
    PolicyFactory,
    default_policies,
    fit_pass_cost,
    fit_target_cost,
    hindsight,
    reconstruct,
    replay,
)

__all__ = ["compare", "format_summary", "format_table", "main", "summarize"]


def compare(
    trace: Sequence[TraceStep],
    policies: Mapping[str, PolicyFactory],
    concurrencies: Sequence[int],
    max_lookahead: int = 8,
    with_hindsight: bool = True,
) -> list[dict[str, Any]]:
    """One row per (policy, concurrency): tokens/s, speedup vs ``k=0`` (when among the
    policies), output tokens per request-step, the share of request-steps with the model
    drafter, and the fraction of steps whose token count lies past the trace's largest (the
    cost there is extrapolated). At concurrency 1, ``with_hindsight`` adds the ceilings of
    `simulator.hindsight` (``hindsight``, and ``hindsight model-free`` without the model): what
    no policy can beat, knowing every draft's fate in advance."""
    requests = reconstruct(trace)
    target = fit_target_cost(trace)
    drafter = fit_pass_cost(trace)
    largest = max((s.num_tokens for s in trace), default=0)
    rows = []
    for c in concurrencies:
        results = {name: replay(requests, factory, c, target, drafter, max_lookahead)
                   for name, factory in policies.items()}
        if c == 1 and with_hindsight:
            if drafter is not None:
                results["hindsight"] = hindsight(requests, target, drafter, max_lookahead)
            results["hindsight model-free"] = hindsight(requests, target, None, max_lookahead)
        base = results["k=0"].tokens_per_second if "k=0" in results else None
        for name, r in results.items():
            outside = sum(1 for s in r.steps if s.num_tokens > largest)
            rows.append({
                "policy": name, "concurrency": c, "tokens_per_s": r.tokens_per_second,
                "speedup": r.tokens_per_second / base if base else None,
                "mean_accepted_length": r.mean_accepted_length, "model_share": r.model_share,
                "seconds": r.total_seconds, "tokens": r.total_tokens, "steps": r.num_steps,
                "extrapolated": outside / r.num_steps if r.num_steps else 0.0,
            })
    return rows


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: one row per policy, one column per concurrency; best policy per column in bold
    (the hindsight ceilings are not policies)."""
    concs = sorted({r["concurrency"] for r in rows})
    names = list(dict.fromkeys(r["policy"] for r in rows))
    cell = {(r["policy"], r["concurrency"]): r for r in rows}
    best = {c: max((r["tokens_per_s"] for r in rows if r["concurrency"] == c
                    and not r["policy"].startswith("hindsight")), default=None) for c in concs}
    lines = ["| policy | " + " | ".join(f"c={c} tok/s (vs k=0, τ)" for c in concs) + " |",
             "|---|" + "---|" * len(concs)]
    for name in names:
        cells = []
        for c in concs:
            r = cell.get((name, c))
            if r is None:
                cells.append("")
                continue
            sp = "" if r["speedup"] is None else f"{r['speedup']:.2f}x, "
            txt = f"{r['tokens_per_s']:.1f} ({sp}{r['mean_accepted_length']:.2f})"
            if r["extrapolated"] > 0.05:
                txt += " †"
            cells.append(f"**{txt}**" if r["tokens_per_s"] == best[c] else txt)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("τ: tokens per request per step. †: over 5% of the steps past the recorded "
                 "token counts (cost extrapolated).")
    if any(r["policy"].startswith("hindsight") for r in rows):
        lines.append("hindsight: the fastest any policy could be at c=1 knowing every draft's "
                     "fate in advance (a ceiling, not a policy).")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------- summary


def summarize(trace: Sequence[TraceStep]) -> list[dict[str, Any]]:
    """Where a recorded run's target time went: one row per kind of step, by whether the model
    drafters drafted during it (``models``: True, False, or None where not recorded) and
    whether it carried prompt chunks (``prefill``: tokens beyond its decodes' ``1 + k``).

    Per row: ``steps``; ``seconds`` of target time and its ``share`` of the trace's; the
    decodes' ``output_tokens`` (one per request and step, plus the accepted drafts) and
    ``output_tokens_per_s`` over the row's seconds (prefill steps spend part of theirs on the
    chunks); ``drafted`` and ``accepted`` draft tokens; ``tokens_per_request_step`` (output
    tokens per request and step, drafted or not); ``prefill_tokens``. Rows come in a fixed
    order (models on, off, unknown; without prefill first); kinds without steps are left out.
    """
    total = sum(step.seconds for step in trace) or 1.0
    groups: dict[tuple[bool | None, bool], dict[str, Any]] = {}
    for step in trace:
        decode = sum(1 + r.k for r in step.requests)
        prefill = max(0, step.num_tokens - decode)
        row = groups.setdefault((step.drafting, prefill > 0), {
            "models": step.drafting, "prefill": prefill > 0, "steps": 0, "seconds": 0.0,
            "request_steps": 0, "output_tokens": 0, "drafted": 0, "accepted": 0,
            "prefill_tokens": 0})
        row["steps"] += 1
        row["seconds"] += step.seconds
        row["request_steps"] += len(step.requests)
        row["output_tokens"] += sum(1 + r.accepted for r in step.requests)
        row["drafted"] += sum(r.k for r in step.requests)
        row["accepted"] += sum(r.accepted for r in step.requests)
        row["prefill_tokens"] += prefill
    order = {True: 0, False: 1, None: 2}
    rows = []
    for key in sorted(groups, key=lambda k: (order[k[0]], k[1])):
        row = groups[key]
        row["share"] = row["seconds"] / total
        row["output_tokens_per_s"] = (row["output_tokens"] / row["seconds"]
                                      if row["seconds"] > 0 else None)
        row["tokens_per_request_step"] = (row["output_tokens"] / row["request_steps"]
                                          if row["request_steps"] else None)
        rows.append(row)
    return rows


def format_summary(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown table of :func:`summarize`'s rows."""
    names = {True: "with model drafters", False: "without", None: "not recorded"}
    lines = ["| steps of kind | prefill | steps | target s (share) | output tok | output tok/s "
             "| drafted / accepted | tokens per request-step | prefill tok |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rate = "-" if r["output_tokens_per_s"] is None else f"{r['output_tokens_per_s']:.2f}"
        per = r["tokens_per_request_step"]
        per_text = "-" if per is None else f"{per:.2f}"
        lines.append(
            f"| {names[r['models']]} | {'yes' if r['prefill'] else 'no'} | {r['steps']} "
            f"| {r['seconds']:.1f} ({100 * r['share']:.0f}%) | {r['output_tokens']} | {rate} "
            f"| {r['drafted']} / {r['accepted']} | {per_text} | {r['prefill_tokens']} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ CLI


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"concurrencies must be >= 1, got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_smurfs.trace",
        description="Compare lookahead policies by replaying recorded traces.")
    parser.add_argument("traces", nargs="+", type=Path, help="JSON-lines trace file(s)")
    parser.add_argument("--concurrency", type=_int_list, default=[1, 4, 16, 32],
                        help="comma-separated load points (requests in flight)")
    parser.add_argument("--max-lookahead", type=int, default=8)
    parser.add_argument("--summary", action="store_true",
                        help="print where the recorded run's time went instead of replaying")
    args = parser.parse_args(argv)
    if args.max_lookahead < 1:
        parser.error(f"--max-lookahead must be >= 1, got {args.max_lookahead}")
    trace: list[TraceStep] = []
    for i, path in enumerate(args.traces):
        steps = read_trace(path)
        if len(args.traces) > 1:  # request ids of different runs may collide
            steps = [TraceStep(s.step, s.t, s.seconds, s.num_tokens, tuple(
                TraceRequest(f"{i}:{r.req_id}", r.position, r.k, r.accepted, r.free, r.models,
                             r.drafts) for r in s.requests), s.drafts, s.drafting,
                s.prompt_tokens, s.passes) for s in steps]
        trace.extend(steps)
    if args.summary:
        print(f"{len(trace)} steps, {sum(s.seconds for s in trace):.1f} s of target time")
        print(format_summary(summarize(trace)))
        return 0
    requests = reconstruct(trace)
    print(f"{len(trace)} steps, {len(requests)} requests, "
          f"{sum(r.length for r in requests)} tokens; conflicts "
          f"{sum(r.conflicts for r in requests)}")
    has_passes = any(s.passes for s in trace)
    rows = compare(trace, default_policies(args.max_lookahead, has_passes), args.concurrency,
                   args.max_lookahead)
    print(format_table(rows))
    return 0

if __name__ == "__main__":
    sys.exit(main())
