"""A fatal device error in an in-worker drafter stops the engine with a message naming it.

After a CUDA device-side assert or an illegal memory access nothing more can run on the device,
the target's kernels included: going on without the drafter (what any other drafter error costs)
would fail the next step with an error that names neither. On CPU the error is injected with
CUDA's own wording (``SMURFS_DRAFTER_FAULT=NAME=device_assert_after:N``), on the real engine.
"""

from __future__ import annotations

import pytest

from smurfs_tools.jobs import Job, run_job
from smurfs_tools.tiny_models import TINY_PROMPTS

from conftest import smurfs_config

pytestmark = pytest.mark.e2e


def test_a_device_assert_in_a_drafter_stops_the_engine_naming_the_drafter(family):
    with pytest.raises(RuntimeError) as info:
        run_job(Job(target=family.target, prompts=list(TINY_PROMPTS),
                    speculative_config=smurfs_config(family), max_tokens=16,
                    env={"SMURFS_DRAFTER_FAULT": "draft-1=device_assert_after:3"}))
    message = str(info.value)
    assert "generation job failed" in message  # the engine stopped: no output came back
    assert ("FatalDrafterError: Smurfs in-worker drafter 'draft-1' hit a fatal device error "
            "(RuntimeError: CUDA error: device-side assert triggered") in message
