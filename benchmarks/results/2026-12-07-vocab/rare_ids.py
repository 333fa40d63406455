"""How many of the target's greedy output tokens lie beyond a draft vocabulary limit, and how many
of those were already in the text (prompt or earlier output) when emitted.

    python rare_ids.py RESULT.json... [--limits 32768,65536]

Reads the `none` method's greedy batch-1 outputs of benchmark results (each distinct prompt and
output counted once).
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("results", nargs="+")
    parser.add_argument("--limits", default="32768,49152,65536")
    args = parser.parse_args()
    limits = [int(x) for x in args.limits.split(",")]
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    total = 0
    beyond = dict.fromkeys(limits, 0)
    in_text = dict.fromkeys(limits, 0)
    for path in args.results:
        result = json.load(open(path))
        if (result["settings"].get("temperature") or 0.0) > 0.0:
            continue
        prompts = {p["index"]: p["prompt_token_ids"] for p in result["prompts"]}
        for method in result["methods"]:
            load = method["loads"].get("batch1") if method["name"] == "none" else None
            for index, prompt in (load or {}).get("per_prompt", {}).items():
                key = (tuple(prompts[int(index)]), tuple(prompt["output_token_ids"]))
                if key in seen:
                    continue
                seen.add(key)
                text = set(key[0])
                for token in key[1]:
                    total += 1
                    for limit in limits:
                        if token >= limit:
                            beyond[limit] += 1
                            in_text[limit] += token in text
                    text.add(token)
    print(f"{len(seen)} outputs, {total} tokens")
    for limit in limits:
        print(f"beyond {limit}: {beyond[limit]} ({beyond[limit] / max(total, 1):.1%}), "
              f"already in the text: {in_text[limit]}")


if __name__ == "__main__":
    main()
