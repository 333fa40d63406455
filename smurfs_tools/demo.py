"""Demo: the same prompts with no speculation, vLLM's draft_model per draft, and Smurfs.

    python -m smurfs_tools.demo                       # tiny models built (and cached) locally
    python -m smurfs_tools.demo --target T --drafter D1 --drafter D2 --dtype bfloat16 --chat

Prints one table: mean acceptance length, acceptance per position, output tokens/s (generate only,
measured in this run, one engine at a time) and whether every output is identical, token for token
and in length, to no speculation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from smurfs_tools.jobs import Job, Result, divergences, run_job
from smurfs_tools.tiny_models import TINY_PROMPTS, build_tiny_family
from vllm_smurfs.config import suffix_available

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "vllm-smurfs", "tiny-models")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="target model path (default: a tiny model built here)")
    parser.add_argument("--drafter", action="append", default=[],
                        help="draft model path; repeat for several (default: 3 tiny drafts)")
    parser.add_argument("--no-ngram", action="store_true",
                        help="leave the n-gram voter out of the Smurfs ensemble")
    parser.add_argument("--no-suffix", action="store_true",
                        help="leave the suffix voter out of the Smurfs ensemble (it is left out "
                             "anyway where arctic-inference is not installed)")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="use the first N prompts (default: all)")
    parser.add_argument("--prompts-file", help="one prompt per line (default: built-in prompts)")
    parser.add_argument("--dtype", default="float32",
                        help="float32 (default) makes token identity exact; bf16 flips near-ties")
    parser.add_argument("--chat", action="store_true", help="apply the chat template")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE, help="where tiny models are built")
    parser.add_argument("--json", help="also write all figures to this JSON file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.target:
        if not args.drafter:
            sys.exit("--target needs at least one --drafter")
        target, drafts, prompts = args.target, args.drafter, list(TINY_PROMPTS)
    else:
        family = build_tiny_family(args.cache_dir)
        target, drafts, prompts = family.target, args.drafter or family.drafts, list(TINY_PROMPTS)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts = [line.strip() for line in f if line.strip()]
    prompts = prompts[: args.num_prompts] if args.num_prompts else prompts
    k = args.num_speculative_tokens

    methods: list[tuple[str, dict[str, Any] | None]] = [("no speculation", None)]
    for path in drafts:
        methods.append((f"draft_model k={k} ({_short(path)})",
                        {"method": "draft_model", "model": path, "num_speculative_tokens": k}))
    voters: list[dict[str, Any]] = [] if args.no_ngram else [{"method": "ngram"}]
    if not args.no_suffix and suffix_available():
        voters.append({"method": "suffix"})
    smurfs = {"method": "smurfs", "num_speculative_tokens": k,
              "drafters": [{"model": p} for p in drafts] + voters}
    ensemble = " + ".join([f"{len(drafts)} drafts"] + [v["method"] for v in voters])
    # The same lookahead as draft_model, drafts voted on complete: the vote's own worth.
    methods.append((f"smurfs k={k} sync ({ensemble})",
                    {**smurfs, "pipeline": False, "lookahead": {"policy": "fixed"}}))
    # The default: pipelined drafting, adaptive lookahead up to k.
    methods.append((f"smurfs default, k<={k} ({ensemble})", smurfs))

    results: dict[str, Result | str] = {}
    for name, spec in methods:
        print(f"running {name} ...", flush=True)
        job = Job(target=target, prompts=prompts, speculative_config=spec,
                  max_tokens=args.max_tokens, dtype=args.dtype, chat_template=args.chat,
                  max_model_len=args.max_model_len)
        try:
            results[name] = run_job(job)
        except Exception as exc:  # noqa: BLE001 - one failing method must not hide the others
            results[name] = f"failed: {str(exc).strip().splitlines()[-1]}"
    print()
    print(render_table(results))
    if not args.target:
        print("\nTiny models: a target step costs about a millisecond, so tok/s measures the "
              "engines' per-step overhead, not speculation; acceptance and identity are the "
              "figures that carry over (the default's adaptive lookahead rightly drafts little "
              "when drafting costs more than a target step). Run with --target/--drafter on real "
              "models for speed.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_as_json(results, target, drafts, args), f, indent=2)
    return 0


def render_table(results: dict[str, Result | str]) -> str:
    reference = results.get("no speculation")
    header = ("| method | mean acc. len | acceptance per position | tok/s | speedup "
              "| identical to no spec |")
    lines = [header, "| --- | --- | --- | --- | --- | --- |"]
    for name, result in results.items():
        if isinstance(result, str):
            lines.append(f"| {name} | {result} | | | | |")
            continue
        acc = result.mean_acceptance_length
        per_pos = " ".join(f"{a:.2f}" for a in result.acceptance_per_position) or "-"
        speedup = identical = "-"
        if isinstance(reference, Result):
            speedup = f"{result.tokens_per_s / reference.tokens_per_s:.2f}x"
            diff = divergences(reference.token_ids, result.token_ids)
            identical = "yes" if not diff else f"NO ({len(diff)} of {len(result.token_ids)})"
        acc_text = f"{acc:.2f}" if acc is not None else "-"
        lines.append(f"| {name} | {acc_text} | {per_pos} | {result.tokens_per_s:.1f} "
                     f"| {speedup} | {identical} |")
    return "\n".join(lines)


def _short(path: str) -> str:
    return os.path.basename(os.path.normpath(path))


def _as_json(results: dict[str, Result | str], target: str, drafts: list[str],
             args: argparse.Namespace) -> dict[str, Any]:
    from dataclasses import asdict

    return {"target": target, "drafts": drafts, "settings": vars(args),
            "results": {name: (r if isinstance(r, str) else
                               {**asdict(r), "tokens_per_s": r.tokens_per_s,
                                "mean_acceptance_length": r.mean_acceptance_length})
                        for name, r in results.items()}}


if __name__ == "__main__":
    sys.exit(main())
