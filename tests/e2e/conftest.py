"""Shared fixtures of the end-to-end tests: tiny models built once, generation runs cached.

Every engine runs in its own process (`smurfs_tools.jobs`), on the real vLLM CPU engine, in
float32: bf16 flips near-ties whenever the computation shape changes, for vLLM's own methods too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
import json
import os
import subprocess
import sys

import pytest

from smurfs_tools.jobs import Job, Result, divergences, run_job
from smurfs_tools.tiny_models import TINY_PROMPTS, TinyFamily, build_tiny_family


def _identity_env() -> dict[str, str]:
    """What token-for-token comparisons need on this machine's platform (`gpu_check.identity_env`:
    nothing on CPU, vLLM's batch-invariant kernels on a GPU), asked of vLLM in a process of its
    own (this one imports no vLLM)."""
    out = subprocess.run([sys.executable, "-m", "smurfs_tools.gpu_check", "identity-env"],
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"could not ask vLLM for its platform:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1])["env"]


# Every engine of the suite runs in a child process, which inherits these (a value set by hand,
# e.g. VLLM_BATCH_INVARIANT=0, is kept).
for _key, _value in _identity_env().items():
    os.environ.setdefault(_key, _value)

# Different budgets per prompt, so some requests finish early while others keep going.
MAX_TOKENS = [8, 64, 16, 64, 3, 48, 64, 32]
LOOKAHEAD = 4


@pytest.fixture(scope="session")
def family(tmp_path_factory: pytest.TempPathFactory) -> TinyFamily:
    return build_tiny_family(tmp_path_factory.mktemp("tiny-models"), num_drafts=3)


def smurfs_config(family: TinyFamily, placement: str = "worker", **extra) -> dict:
    """Smurfs with the three drafts at the fixed lookahead vLLM's draft_model runs use here."""
    return {"method": "smurfs", "num_speculative_tokens": LOOKAHEAD,
            "drafters": [{"model": d, "placement": placement} for d in family.drafts],
            "lookahead": {"policy": "fixed"}, **extra}


def default_config(family: TinyFamily, **extra) -> dict:
    """What a user writes: drafters and an n-gram voter, every other setting at its default
    (in-worker drafters, adaptive lookahead)."""
    return {"method": "smurfs", "num_speculative_tokens": LOOKAHEAD,
            "drafters": [{"model": d} for d in family.drafts]
            + [{"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}], **extra}


def divergence_report(reference: list[list[int]], other: list[list[int]],
                      rerun_reference: Callable[[], Result]) -> str | None:
    """None when ``other`` equals ``reference`` token for token; else where it diverges, the
    tokens there, and whether a second run without speculation (``rerun_reference``) repeats the
    first: a divergence the fault tests have seen a few times in full suite runs (requests 4
    and 5 at tokens 35 and 186, in test_faults' hang cases and test_ray's fault test), never
    with their modules alone; the report tells a flaky reference from a lossy run."""
    found = divergences(reference, other)
    if not found:
        return None
    again = rerun_reference()
    tokens = {i: (reference[i][pos:pos + 3], other[i][pos:pos + 3]) for i, pos in found.items()}
    repeats = "repeats" if again.token_ids == reference else "differs from"
    return (f"diverges from the run without speculation at {found} (reference vs this run's "
            f"tokens there: {tokens}); a second run without speculation {repeats} the first")


@pytest.fixture(scope="session")
def greedy_runs(family: TinyFamily):
    """Cached greedy runs by name: 'none'; in-worker drafters: 'smurfs' (fixed lookahead),
    'smurfs-default' (the default config: adaptive, with the n-gram voter), 'smurfs-adaptive'
    (adaptive, at least one token ahead), 'smurfs-one' (one
    drafter, fixed lookahead: vLLM draft_model's setting); process drafters: 'smurfs-process'
    (pipelined, fixed lookahead), 'smurfs-process-sync' (synchronous), 'smurfs-process-adaptive'
    (pipelined, adaptive lookahead of at least 1); 'draft_model-<i>'."""

    @functools.cache
    def get(name: str) -> Result:
        if name == "none":
            spec = None
        elif name == "smurfs":
            spec = smurfs_config(family)
        elif name == "smurfs-default":
            spec = default_config(family)
        elif name == "smurfs-adaptive":
            # The adaptive controller at least one token ahead: the tiny drafts cost as much as
            # the target, and it would rightly leave them out, leaving nothing to check.
            spec = {**smurfs_config(family), "lookahead": {"policy": "adaptive", "min_tokens": 1}}
        elif name == "smurfs-one":
            spec = {**smurfs_config(family), "drafters": [{"model": family.drafts[0]}]}
        elif name == "smurfs-process":
            spec = smurfs_config(family, "process")
        elif name == "smurfs-process-sync":
            spec = smurfs_config(family, "process", pipeline=False)
        elif name == "smurfs-process-adaptive":
            # At least one token: on tiny models drafting costs more than a target step, and the
            # controller would rightly switch speculation off, leaving nothing to check.
            spec = {**smurfs_config(family, "process"),
                    "lookahead": {"policy": "adaptive", "min_tokens": 1}}
        else:
            index = int(name.rsplit("-", 1)[1])
            spec = {"method": "draft_model", "model": family.drafts[index],
                    "num_speculative_tokens": LOOKAHEAD}
        result = run_job(Job(target=family.target, prompts=list(TINY_PROMPTS),
                             speculative_config=spec, max_tokens=MAX_TOKENS))
        print(f"\n[{name}] lengths={[len(t) for t in result.token_ids]} "
              f"mean_acceptance_length={result.mean_acceptance_length} "
              f"per_position={[round(a, 3) for a in result.acceptance_per_position]}")
        if result.smurfs_stats:
            print(f"[{name}] smurfs_stats={json.dumps(result.smurfs_stats)}")
        return result

    return get
