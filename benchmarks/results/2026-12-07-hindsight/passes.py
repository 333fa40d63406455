"""Per pass and method: the whole-call speedup, the decode speedup (first token to last, the
engine's timestamps) and the same with the method's first token charged at the baseline's
prefill (output tokens after the first / (call seconds - the baseline's prefill seconds), so a
method's own work in its first step, a drafter's catch-up with the prompt, counts as decoding),
with their geometric means over the passes, then per family (geomean over the passes), and per
pass Smurfs' steps without the model drafter, split by whether the voters had a chain.
`python passes.py RUN [RUN...]`."""
import glob
import json
import math
import sys

FAMILIES = ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]


def rates(result, baseline):
    fam = {p["index"]: p["family"] for p in result["prompts"]}
    pps = {m["label"]: m["loads"]["batch1"]["per_prompt"] for m in result["methods"]}
    base = pps[baseline]
    out = {}
    for label, pp in pps.items():
        out[label] = {}
        for group in FAMILIES + ["overall"]:
            idx = [i for i in pp if i in base and (group == "overall" or fam[int(i)] == group)]
            tok = sum(pp[i]["num_output_tokens"] for i in idx)
            sec = sum(pp[i]["elapsed_s"] for i in idx)
            dtok = sum(pp[i]["num_output_tokens"] - 1 for i in idx)
            dsec = sum(pp[i]["decode_s"] for i in idx)
            asec = sum(pp[i]["elapsed_s"] - base[i]["prefill_s"] for i in idx)
            out[label][group] = (tok / sec, dtok / dsec, dtok / asec)
    return {label: {g: tuple(v / out[baseline][g][j] for j, v in enumerate(vals))
                    for g, vals in groups.items()} for label, groups in out.items()}


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


for run in sys.argv[1:]:
    passes, splits = [], []
    for path in sorted(glob.glob(f"{run}/pass-*/result.json")):
        with open(path) as f:
            r = json.load(f)
        passes.append(rates(r, r["summary"]["baseline"]))
        for m in r["methods"]:
            stats = [p["smurfs_stats"] for p in m["loads"]["batch1"]["per_prompt"].values()
                     if p.get("smurfs_stats")]
            if stats:
                keys = ("steps", "steps_without_models",
                        "request_steps_without_models_free_chain",
                        "request_steps_without_models_no_chain")
                splits.append({k: sum(s[k] for s in stats) for k in keys})
    print(f"## {run} ({len(passes)} passes)\n")
    print("| method | speedup per pass (geomean) | decode | decode, prefill at the baseline's |")
    print("| --- | --- | --- | --- |")
    for label in passes[0]:
        cells = []
        for j in range(3):
            xs = [p[label]["overall"][j] for p in passes]
            cells.append(" ".join(f"{x:.2f}" for x in xs) + f" ({geomean(xs):.3f})")
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("\nPer family, geomean over the passes (whole call / decode / decode with the "
          "baseline's prefill):\n")
    print("| method | " + " | ".join(FAMILIES) + " |")
    print("| --- | " + " | ".join("---" for _ in FAMILIES) + " |")
    for label in passes[0]:
        print(f"| {label} | " + " | ".join(
            "/".join(f"{geomean([p[label][f][j] for p in passes]):.2f}" for j in range(3))
            for f in FAMILIES) + " |")
    print("\nSmurfs' steps without the model, per pass (with a voter chain + without any chain "
          "/ steps): " + ", ".join(
              f"{s['request_steps_without_models_free_chain']} + "
              f"{s['request_steps_without_models_no_chain']} / {s['steps']}" for s in splits))
    print()
