"""Side-by-side benchmarks of speculative decoding methods on Spec-Bench (issue 3).

    python -m benchmarks run --target T --draft D --quick
    python -m benchmarks compare A.json B.json

See benchmarks/README.md. Every method runs in its own fresh process on the same prompts and
settings; one JSON per run holds provenance, settings, all raw per-prompt figures and the summary.
"""

#: 2: served load points are `served@c<N>`, one per --concurrency value (1: a single `served`,
#: concurrency an int); `settings.variants` replaces `settings.smurfs_variants`. `compare` reads 1.
SCHEMA_VERSION = 2
