"""Patch `EngineArgs.add_cli_args`: ``--speculative-config`` also takes the path of a JSON file.

Why: vLLM parses ``--speculative-config`` with ``json.loads`` only; users keep a Smurfs
configuration (several drafters) in a file: ``vllm serve MODEL --speculative-config smurfs.json``.
How: after vLLM builds its parser, the option's ``type`` becomes `load_user_config`, which reads a
file when the value is an existing path and parses inline JSON otherwise (as before).
When it can go: when vLLM accepts a path for ``--speculative-config``.
"""

from __future__ import annotations

import argparse
from typing import Any

from vllm.engine.arg_utils import EngineArgs

from vllm_smurfs.config import load_user_config
from vllm_smurfs.patches._patching import original, replace_attribute

TARGET = EngineArgs
NAME = "add_cli_args"
OPTION = "--speculative-config"


def parse_speculative_config(value: str) -> dict[str, Any]:
    try:
        return load_user_config(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_cli_args(parser, *args, **kwargs):
    parser = original(TARGET, NAME).__func__(parser, *args, **kwargs)
    for action in parser._actions:  # argparse keeps no public index of its actions
        if OPTION in action.option_strings:
            action.type = parse_speculative_config
    return parser


def apply() -> bool:
    return replace_attribute(TARGET, NAME, staticmethod(_add_cli_args))
