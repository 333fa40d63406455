"""`benchmarks compare A.json B.json`: two runs side by side, with B/A ratios.

Rows are matched by load point and method label; a method or load in one run only shows with
dashes on the other side. Served load points are matched by concurrency (`served@c4` with
`served@c4`), one table each, however many each run has; a schema-1 file's single `served` load
is read as `served@c<its concurrency>`. Ratios compare absolute figures across runs (different
days, machines or code): within one run, prefer its own speedup column (over the baseline at
the same load point).
"""

from __future__ import annotations

import json
from typing import Any

from benchmarks.analysis import OVERALL, ratio
from benchmarks.report import fmt, fmt_identity, table
from benchmarks.summary import concurrencies, is_served, served_load, summary_loads


def load_result(path: str) -> dict[str, Any]:
    with open(path) as f:
        result = json.load(f)
    if "summary" not in result:
        raise ValueError(f"{path}: no summary (an interrupted run?); schema_version "
                         f"{result.get('schema_version')}")
    return upgrade(result)


def upgrade(result: dict[str, Any]) -> dict[str, Any]:
    """A schema-1 result (one `served` load, concurrency an int) in schema 2's names: `served`
    becomes `served@c<concurrency>` in the summary and the methods' loads (a new dict; the
    given one is left as it is). A schema-2 result is returned as it is."""
    if result.get("schema_version", 1) >= 2:
        return result
    name = served_load(concurrencies(result.get("settings", {}))[0])

    def rename(loads: dict[str, Any]) -> dict[str, Any]:
        return {(name if key == "served" else key): value for key, value in loads.items()}

    upgraded = dict(result)
    if "summary" in result:
        upgraded["summary"] = rename(result["summary"])
    upgraded["methods"] = [{**m, "loads": rename(m.get("loads", {}))}
                           for m in result.get("methods", [])]
    return upgraded


def figures(row: dict[str, Any], load: str, family: str = OVERALL) -> dict[str, Any]:
    """tokens/s, speedup (and at batch 1 the decode speedup), acceptance length and identity
    rate of one summary row."""
    if is_served(load):
        totals = row.get("totals", {})
        fam = row.get("families", {}).get(family, {})
        if family == OVERALL:
            tps, speedup = totals.get("output_throughput"), totals.get("speedup")
            acc = totals.get("mean_acceptance_length")
        else:
            tps, speedup, acc = fam.get("per_request_tokens_per_s"), fam.get("speedup"), None
        return {"tokens_per_s": tps, "speedup": speedup, "acceptance_length": acc,
                "identity_rate": (row.get("identity") or {}).get("identity_rate"),
                "identity": row.get("identity")}
    fam = (row.get("families") or {}).get(family) or (row.get(OVERALL) if family == OVERALL
                                                        else None) or {}
    return {"tokens_per_s": fam.get("tokens_per_s"), "speedup": fam.get("speedup"),
            "decode_speedup": fam.get("decode_speedup"),
            "acceptance_length": fam.get("mean_acceptance_length"),
            "identity_rate": (row.get("identity") or {}).get("identity_rate"),
            "identity": row.get("identity")}


def compare(a: dict[str, Any], b: dict[str, Any], family: str = OVERALL) -> str:
    a, b = upgrade(a), upgrade(b)
    out = []
    for name, r in (("A", a), ("B", b)):
        prov = r["provenance"]
        out.append(f"- {name}: {prov['timestamp_utc']}, git {str(prov['git']['sha'])[:10]}"
                   f"{' (dirty)' if prov['git']['dirty'] else ''}, {r['settings']['num_prompts']} "
                   f"prompts, max_tokens {r['settings']['max_tokens']}, {r['settings']['dtype']}, "
                   f"{'quick' if r['settings']['quick'] else 'full'}")
    if a["settings"]["num_prompts"] != b["settings"]["num_prompts"] or \
            a["settings"]["max_tokens"] != b["settings"]["max_tokens"]:
        out.append("- WARNING: different prompt sets or max_tokens: absolute figures differ "
                   "for that reason too")
    out.append("")
    loads_a, loads_b = summary_loads(a["summary"]), summary_loads(b["summary"])
    for load in loads_a + [load for load in loads_b if load not in loads_a]:
        rows_a, rows_b = a["summary"].get(load, {}), b["summary"].get(load, {})
        if not rows_a and not rows_b:
            continue
        out += [f"## {load} ({family})", ""]
        if not rows_a or not rows_b:
            out += [f"`{load}` is in run {'B' if not rows_a else 'A'} only.", ""]
        labels = list(rows_a) + [label for label in rows_b if label not in rows_a]
        body = []
        for label in labels:
            fa = figures(rows_a[label], load, family) if label in rows_a else {}
            fb = figures(rows_b[label], load, family) if label in rows_b else {}
            row = [label]
            for key in ("tokens_per_s", "speedup", "acceptance_length"):
                va, vb = fa.get(key), fb.get(key)
                row += [fmt(va), fmt(vb), fmt(ratio(vb, va), suffix="x")]
            row += [fmt_identity(fa.get("identity")), fmt_identity(fb.get("identity"))]
            body.append(row)
        out += [table(["method", "tok/s A", "tok/s B", "B/A", "speedup A", "speedup B", "B/A",
                       "acc. len A", "acc. len B", "B/A", "identity A", "identity B"], body), ""]
    return "\n".join(out)
