"""Per-family speedups (each pass, then their geometric mean) and Smurfs' split of steps without
the model, from the passes of the runs in this folder. `python tables.py RUN [RUN...]`."""
import json
import math
import sys

FAMILIES = ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]


def per_family(result):
    fam = {p["index"]: p["family"] for p in result["prompts"]}
    out = {}
    for m in result["methods"]:
        pp = m["loads"].get("batch1", {}).get("per_prompt", {})
        tok, sec = {}, {}
        for i, r in pp.items():
            f = fam[int(i)]
            tok[f] = tok.get(f, 0) + r["num_output_tokens"]
            sec[f] = sec.get(f, 0) + r["elapsed_s"]
        out[m["label"]] = {f: tok[f] / sec[f] for f in tok} | {
            "overall": sum(tok.values()) / sum(sec.values()) if sec else float("nan")}
        st = [r.get("smurfs_stats") for r in pp.values() if r.get("smurfs_stats")]
        if st:
            keys = ("steps", "steps_without_models", "request_steps",
                    "request_steps_without_models_free_chain",
                    "request_steps_without_models_no_chain")
            out[m["label"]]["_split"] = {k: sum(s[k] for s in st) for k in keys}
    return out


for run in sys.argv[1:]:
    passes = []
    for p in (1, 2):
        with open(f"{run}/pass-{p}/result.json") as f:
            r = json.load(f)
        passes.append((per_family(r), r["summary"]["baseline"]))
    print(f"## {run}\n")
    print("| method | pass | " + " | ".join(FAMILIES) + " | overall |")
    print("| --- | --- | " + " | ".join("---" for _ in FAMILIES) + " | --- |")
    labels = list(passes[0][0])
    for label in labels:
        rows = []
        for i, (fam, base) in enumerate(passes):
            rows.append({f: fam[label][f] / fam[base][f] for f in FAMILIES + ["overall"]})
            print(f"| {label} | {i + 1} | " + " | ".join(f"{rows[-1][f]:.2f}" for f in FAMILIES)
                  + f" | {rows[-1]['overall']:.2f} |")
        g = {f: math.exp(sum(math.log(r[f]) for r in rows) / len(rows)) for f in rows[0]}
        print(f"| {label} | geomean | " + " | ".join(f"{g[f]:.2f}" for f in FAMILIES)
              + f" | {g['overall']:.2f} |")
    for label in labels:
        for i, (fam, _) in enumerate(passes):
            s = fam[label].get("_split")
            if s:
                print(f"\n{label} pass {i + 1}: steps without the model {s['steps_without_models']}"
                      f" of {s['steps']} ({s['steps_without_models'] / s['steps']:.2f}); request-"
                      f"steps without it: n-gram/suffix chain {s['request_steps_without_models_free_chain']}"
                      f", no chain {s['request_steps_without_models_no_chain']} of {s['request_steps']}")
    print()
