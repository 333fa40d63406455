"""Child process of `benchmarks run`: the target's top-2 logit margin at each divergence.

    python -m benchmarks.margins request.json result.json

At a divergence a method's greedy output left the reference's; a tiny margin between the
target's two best tokens there says it was a near-tie, flipped by a different computation shape
(bf16), not a lossy method. One Hugging Face forward of the target per divergence, on the prompt
plus the reference's output before the divergent position, in the run's dtype. The margin is
Hugging Face's, not vLLM's kernels': it tells a near-tie (<~0.1) from a clear choice, no more.

request: {"target", "dtype", "queries": [{"key", "prompt_token_ids", "prefix_token_ids",
          "tokens": [ids whose logits to report]}]}
result:  {"key": {"top1": [id, logit], "top2": [id, logit], "margin", "logits": {id: logit}}}
"""

from __future__ import annotations

import json
import sys
from typing import Any


def compute(request: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
             "auto": "auto"}.get(request["dtype"], request["dtype"])
    model = AutoModelForCausalLM.from_pretrained(request["target"], dtype=dtype)
    model.eval()
    out: dict[str, Any] = {}
    with torch.inference_mode():
        for query in request["queries"]:
            ids = list(query["prompt_token_ids"]) + list(query["prefix_token_ids"])
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            top = torch.topk(logits, 2)
            (id1, id2), (v1, v2) = top.indices.tolist(), top.values.tolist()
            out[query["key"]] = {
                "top1": [id1, v1], "top2": [id2, v2], "margin": v1 - v2,
                "logits": {str(t): logits[t].item() for t in query["tokens"]
                           if 0 <= t < logits.shape[0]}}
    return out


def main() -> None:
    with open(sys.argv[1]) as f:
        request = json.load(f)
    result = compute(request)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
