"""TEST-ONLY: record what each in-worker drafter drafted, request by request.

Run in a generation job's process before its engine starts (`Job(preload=[this file])`, with
``SMURFS_TEST_DRAFT_LOG`` naming the file to append to; never imported by the plugin). Every call
of `InWorkerDrafter.draft_safely` appends one JSON line: the drafter's name and, per request,
``[req_id, context length, tokens drafted]``, and under ``drafts`` each request's
``[token, whether the token occurs in the text of a request of the call]`` pairs. A request's
context grows every step, so ``(req_id, context length)`` names one step of one request.
"""

from __future__ import annotations

import json
import os

from vllm_smurfs.drafters.in_worker import InWorkerDrafter

_LOG = os.environ["SMURFS_TEST_DRAFT_LOG"]
_draft_safely = InWorkerDrafter.draft_safely


def draft_safely_recorded(self, req_ids, rows, contexts, caps, runner, stop, *args, **kwargs):
    result = _draft_safely(self, req_ids, rows, contexts, caps, runner, stop, *args, **kwargs)
    line = {"drafter": self.name,
            "requests": [[r, len(c), len(t)] for r, c, t in zip(req_ids, contexts, result.tokens)],
            "drafts": [[[int(x), any(bool((c == x).any()) for c in contexts)] for x in t]
                       for t in result.tokens]}
    with open(_LOG, "a") as f:
        f.write(json.dumps(line) + "\n")
    return result


InWorkerDrafter.draft_safely = draft_safely_recorded
