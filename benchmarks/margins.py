"""The target's top-2 logit margin at each divergence: a child process of `benchmarks run`, or
run by hand on runs already made.

    python -m benchmarks.margins request.json result.json      # what `benchmarks run` does
    python -m benchmarks.margins --add RUN [RUN ...] [--target PATH] [--dtype DTYPE]

At a divergence a method's greedy output left the reference's; a tiny margin between the
target's two best tokens there says it was a near-tie, flipped by a different computation shape
(bf16), not a lossy method. One Hugging Face forward of the target per divergence, on the prompt
plus the reference's output before the divergent position, in the run's dtype. The margin is
Hugging Face's, not vLLM's kernels': it tells a near-tie (<~0.1) from a clear choice, no more.

request: {"target", "dtype", "queries": [{"key", "prompt_token_ids", "prefix_token_ids",
          "tokens": [ids whose logits to report]}]}; a served divergence's query has
          "reference_text" and "text" instead of the prefix and tokens: both are tokenized with
          the target's tokenizer, and the first divergent token is the position (an
          approximation: the server may have split the text otherwise; an output that ended
          there has the tokenizer's EOS as its token)
result:  {"key": {"top1": [id, logit], "top2": [id, logit], "margin", "logits": {id: logit}}},
         served ones also with "token_position", "reference_token", "token"

`--add RUN...` (run folders or their result.json): recomputes each run's summary (the current
code's, from its records), computes the margins of its divergences in this process, writes them
into result.json (`margins`) and rewrites summary.md; `--target` when the model moved since.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from smurfs_tools.jobs import first_divergence


def text_query(query: dict[str, Any], encode: Callable[[str], list[int]],
               eos_token_id: int | None) -> dict[str, Any] | None:
    """A served divergence's query (two texts) as a token query: the first divergent token of
    the two texts tokenized, the reference's tokens before it as the prefix; None when the
    tokenized texts do not differ."""
    ref_ids, my_ids = encode(query["reference_text"]), encode(query["text"])
    pos = first_divergence(ref_ids, my_ids)
    if pos is None:
        return None
    ref_token = ref_ids[pos] if pos < len(ref_ids) else eos_token_id
    token = my_ids[pos] if pos < len(my_ids) else eos_token_id
    return {"key": query["key"], "prompt_token_ids": query["prompt_token_ids"],
            "prefix_token_ids": ref_ids[:pos],
            "tokens": [t for t in dict.fromkeys((ref_token, token)) if t is not None],
            "served": {"token_position": pos, "reference_token": ref_token, "token": token}}


def compute(request: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
             "auto": "auto"}.get(request["dtype"], request["dtype"])
    queries = list(request["queries"])
    if any("reference_text" in q for q in queries):
        tokenizer = AutoTokenizer.from_pretrained(request["target"])

        def encode(text: str) -> list[int]:
            return list(tokenizer.encode(text, add_special_tokens=False))

        queries = [q if "reference_text" not in q else text_query(q, encode,
                                                                 tokenizer.eos_token_id)
                   for q in queries]
    model = AutoModelForCausalLM.from_pretrained(request["target"], dtype=dtype)
    model.eval()
    out: dict[str, Any] = {}
    with torch.inference_mode():
        for query in filter(None, queries):
            ids = list(query["prompt_token_ids"]) + list(query["prefix_token_ids"])
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            top = torch.topk(logits, 2)
            (id1, id2), (v1, v2) = top.indices.tolist(), top.values.tolist()
            out[query["key"]] = {
                "top1": [id1, v1], "top2": [id2, v2], "margin": v1 - v2,
                "logits": {str(t): logits[t].item() for t in query["tokens"]
                           if 0 <= t < logits.shape[0]},
                **query.get("served", {})}
    return out


def add_to_run(path: str, target: str | None = None, dtype: str | None = None) -> dict[str, Any]:
    """Margins for a run already made (a folder or its result.json), written into it."""
    from benchmarks.compare import upgrade
    from benchmarks.report import write_report
    from benchmarks.summary import attach_margins, divergence_queries, summarize

    json_path = os.path.join(path, "result.json") if os.path.isdir(path) else path
    with open(json_path) as f:
        result = upgrade(json.load(f))
    settings = result["settings"]
    result["summary"] = summarize(result)
    queries = divergence_queries(result, result["summary"])
    request = {"target": target or settings["target"], "dtype": dtype or settings["dtype"],
               "queries": queries}
    margins = compute(request) if queries else {}
    attach_margins(result["summary"], margins)
    result["margins"] = {"status": "ok" if queries else "no divergences",
                         "num_queries": len(queries), "added_after_the_run": True,
                         "method": f"Hugging Face forward of the target, {request['dtype']}"}
    tmp = json_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, json_path)
    write_report(result, os.path.dirname(os.path.abspath(json_path)), plots=False)
    return result


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--add":
        parser = argparse.ArgumentParser(prog="python -m benchmarks.margins --add")
        parser.add_argument("runs", nargs="+", help="run folders or their result.json")
        parser.add_argument("--target", default=None, help="the target's path, if it moved")
        parser.add_argument("--dtype", default=None, help="default: the run's")
        args = parser.parse_args(argv[1:])
        for run in args.runs:
            result = add_to_run(run, args.target, args.dtype)
            print(f"{run}: {result['margins']['num_queries']} divergences measured")
        return
    with open(argv[0]) as f:
        request = json.load(f)
    result = compute(request)
    with open(argv[1], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
