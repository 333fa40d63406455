"""Side-by-side benchmarks of speculative decoding methods on Spec-Bench (issue 3).

    python -m benchmarks run --target T --draft D --quick
    python -m benchmarks compare A.json B.json

See benchmarks/README.md. Every method runs in its own fresh process on the same prompts and
settings; one JSON per run holds provenance, settings, all raw per-prompt figures and the summary.
"""

SCHEMA_VERSION = 1
