"""Sampling at temperature 1 keeps the target's distribution (a statistical test).

Per run, 400 samples of one prompt in one batch (engine seed 0; per-request seeds are not used:
vLLM's CPU rejection sampler refuses per-request generators, "CPU Generator does not use offset"). Tokens 1 and 2 of each sample come out of a verification
step (token 0 comes from the prefill, before any draft), so their marginal distributions are what
a lossy verifier would change. A chi-square test of homogeneity compares each position's
distribution with and without speculation; the run is rejected when any position's p-value is
below ALPHA / 2 (Bonferroni over the two positions: family-wise significance ALPHA). The control
runs the same test against the first draft model's own distribution (what a verifier that trusted
the drafts would produce) and must be rejected: the test can fail. vLLM's own draft_model is held
to the same test (on CPU it passes only thanks to the rejection_sampler_expand patch).
"""

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from smurfs_tools.jobs import Job, run_job
from smurfs_tools.tiny_models import TINY_PROMPTS

pytestmark = pytest.mark.e2e

NUM_SAMPLES = 400
ALPHA = 0.01
POSITIONS = (1, 2)
MIN_EXPECTED = 5  # chi-square needs expected counts >= 5: rarer tokens are pooled


def homogeneity_p_value(a: list[int], b: list[int]) -> float:
    tokens, counts = np.unique(np.array(a + b), return_counts=True)
    common = {t for t, c in zip(tokens, counts) if c >= 2 * MIN_EXPECTED}
    table = np.array([[sum(x == t for x in sample) for t in sorted(common)]
                      + [sum(x not in common for x in sample)] for sample in (a, b)])
    table = table[:, table.sum(axis=0) > 0]
    return float(chi2_contingency(table)[1])


def sample(model: str, spec=None) -> list[list[int]]:
    job = Job(target=model, prompts=[TINY_PROMPTS[2]] * NUM_SAMPLES, speculative_config=spec,
              max_tokens=3, temperature=1.0)
    result = run_job(job)
    assert all(len(t) == 3 for t in result.token_ids)
    if spec is not None:
        assert result.num_drafts > 0 and result.num_accepted_tokens > 0
        print(f"\nsampling run: mean acceptance length {result.mean_acceptance_length:.3f}")
    return result.token_ids


def min_p_value(reference: list[list[int]], other: list[list[int]]) -> float:
    return min(homogeneity_p_value([t[pos] for t in reference], [t[pos] for t in other])
               for pos in POSITIONS)


def test_sampling_keeps_target_distribution(family):
    reference = sample(family.target)
    # Fixed lookahead, drafted in the step: every verification step checks a full draft.
    # (Pipelined drafters may not have drafted anything yet for 400 three-token requests: drafts
    # are then simply absent, and the verifier under test would not run.)
    fixed = {"method": "smurfs", "num_speculative_tokens": 2, "lookahead": {"policy": "fixed"}}
    runs = {
        "smurfs (in-worker)": sample(family.target, {
            **fixed, "drafters": [{"model": d} for d in family.drafts]}),
        "smurfs (process, synchronous)": sample(family.target, {
            **fixed, "pipeline": False,
            "drafters": [{"model": d, "placement": "process"} for d in family.drafts]}),
        "draft_model": sample(family.target, {"method": "draft_model", "model": family.drafts[0],
                                              "num_speculative_tokens": 2}),
        "control": sample(family.drafts[0]),
    }
    p_values = {name: min_p_value(reference, run) for name, run in runs.items()}
    print(f"min p-value over positions {POSITIONS}: {p_values} "
          f"(reject below {ALPHA / len(POSITIONS)})")
    assert p_values.pop("control") < ALPHA / len(POSITIONS), "control not rejected: no power"
    for name, p_value in p_values.items():
        assert p_value >= ALPHA / len(POSITIONS), name
