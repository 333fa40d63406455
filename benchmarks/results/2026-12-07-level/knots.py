"""Per run and pass, from the per-prompt controller snapshots of Smurfs' engine: the target
curve's level (the machine's speed factor, from 5f25fab on), its 1-token knot, and how much
dearer it priced a 2-token step (one draft token) than a 1-token one after each prompt.
`python knots.py RUN...` (a RUN folder holds pass-1/, pass-2/)."""
import json
import sys
from pathlib import Path


def knot(knots, n):
    return next((y for x, y in knots if round(x) == n), None)


for run in sys.argv[1:]:
    for result in sorted(Path(run).glob("pass-*/result.json")):
        r = json.loads(result.read_text())
        for m in r["methods"]:
            if m["name"] != "smurfs":
                continue
            pp = m["loads"]["batch1"]["per_prompt"]
            levels, one, ratio = [], [], []
            for i in sorted(pp, key=int):
                c = pp[i]["smurfs_stats"]["controller"]["target_cost"]
                k1, k2 = knot(c["knots"], 1), knot(c["knots"], 2)
                if c.get("level") is not None:
                    levels.append(c["level"])
                if k1:
                    one.append(k1 * 1000)
                if k1 and k2:
                    ratio.append(k2 / k1 - 1)
            lv = f"level {min(levels):.2f}-{max(levels):.2f}" if levels else "no level"
            print(f"{run} {result.parent.name}: {lv}; 1-token knot {min(one):.0f}-{max(one):.0f} ms;"
                  f" 2-token step dearer by {min(ratio):.0%}-{max(ratio):.0%}"
                  f" (per prompt: {' '.join(f'{x:.0%}' for x in ratio)})")
