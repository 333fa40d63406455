"""Command line: `python -m benchmarks run ...` and `python -m benchmarks compare A.json B.json`."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys

from benchmarks.provenance import REPO_ROOT
from benchmarks.spec_bench import FAMILIES

DEFAULT_DATASET = os.path.normpath(os.path.join(REPO_ROOT, "..", "shared", "data", "spec_bench",
                                                "question.jsonl"))
FULL_METHODS = ("none,none@1thread,ngram:4,draft_model:2,draft_model:4,draft_model:6,suffix:4,"
                "smurfs:6,smurfs:6@1thread,smurfs/fixed:2,smurfs/fixed:4,smurfs/sync:2")
QUICK_METHODS = "none,ngram:4,draft_model:4,smurfs:4"
#: (prompts per family, max_tokens) of each mode. Full is sized to finish batch 1 of every
#: method in about an hour on a 2-core machine; `--prompts-per-family 0 --max-tokens 256` is
#: the whole of Spec-Bench (days here).
QUICK = (2, 64)
FULL = (3, 80)
#: Variants every run knows (a --variant of the same name replaces one): Smurfs with a fixed
#: lookahead, Smurfs synchronous with a fixed lookahead, vLLM's batch-size lookahead table,
#: Smurfs with the suffix voter beside its drafters.
PRESET_VARIANTS: dict[str, dict] = {
    "suffix": {"+drafters": [{"method": "suffix"}]},
    "fixed": {"lookahead": {"policy": "fixed"}},
    "sync": {"pipeline": False, "lookahead": {"policy": "fixed"}},
    "table": {"num_speculative_tokens_per_batch_size": [[1, 1, 6], [2, 8, 4], [9, 256, 2]]},
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="measure methods side by side on Spec-Bench",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    run.add_argument("--target", required=True, help="target model path")
    run.add_argument("--draft", action="append", default=[],
                     help="draft model path (draft_model uses the first, Smurfs all); repeatable")
    run.add_argument("--dataset", default=DEFAULT_DATASET, help="Spec-Bench question.jsonl")
    run.add_argument("--methods", default=None,
                     help=f"comma-separated NAME[:K][@PLACEMENT]; default quick: {QUICK_METHODS};"
                          f" full: {FULL_METHODS}")
    run.add_argument("--baseline", default=None,
                     help="label speedups are relative to (default: the first 'none' method)")
    run.add_argument("--quick", action="store_true",
                     help=f"{QUICK[0]} prompts per family, max_tokens {QUICK[1]}, "
                          f"methods {QUICK_METHODS} (each overridable)")
    run.add_argument("--prompts-per-family", type=int, default=None,
                     help=f"0 for all (default: quick {QUICK[0]}, full {FULL[0]})")
    run.add_argument("--families", default=",".join(FAMILIES))
    run.add_argument("--num-prompts", type=int, default=None,
                     help="at most this many of the selected prompts, taken in turn from each "
                          "family (e.g. a burst of 16 with --loads batched)")
    run.add_argument("--rounds", type=int, default=1,
                     help="send the selected prompts this many times in a row to the same engine "
                          "(a repeated workload: later rounds find earlier answers in the suffix "
                          "caches); round r's copy of prompt i has index i + r * prompts")
    run.add_argument("--max-tokens", type=int, default=None,
                     help=f"output tokens per prompt (default: quick {QUICK[1]}, full {FULL[1]})")
    run.add_argument("--max-model-len", type=int, default=4096,
                     help="engine context limit; longer prompts are skipped")
    run.add_argument("--dtype", default="bfloat16",
                     help="float32 makes greedy identity exact; bf16 flips near-ties")
    run.add_argument("--loads", default="batch1,served",
                     help="load points among batch1, batched, served (served: one per "
                          "--concurrency value)")
    run.add_argument("--concurrency", type=parse_concurrencies, default="16",
                     help="served: requests in flight, comma-separated (e.g. 1,4,16,32): one "
                          "server per method, one `vllm bench serve` per value, in this order, "
                          "recorded as load points served@c<N>")
    run.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--no-chat-template", action="store_true",
                     help="send raw prompts even when the tokenizer has a chat template")
    run.add_argument("--kv-cache-gib", type=float, default=2.0,
                     help="target KV cache (VLLM_CPU_KVCACHE_SPACE)")
    run.add_argument("--ngram-min", type=int, default=2, help="vLLM ngram and Smurfs' voter")
    run.add_argument("--ngram-max", type=int, default=4, help="vLLM ngram and Smurfs' voter")
    run.add_argument("--smurfs-extra", type=json.loads, default={},
                     help="JSON object merged into the Smurfs speculative config")
    run.add_argument("--variant", "--smurfs-variant", dest="variant", action="append",
                     default=[], metavar="NAME=JSON",
                     help="a named JSON object merged into a method's speculative config, run "
                          "as METHOD/NAME:K with any speculative method (draft_model/table:6, "
                          "ngram/long:8, smurfs/sync:4); repeatable; --smurfs-variant is an "
                          "alias kept from when only Smurfs had variants (e.g. "
                          "sync='{\"pipeline\": false}'); built in: "
                          + "; ".join(f"{k}={json.dumps(v)}" for k, v in PRESET_VARIANTS.items()))
    run.add_argument("--no-smurfs-ngram", action="store_true",
                     help="Smurfs without the n-gram voter")
    run.add_argument("--method-timeout-s", type=float, default=None,
                     help="per method and load (default: 900 + 2 s per output token asked)")
    run.add_argument("--no-margins", action="store_true",
                     help="skip the target forward that measures top-2 margins at divergences")
    run.add_argument("--no-plots", action="store_true")
    run.add_argument("--interleave", action="store_true",
                     help="offline loads: start every method's engine at once and time each "
                          "prompt for every method in turn, one computing at a time (robust to "
                          "a machine whose speed drifts; the engines' memory must fit together)")
    run.add_argument("--glibc-malloc-defaults", action="store_true",
                     help="leave glibc's allocator thresholds dynamic (by default every method "
                          "runs with MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ fixed)")
    run.add_argument("--repeat", type=int, default=1,
                     help="passes of the whole run, the method order reversed every other pass; "
                          "each in OUT/pass-<i>, and OUT/repeats.md with every pass's speedup, "
                          "their geometric mean and a 95%% interval (the noise here is 8-11%%)")
    run.add_argument("--seed-per-pass", action="store_true",
                     help="with --repeat: pass i samples with seed --seed + i - 1, so that at "
                          "temperature > 0 no method's single draw of texts sits in every pass "
                          "(each method samples texts of its own)")
    run.add_argument("--out", default=None,
                     help="output folder (default: benchmarks/results/tmp/<time>-<mode>)")

    compare = sub.add_parser("compare", help="two result JSONs side by side with ratios")
    compare.add_argument("a")
    compare.add_argument("b")
    compare.add_argument("--family", default="overall",
                         help="a family instead of overall: " + ", ".join(FAMILIES))

    repeats = sub.add_parser("repeats", help="speedups over several runs of the same methods: "
                                             "per pass, geometric mean, 95%% interval")
    repeats.add_argument("results", nargs="+", help="run folders or their result.json")
    repeats.add_argument("--out", default=None,
                         help="folder for repeats.json and repeats.md (default: print only)")
    return parser


def parse_concurrencies(text: str) -> list[int]:
    """`1,4,16` of --concurrency into [1, 4, 16] (order kept: the served runs go in it)."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expected comma-separated request counts, e.g. 1,4,16")
    values = []
    for part in parts:
        if not part.isdigit() or int(part) < 1:
            raise argparse.ArgumentTypeError(f"{part!r} is not a request count >= 1 "
                                             "(expected e.g. 1,4,16)")
        values.append(int(part))
    duplicates = sorted({v for v in values if values.count(v) > 1})
    if duplicates:
        raise argparse.ArgumentTypeError(f"{', '.join(map(str, duplicates))} given more than once")
    return values


VARIANT_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # as parse_method reads NAME/VARIANT


def parse_variants(items: list[str]) -> dict[str, dict]:
    """`NAME=JSON` items of --variant (alias --smurfs-variant) into {name: config keys}."""
    variants: dict[str, dict] = {}
    for item in items:
        name, sep, text = item.partition("=")
        try:
            keys = json.loads(text) if sep else None
        except json.JSONDecodeError as exc:
            raise SystemExit(f"--variant {item!r}: invalid JSON ({exc})") from None
        if not name or not isinstance(keys, dict):
            raise SystemExit(f"--variant {item!r}: expected NAME={{JSON object}}, "
                             "e.g. sync='{\"pipeline\": false}'")
        if not VARIANT_NAME.fullmatch(name):
            raise SystemExit(f"--variant {item!r}: the name may hold letters, digits, '_', '.', "
                             "'-' only")
        if name in variants:
            raise SystemExit(f"--variant {name!r} is defined more than once")
        variants[name] = keys
    return variants


def all_variants(items: list[str]) -> dict[str, dict]:
    """The built-in variants, then those of --variant (replacing a built-in of the same name)."""
    return {**PRESET_VARIANTS, **parse_variants(items)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command == "compare":
        from benchmarks.compare import compare, load_result

        print(compare(load_result(args.a), load_result(args.b), args.family))
        return 0
    if args.command == "repeats":
        from benchmarks import repeats

        agg = repeats.aggregate(repeats.load_passes(args.results), args.results)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            repeats.write(agg, args.out)
        print(repeats.render(agg))
        return 0
    if args.repeat < 1:
        build_parser().error(f"--repeat: expected a number of passes >= 1, got {args.repeat}")

    from dataclasses import replace

    from benchmarks.run import RunSettings, run

    per_family, max_tokens = QUICK if args.quick else FULL
    mode = "quick" if args.quick else "full"
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or os.path.join(REPO_ROOT, "benchmarks", "results", "tmp", f"{stamp}-{mode}")
    loads = [x.strip() for x in args.loads.split(",") if x.strip()]
    unknown = sorted(set(loads) - {"batch1", "batched", "served"})
    if unknown:
        build_parser().error(f"--loads: unknown {', '.join(unknown)}; "
                             "expected batch1, batched, served")
    settings = RunSettings(
        target=args.target, drafts=args.draft, dataset=args.dataset,
        methods=args.methods or (QUICK_METHODS if args.quick else FULL_METHODS), out_dir=out,
        baseline=args.baseline, quick=args.quick,
        prompts_per_family=(args.prompts_per_family if args.prompts_per_family is not None
                            else per_family) or None,
        families=[f.strip() for f in args.families.split(",") if f.strip()],
        num_prompts=args.num_prompts, rounds=args.rounds,
        max_tokens=args.max_tokens or max_tokens, max_model_len=args.max_model_len,
        dtype=args.dtype, loads=loads, concurrency=args.concurrency,
        temperature=args.temperature, seed=args.seed, chat=not args.no_chat_template,
        kv_cache_gib=args.kv_cache_gib, ngram_min=args.ngram_min, ngram_max=args.ngram_max,
        smurfs_extra=args.smurfs_extra, smurfs_ngram_voter=not args.no_smurfs_ngram,
        variants=all_variants(args.variant),
        method_timeout_s=args.method_timeout_s, margins=not args.no_margins,
        plots=not args.no_plots, allocator=not args.glibc_malloc_defaults,
        interleave=args.interleave)
    if args.repeat == 1:
        run(settings, argv)
        print(f"[bench] wrote {out}/result.json, summary.md, plots/")
        with open(os.path.join(out, "summary.md")) as f:
            print(f.read())
        return 0
    from benchmarks import repeats

    methods = [m.strip() for m in settings.methods.split(",") if m.strip()]
    passes, dirs = [], []
    for i in range(args.repeat):
        dirs.append(os.path.join(out, f"pass-{i + 1}"))
        print(f"[bench] pass {i + 1} of {args.repeat}", flush=True)
        passes.append(run(replace(settings, out_dir=dirs[-1],
                                  methods=",".join(repeats.method_order(methods, i)),
                                  seed=settings.seed + (i if args.seed_per_pass else 0)), argv))
    os.makedirs(out, exist_ok=True)
    agg = repeats.aggregate(passes, [os.path.relpath(d, out) for d in dirs])
    repeats.write(agg, out)
    print(f"[bench] wrote {out}/pass-*/ and {out}/repeats.json, repeats.md")
    print(repeats.render(agg))
    return 0
