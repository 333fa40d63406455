"""How often the live Smurfs controller's model-free chain matched the target's next token, per
step, in a trace recorded at temperature > 0 (`trace_file`): over every step with a chain, and
split by what the step verified (the chain alone, the model's draft, nothing); and the model's
first drafted token where it was verified.

`python trace_match.py TRACE` (sampling requests only; the benchmark's greedy warm-up is left
out).
"""
import argparse
import collections

from vllm_smurfs.trace.format import read_trace


def main(path):
    counts = collections.Counter()
    for step in read_trace(path):
        for r in step.requests:
            if r.band == 0:
                continue
            if r.free is not None and r.free[0] > 0:
                kind = "model" if r.models and r.k else ("chain" if r.k else "nothing")
                for key in ("all", kind):
                    counts[key] += 1
                    counts[key + " matched"] += r.free[1] >= 1
            if r.models and r.k:
                counts["model drafts"] += 1
                counts["model drafts accepted"] += r.accepted >= 1
    for key, label in (("all", "every step with a chain"), ("chain", "the chain verified"),
                       ("model", "the model's draft verified"), ("nothing", "nothing verified")):
        print(f"voters' chain, first token matched, {label}: "
              f"{counts[key + ' matched'] / max(counts[key], 1):.3f} of {counts[key]} steps")
    print(f"model's draft, first token accepted: "
          f"{counts['model drafts accepted'] / max(counts['model drafts'], 1):.3f} of "
          f"{counts['model drafts']} steps")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    main(parser.parse_args().trace)
