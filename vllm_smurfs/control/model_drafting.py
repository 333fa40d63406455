"""Whether the model drafters are drafting: the one record of it, and who is told.

The streaming proposer switches its process drafters on for the steps the lookahead policy gives
them, and off otherwise or for a prompt-heavy step (`SmurfsProposer.before_forward`). Several
parts act on the switch: the drafter pool pauses or resumes the drafters' processes and the
target lends its shared cores or takes them back (`cores.ElasticThreads`), the proposer marks the
running requests as catching up, the policy learns what ran (`StepTiming.drafting`) and, when it
is bound to this record, sees the take-backs in its snapshot. They all ask :class:`ModelDrafting`
or are told by it, instead of keeping their own copy of the state.

Pure module (stdlib only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class ModelDrafting:
    """On or off, the steps since it went on, and the listeners told of every switch."""

    def __init__(self) -> None:
        # Consecutive steps with model drafting, up to now (0: off; the first step that gives
        # the drafters work makes the target lend them its shared cores).
        self.steps_on = 0
        self.switches = 0
        self.take_backs = 0  # switched off for a prompt-heavy step (see `take_back`)
        self._listeners: list[Callable[[bool], None]] = []

    @property
    def on(self) -> bool:
        return self.steps_on > 0

    def subscribe(self, listener: Callable[[bool], None]) -> None:
        """``listener(on)`` is called on every switch, in subscription order."""
        self._listeners.append(listener)

    def step(self, drafting: bool) -> bool:
        """This step drafts with the model drafters or not; whether that is a switch (the
        listeners are told first)."""
        switched = drafting != self.on
        if switched:
            self._switch(drafting)
        self.steps_on = self.steps_on + 1 if drafting else 0
        return switched

    def take_back(self) -> bool:
        """Switch off now, for a step that must have the target's cores back; whether they
        were on (nothing happens when off)."""
        if not self.on:
            return False
        self._switch(False)
        self.steps_on = 0
        self.take_backs += 1
        return True

    def _switch(self, on: bool) -> None:
        self.switches += 1
        for listener in self._listeners:
            listener(on)

    def snapshot(self) -> dict[str, Any]:
        return {"on": self.on, "steps_on": self.steps_on, "switches": self.switches,
                "take_backs": self.take_backs}
