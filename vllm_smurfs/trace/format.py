"""The step trace the proposer writes (``trace_file``) and the simulator reads.

Trace format: JSON lines, one object per target step, written by the proposer (`proposer.SmurfsProposer`)::

    {"step": 12, "t": 104.233, "seconds": 0.0213, "num_tokens": 144,
     "requests": [{"req_id": "r7", "position": 58, "k": 8, "accepted": 3}, ...],
     "drafts": [{"num_reqs": 16, "num_positions": 1, "seconds": 0.0009}, ...],
     "drafting": true}

* ``step``: step counter; ``t``: monotonic seconds at the end of the step.
* ``seconds``, ``num_tokens``: the target step's wall time and token count
  (:class:`~vllm_smurfs.length_controller.StepTiming`); prefill chunks count in ``num_tokens``.
* ``requests``: the decoding requests of the step: ``position`` is where the step's first new
  token goes (output tokens so far, or the context length: only differences within a request
  are used), ``k`` the draft tokens verified, ``accepted`` how many the target accepted.
* ``drafts``: the :class:`~vllm_smurfs.length_controller.DraftTiming` of the drafter engine
  steps (streaming drafters: one position each) or calls made since the previous step. Replays
  record at most 64 per step (:data:`vllm_smurfs.trace.simulator.MAX_DRAFT_RECORDS`).
* ``drafting`` (optional): whether the streaming drafters drafted during the step (such a
  step may be slower: the target may lend them cores).
* ``prompt_tokens`` (optional): of ``num_tokens``, the prompt-chunk tokens.
* ``passes`` (optional): the in-worker drafters' forwards for the step's drafts, each
  ``[drafter, tokens, seconds]``.
* per request (optional): ``free`` ``[tokens, matched]`` of the model-free voters' chain (its
  match counted as far as the target's tokens tell), ``models`` (model drafts were in its
  vote), ``drafts`` (per in-worker drafter ``[tokens, matched]`` of its own draft, or null).
* ``plan`` (optional, ignored by the reader): what the controller planned for the next step.

Steps without requests are allowed (e.g. pure prefill steps); they only add cost samples.

Pure module (stdlib only).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_smurfs.control.feedback import DraftTiming, StepTiming

__all__ = ["TraceFormatError", "TraceRequest", "TraceStep", "read_trace", "write_trace"]


class TraceFormatError(ValueError):
    """A trace line that does not follow the format; the message names the line and field."""


def _field(obj: Mapping[str, Any], name: str, kind: type, where: str) -> Any:
    if name not in obj:
        raise TraceFormatError(f"{where}: missing field {name!r}")
    value = obj[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise TraceFormatError(f"{where}: {name} must be {kind.__name__}, got {value!r}")
    return value


def _pair(value: Any, where: str) -> tuple[int, int]:
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        raise TraceFormatError(f"{where}: expected [tokens, matched], got {value!r}")
    return value[0], value[1]


def _pass(value: Any, where: str) -> tuple[int, int, float]:
    if (not isinstance(value, list) or len(value) != 3
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
        raise TraceFormatError(f"{where}: expected [drafter, tokens, seconds], got {value!r}")
    return int(value[0]), int(value[1]), float(value[2])


@dataclass(frozen=True)
class TraceRequest:
    """One request in one step of a trace."""

    req_id: str
    position: int  # where the step's first new token goes (only differences matter)
    k: int  # draft tokens verified
    accepted: int  # of those, accepted by the target
    # The model-free voters' chain of the step: (tokens, tokens matching the target's; only as
    # far as the target's tokens tell); None: it had none.
    free: tuple[int, int] | None = None
    models: bool = False  # model drafts (in-worker or streamed) were in its vote
    # Per in-worker drafter, its own draft: (tokens, matched) or None where it did not draft.
    drafts: tuple[tuple[int, int] | None, ...] = ()
    band: int = 0  # its temperature band (`acceptance.temperature_band`; 0: greedy)

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"k must be >= 0, got {self.k}")
        if not 0 <= self.accepted <= self.k:
            raise ValueError(f"accepted must be in [0, k={self.k}], got {self.accepted}")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"req_id": self.req_id, "position": self.position, "k": self.k,
                               "accepted": self.accepted}
        if self.free is not None:
            out["free"] = list(self.free)
        if self.models:
            out["models"] = True
        if any(d is not None for d in self.drafts):
            out["drafts"] = [list(d) if d is not None else None for d in self.drafts]
        if self.band:
            out["band"] = self.band
        return out

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any], where: str = "request") -> TraceRequest:
        fields = (_field(obj, "req_id", str, where), _field(obj, "position", int, where),
                  _field(obj, "k", int, where), _field(obj, "accepted", int, where))
        free = obj.get("free")
        drafts = obj.get("drafts", [])
        try:
            return cls(*fields, free=None if free is None else _pair(free, f"{where}: free"),
                       models=bool(obj.get("models", False)),
                       drafts=tuple(None if d is None else _pair(d, f"{where}: drafts")
                                    for d in drafts),
                       band=int(obj.get("band", 0)))
        except ValueError as e:
            raise TraceFormatError(f"{where}: {e}") from None


@dataclass(frozen=True)
class TraceStep:
    """One target step of a trace (one JSON line)."""

    step: int
    t: float
    seconds: float
    num_tokens: int
    requests: tuple[TraceRequest, ...] = ()
    drafts: tuple[DraftTiming, ...] = ()
    drafting: bool | None = None  # streaming drafters drafted in the step; None: not recorded
    prompt_tokens: int = 0  # of num_tokens, prompt-chunk tokens
    # In-worker drafter forwards made for the step's drafts: (drafter, tokens, seconds).
    passes: tuple[tuple[int, int, float], ...] = ()

    def __post_init__(self) -> None:
        # StepTiming validates seconds, num_tokens and prompt_tokens.
        StepTiming(len(self.requests), self.num_tokens, self.seconds,
                   prompt_tokens=self.prompt_tokens)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "step": self.step, "t": self.t, "seconds": self.seconds,
            "num_tokens": self.num_tokens,
            "requests": [r.to_dict() for r in self.requests],
            "drafts": [{"num_reqs": d.num_reqs, "num_positions": d.num_positions,
                        "seconds": d.seconds} for d in self.drafts],
        }
        if self.drafting is not None:
            out["drafting"] = self.drafting
        if self.prompt_tokens:
            out["prompt_tokens"] = self.prompt_tokens
        if self.passes:
            out["passes"] = [[d, n, round(s, 6)] for d, n, s in self.passes]
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any], where: str = "step") -> TraceStep:
        if not isinstance(obj, Mapping):
            raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        reqs = obj.get("requests", [])
        drafts = obj.get("drafts", [])
        if not isinstance(reqs, list) or not isinstance(drafts, list):
            raise TraceFormatError(f"{where}: requests and drafts must be lists")
        try:
            return cls(
                step=_field(obj, "step", int, where),
                t=_field(obj, "t", float, where),
                seconds=_field(obj, "seconds", float, where),
                num_tokens=_field(obj, "num_tokens", int, where),
                requests=tuple(TraceRequest.from_dict(r, f"{where}: requests[{i}]")
                               for i, r in enumerate(reqs)),
                drafts=tuple(
                    DraftTiming(_field(d, "num_reqs", int, f"{where}: drafts[{i}]"),
                                _field(d, "num_positions", int, f"{where}: drafts[{i}]"),
                                _field(d, "seconds", float, f"{where}: drafts[{i}]"))
                    for i, d in enumerate(drafts)),
                drafting=(None if obj.get("drafting") is None
                          else _field(obj, "drafting", bool, where)),
                prompt_tokens=(_field(obj, "prompt_tokens", int, where)
                               if "prompt_tokens" in obj else 0),
                passes=tuple(_pass(p, f"{where}: passes[{i}]")
                             for i, p in enumerate(obj.get("passes", []))),
            )
        except TraceFormatError:
            raise
        except ValueError as e:  # a value out of range, from a dataclass's validation
            raise TraceFormatError(f"{where}: {e}") from None

    @classmethod
    def from_json(cls, line: str, where: str = "step") -> TraceStep:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{where}: not JSON: {e}") from None
        return cls.from_dict(obj, where)


def read_trace(path: str | Path) -> list[TraceStep]:
    """Read a JSON-lines trace; blank lines are skipped. Errors name the line."""
    steps = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                steps.append(TraceStep.from_json(line, f"{path}:{lineno}"))
    return steps


def write_trace(path: str | Path, steps: Iterable[TraceStep]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(s.to_json() + "\n" for s in steps)
