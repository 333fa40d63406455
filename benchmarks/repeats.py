"""Speedups over repeated passes: `benchmarks run --repeat N` and `benchmarks repeats RESULT...`.

On a 2-core machine the same method's tokens/s moves by 8-11% from one run to the next, more than
the 2% a goal like "never below no speculation by more than 2%" asks to resolve. A pass is one
ordinary run (every method, every load point, each speedup over the baseline measured in that
pass); repeating passes, with the method order reversed every other pass so that a slow drift of
the machine favours no method, gives one speedup per pass and load point. This module reduces
them (pure, tested): per load point and method, every pass's speedup, their geometric mean, and
a 95% Student-t interval of the mean log speedup. The speedups are ratios within a pass, so the
pass-to-pass drift of both methods cancels in each; what is left is the noise of the ratio.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from benchmarks.compare import figures, load_result, upgrade
from benchmarks.report import fmt, fmt_identity, load_title, table
from benchmarks.summary import VERDICTS, summary_loads

#: Two-sided 95% quantiles of Student's t, by degrees of freedom (1..30); beyond 30, 1.96.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t95(dof: int) -> float:
    """Two-sided 95% quantile of Student's t with `dof` >= 1 degrees of freedom."""
    if dof < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {dof}")
    return _T95[dof - 1] if dof <= len(_T95) else 1.96


def method_order(labels: list[str], pass_index: int) -> list[str]:
    """The order of the methods in pass `pass_index` (0-based): as given in even passes, reversed
    in odd ones (A B, B A, A B, ...), so that no method always runs first or last."""
    return list(labels) if pass_index % 2 == 0 else list(reversed(labels))


def reduce_speedups(speedups: list[float]) -> dict[str, Any]:
    """Geometric mean, min, max and a 95% interval of the geometric mean (Student t on the log
    speedups; None with one pass) of one method's speedups at one load point."""
    if not speedups or any(s <= 0 for s in speedups):
        raise ValueError(f"expected positive speedups, got {speedups}")
    logs = [math.log(s) for s in speedups]
    n = len(logs)
    mean = sum(logs) / n
    interval = None
    if n > 1:
        sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
        half = t95(n - 1) * sd / math.sqrt(n)
        interval = [math.exp(mean - half), math.exp(mean + half)]
    return {"speedups": list(speedups), "geomean": math.exp(mean), "min": min(speedups),
            "max": max(speedups), "ci95": interval}


def aggregate(results: list[dict[str, Any]], sources: list[str] | None = None) -> dict[str, Any]:
    """Per load point and method, the speedups of every pass (`results`: run result JSONs with
    their summaries) and their reduction; a pass where a method's load point is not `ok`
    (partial, error, not run, absent) or has no speedup is counted in `missing`, not guessed,
    and each pass's status is kept (`statuses`). The identity checks of all passes are summed
    (`identity`: compared, identical, and the divergences' verdicts)."""
    if not results:
        raise ValueError("no results to aggregate")
    results = [upgrade(r) for r in results]
    baselines = {r["summary"].get("baseline") for r in results}
    if len(baselines) != 1:
        raise ValueError(f"the passes have different baselines: {sorted(map(str, baselines))}")
    loads: list[str] = []
    for r in results:
        loads += [load for load in summary_loads(r["summary"]) if load not in loads]
    per_load: dict[str, dict[str, Any]] = {}
    for load in loads:
        labels: list[str] = []
        for r in results:
            labels += [label for label in r["summary"].get(load, {}) if label not in labels]
        rows: dict[str, Any] = {}
        for label in labels:
            speedups, lengths, per_pass, statuses, missing = [], [], [], [], 0
            decodes: list[float | None] = []
            identity = {key: 0 for key in ("compared", "identical", *VERDICTS)}
            for r in results:
                row = r["summary"].get(load, {}).get(label)
                status = row.get("status", "not run") if row is not None else "absent"
                statuses.append(status)
                for key in identity:
                    identity[key] += ((row or {}).get("identity") or {}).get(key, 0)
                fig = figures(row, load) if row is not None else {}
                if status != "ok" or fig.get("speedup") is None:
                    missing += 1
                    per_pass.append(None)
                    continue
                speedups.append(float(fig["speedup"]))
                per_pass.append(float(fig["speedup"]))
                decode = fig.get("decode_speedup")
                decodes.append(float(decode) if decode is not None else None)
                if fig.get("acceptance_length") is not None:
                    lengths.append(float(fig["acceptance_length"]))
            entry: dict[str, Any] = {"missing": missing, "statuses": statuses,
                                     "per_pass": per_pass,
                                     "identity": identity if identity["compared"] else None,
                                     "mean_acceptance_length": (
                                         sum(lengths) / len(lengths) if lengths else None)}
            if speedups:
                entry.update(reduce_speedups(speedups))
            if decodes and None not in decodes:  # batch 1, every pass with engine timestamps
                entry["decode"] = reduce_speedups(decodes)
            rows[label] = entry
        per_load[load] = rows
    return {"baseline": baselines.pop(), "num_passes": len(results),
            "passes": [{"source": (sources[i] if sources else None),
                        "provenance": r["provenance"],
                        "method_order": [m["label"] for m in r.get("methods", [])]}
                       for i, r in enumerate(results)],
            "loads": per_load}


def render(agg: dict[str, Any]) -> str:
    """Markdown: one table per load point, one row per method."""
    out = [f"# Speedups over {agg['num_passes']} passes", "",
           f"Speedup over `{agg['baseline']}` measured within each pass; geometric mean over the "
           "passes and a 95% Student-t interval of it (on the log speedups). A pass whose load "
           "point is not `ok` (status per pass, in pass order) counts as missing. Identical: "
           "outputs identical to the reference's over all passes, and the divergences' verdicts "
           "(near-tie: the target's two tokens within rounding of each other; unchecked: no "
           "margins computed). Decode speedup (batch 1): the same over decoding alone, first token "
           "to last.", ""]
    for i, p in enumerate(agg["passes"], 1):
        prov = p.get("provenance") or {}
        git = prov.get("git") or {}
        out.append(f"- pass {i}: {prov.get('timestamp_utc')}, git {str(git.get('sha'))[:10]}"
                   f"{' (dirty)' if git.get('dirty') else ''}, methods in order "
                   f"{', '.join(p['method_order'])}" + (f" ({p['source']})" if p["source"] else ""))
    out.append("")
    for load, rows in agg["loads"].items():
        out += [f"## {load_title(load)}", ""]
        body = []
        for label, e in rows.items():
            ci = e.get("ci95")
            per_pass = e.get("per_pass", e.get("speedups", []))
            body.append([label, " ".join(e.get("statuses", [])) or "-",
                         " ".join(fmt(s, suffix="x") for s in per_pass) or "-",
                         fmt(e.get("geomean"), 3, "x"),
                         f"{ci[0]:.3f}-{ci[1]:.3f}" if ci else "-",
                         fmt(e.get("min"), suffix="x"), _decode_cell(e.get("decode")),
                         fmt(e.get("mean_acceptance_length")),
                         fmt_identity(e.get("identity")), str(e["missing"])])
        out += [table(["method", "status per pass", "speedup per pass", "geomean",
                       "95% interval", "min", "decode speedup per pass (geomean)",
                       "mean acc. len", "identical", "passes missing"],
                      body), ""]
    return "\n".join(out)


def _decode_cell(decode: dict[str, Any] | None) -> str:
    """Every pass's decode speedup and their geometric mean (``-``: none)."""
    if not decode:
        return "-"
    return (" ".join(fmt(s, suffix="x") for s in decode["speedups"])
            + f" ({fmt(decode['geomean'], 3, 'x')})")


def write(agg: dict[str, Any], out_dir: str) -> tuple[str, str]:
    """repeats.json and repeats.md in `out_dir`; returns their paths."""
    json_path, md_path = os.path.join(out_dir, "repeats.json"), os.path.join(out_dir, "repeats.md")
    with open(json_path, "w") as f:
        json.dump(agg, f, indent=1)
    with open(md_path, "w") as f:
        f.write(render(agg))
    return json_path, md_path


def result_path(path: str) -> str:
    """A run folder or its result.json, as given on the command line."""
    return os.path.join(path, "result.json") if os.path.isdir(path) else path


def load_passes(paths: list[str]) -> list[dict[str, Any]]:
    return [load_result(result_path(p)) for p in paths]
