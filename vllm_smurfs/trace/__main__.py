"""``python -m vllm_smurfs.trace TRACE.jsonl ...``: the simulator's command line."""

import sys

from vllm_smurfs.trace.report import main

sys.exit(main())
