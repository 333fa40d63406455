"""Whether the live voters' chain in a temperature > 0 trace is the chain the replay's voters
build: at exactly the steps of the trace (the positions its requests were at), the replay's
n-gram and suffix voters' chains on the run's own outputs, and the target's probability of their
first token (float32, at the run's temperature), against how often the live chain's first token
matched.

`python live_positions.py TRACE RESULT_JSON TARGET` (RESULT_JSON: the run that wrote TRACE; its
request i is prompt i - 1, request 0 the warm-up).
"""
import argparse
import collections
import json

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from bound import SOURCES, output_logprobs, voter_chains
from vllm_smurfs.trace.format import read_trace


def main(trace_path, result_path, target_path):
    torch.set_num_threads(2)
    result = json.load(open(result_path))
    temperature = result["settings"]["temperature"]
    prompts = result["prompts"]
    outputs = result["methods"][0]["loads"]["batch1"]["per_prompt"]
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    steps = collections.defaultdict(list)  # prompt index -> (output position, free chain)
    for step in read_trace(trace_path):
        for r in step.requests:
            index = int(r.req_id.split("-")[0]) - 1
            if index >= 0 and r.free is not None and r.free[0] > 0:
                steps[index].append((r.position - len(prompts[index]["prompt_token_ids"]),
                                     r.free))
    live, replay, lengths = [], collections.defaultdict(list), collections.defaultdict(list)
    for index, visited in sorted(steps.items()):
        prompt = prompts[index]["prompt_token_ids"]
        out = outputs[str(index)]["output_token_ids"]
        (chains,) = voter_chains(prompt, [out], 6)
        (logp,) = output_logprobs(target, prompt, [out], temperature)
        for x, (free_len, matched) in visited:
            if x >= len(out):
                continue
            live.append(matched >= 1)
            lengths["live"].append(free_len)
            for s in SOURCES:
                chain = chains[s][x]
                if chain:
                    replay[s].append(float(logp[x, chain[0]].exp()))
                    replay[s + " matched"].append(chain[0] == out[x])
                    lengths[s].append(len(chain))
            either = chains["suffix"][x] or chains["ngram"][x]
            replay["either"].append(float(logp[x, either[0]].exp()) if either else 0.0)
    print(f"{len(live)} live steps with a voters' chain: its first token matched at "
          f"{np.mean(live):.3f} (chain length {np.mean(lengths['live']):.2f})")
    for s in SOURCES:
        print(f"replay's {s} chain at the same steps: present at {len(replay[s])}, first token's "
              f"probability {np.mean(replay[s]):.3f}, matched {np.mean(replay[s + ' matched']):.3f}"
              f" (length {np.mean(lengths[s]):.2f})")
    print(f"replay's suffix-else-ngram chain, first token's probability over the live steps "
          f"(0 where it has none): {np.mean(replay['either']):.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("trace", "result", "target"):
        parser.add_argument(name)
    args = parser.parse_args()
    main(args.trace, args.result, args.target)
