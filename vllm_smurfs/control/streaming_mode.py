"""Whether the streaming drafters (process and Ray placements) draft on: the switch and its
hysteresis.

A streaming drafter drafts ahead while the target verifies; its ready tokens cost the step
nothing, but keeping it drafting may (a drafter that shares the target's cores borrows one), and
pausing it drops its requests (it re-prefills them when it drafts again). So the controller
(`length_controller.LengthController`) values every step both ways, the plan in hand with the
streamed drafts on the curve of steps with them and without on the curve without, and
:class:`StreamingSwitch` turns them on or off:

* a switch holds for at least ``DWELL_STEPS`` steps (a switch costs a restart, and a mode's
  estimates need a few steps to show the present);
* on -> off when the plan without them is worth more; off -> on when the plan with them is worth
  more by the margin, or, when only the optimistic estimate of their acceptance says so, as a
  *retry*: within the controller's exploration budget, at most every ``RETRY_STEPS`` steps,
  doubled after each retry that ended with them off again (at most ``MAX_BACKOFF`` doublings).

Pure module (stdlib only).
"""

from __future__ import annotations

from typing import Any

DWELL_STEPS = 8
RETRY_STEPS = 64
MAX_BACKOFF = 6
# How often a request drafted for had a streamed draft ready in time, an exponential average
# over steps with streaming (weight 0.1 on the last), starting at an even chance: the plan
# with streaming, valued while they are off, scales its acceptance by it.
_DELIVERY_SMOOTHING = 0.1
_DELIVERY_START = 0.5


class StreamingSwitch:
    """On or off, with dwell, retries and their backoff (see the module docstring)."""

    def __init__(self, always_on: bool = False) -> None:
        self.always_on = always_on
        self.on = True  # they start drafting: the first steps measure them
        self.switches = 0
        self.retries = 0
        self.exploring = False  # the present "on" period is a retry
        self.delivery = _DELIVERY_START
        self._switched_at = 0
        self._backoff = 0

    @property
    def dwell_steps(self) -> int:
        return DWELL_STEPS

    @property
    def retry_interval(self) -> int:
        return RETRY_STEPS << self._backoff

    def observe_delivery(self, delivered: int, wanted: int) -> None:
        """In a step with streaming: ``delivered`` of ``wanted`` requests had streamed drafts."""
        if wanted > 0:
            self.delivery += _DELIVERY_SMOOTHING * (delivered / wanted - self.delivery)

    def decide(self, step: int, value_on: float, value_off: float, optimistic_on: float,
               margin: float, retry_allowed: bool) -> bool:
        """Switch for the step ``step`` given the values of the plan with streaming and without
        (``optimistic_on``: with the optimistic acceptance); whether it switched."""
        if self.always_on or step - self._switched_at < DWELL_STEPS:
            return False
        if self.on:
            if value_off > value_on:
                if self.exploring:
                    self._backoff = min(self._backoff + 1, MAX_BACKOFF)
                self._set(False, step)
                return True
            if self.exploring:  # a retry that holds: it paid
                self._backoff = 0
                self.exploring = False
            return False
        if value_on > value_off + margin:
            self._set(True, step)
            return True
        if (optimistic_on > value_off + margin and retry_allowed
                and step - self._switched_at >= self.retry_interval):
            self._set(True, step)
            self.exploring = True
            self.retries += 1
            return True
        return False

    def _set(self, on: bool, step: int) -> None:
        self.on = on
        self.exploring = False
        self._switched_at = step
        self.switches += 1

    def snapshot(self) -> dict[str, Any]:
        return {"on": self.on, "switches": self.switches, "retries": self.retries,
                "retry_interval": self.retry_interval, "delivery": round(self.delivery, 4)}
