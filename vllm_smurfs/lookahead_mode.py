"""When the streaming policy drafts with the model drafters, and when it retries them.

With ``model_free_mode`` (:class:`~vllm_smurfs.length_controller.AdaptiveLookahead`) the policy
plans every step twice, with the model drafters and with the model-free voters only, and
:class:`DrafterModeController` decides which plan is taken: the better predicted rate, with a
margin and a minimum dwell against flapping, and, while the model drafters are left out, a retry
now and then (they learn nothing while out), with a backoff when retries do not pay. It keeps
only this state machine; the rates it weighs come from the planner (`lookahead_plan`).

Pure module (stdlib only), so it can be read and tested on its own.
"""

from __future__ import annotations

from typing import Any

# Switching from model-free drafting to model drafting must promise this much more (relative
# rate). A switch restarts the drafters (a prefill per request) and the first steps after it
# find few drafts ready, which the estimates of the mode learnt earlier omit.
SWITCH_MARGIN = 0.05
# Steps a mode is kept after a switch: each switch costs a restart, and a mode's estimates need a
# few steps to reflect the present.
MIN_DWELL_STEPS = 8
# Without model drafters, their estimates stop learning: now and then the controller retries them,
# each request drafting at least one token, so a change (a lighter load, more predictable text)
# is noticed. A retry starts only in a quiet step (no prompt chunk in the last steps: lending a
# core slows a prefill-heavy step most, and a chunk spoils the measurement) and ends as soon as
# one arrives. It lasts until the model drafters have caught up (re-prefilled the requests they
# dropped when paused; `observe_feedback`'s ``models_ready``) and then one dwell, at most
# ``RETRY_MAX_STEPS``: a retry that ends before the drafters deliver would learn only the
# catch-up. A retry's price is measured: the time its steps took beyond what the step-cost curve
# without model drafting predicts for their token counts (the lent cores, the catch-up). The next
# retry waits ``RETRY_INTERVAL_STEPS`` after the last switch, doubled after every retry that
# ended with the models left out again (at most ``RETRY_MAX_BACKOFF`` doublings: 16384 steps),
# back to 256 once they are kept; and until the last retry's price is at most 1% of the time
# since it began. Where the models never pay (a 2-core CPU) retries thus cost well under 1%.
RETRY_INTERVAL_STEPS = 256
RETRY_MAX_BACKOFF = 6
RETRY_MAX_STEPS = 64
RETRY_BUDGET = 0.01
# Background (prompt) tokens below which a step counts as quiet for a retry: the smoothed
# background of a step after a chunk is half the chunk, so one prompt token keeps it busy for
# about one step, a 256-token chunk for about nine.
QUIET_BACKGROUND = 0.5


class DrafterModeController:
    """Whether the policy's plan drafts with the model drafters: switches, dwell, retries.

    Steps are counted by the caller (``step``: the choice's number, from 1). Per choice the
    caller asks :meth:`retry_due` (then :meth:`start_retry`) or :meth:`retrying`, then
    :meth:`choose_models` with both plans' calibrated rates, and records the outcome with
    :meth:`commit`; after the step it reports :meth:`observe_step` and :meth:`observe_feedback`.
    """

    def __init__(self) -> None:
        self.models_on = True  # the last choice drafts with the model drafters
        self.switches = 0  # model drafting switched on or off (greedy choices and retries)
        self.retries = 0
        self._switched_at = -MIN_DWELL_STEPS  # step of the last switch (dwell, retry interval)
        self._retry_start: int | None = None  # step the retry going on began at (None: none)
        self._retry_ready_steps = 0  # its steps whose feedback came from caught-up drafters
        self._retry_backoff = 0  # doublings of the retry interval (failed retries in a row)
        self._judge_retry = False  # the next greedy choice tells whether the last retry paid
        self._elapsed_s = 0.0  # target step seconds observed so far
        self._retry_started_s = 0.0  # _elapsed_s when the last retry began
        self.retry_cost_s = 0.0  # the last retry's measured price (see RETRY_BUDGET)
        self._planned_retry = False  # whether the last choice was part of a retry

    @property
    def retry_interval_steps(self) -> int:
        """Steps after the last switch before the next retry (the backoff included)."""
        return RETRY_INTERVAL_STEPS << self._retry_backoff

    # -- deciding -----------------------------------------------------------------------------
    def retry_due(self, step: int, background: float) -> bool:
        """Whether a retry starts at ``step`` (only asked while the models are left out)."""
        return (step - self._switched_at >= self.retry_interval_steps
                and background < QUIET_BACKGROUND
                and self.retry_cost_s <= RETRY_BUDGET * (self._elapsed_s - self._retry_started_s))

    def start_retry(self, step: int) -> None:
        """A retry begins at ``step``: the model drafters are switched on for it."""
        self._switched_at = self._retry_start = step
        self._retry_ready_steps = 0
        self._retry_started_s, self.retry_cost_s = self._elapsed_s, 0.0
        self.switches += 1
        self.retries += 1

    def retrying(self, step: int, background: float) -> bool:
        """Whether the retry going on (if any) goes on at ``step``; ends it when it is over: the
        drafters delivered for a dwell, or never within ``RETRY_MAX_STEPS``, or a prompt chunk
        came. The step that ends it is decided afresh (no dwell)."""
        if self._retry_start is None:
            return False
        if (self._retry_ready_steps < MIN_DWELL_STEPS
                and step - self._retry_start < RETRY_MAX_STEPS
                and background < QUIET_BACKGROUND):
            return True
        self._retry_start = None
        self._switched_at = step - MIN_DWELL_STEPS
        self._judge_retry = True
        return False

    def choose_models(self, step: int, rate_models: float, rate_free: float,
                      retrying: bool) -> bool:
        """Whether the greedy choice at ``step`` takes the model plan, given both plans'
        calibrated predicted rates; a retry going on always does (or it learns nothing). The
        first choice after a retry also sets the backoff: left out again, the next retry waits
        twice as long; kept, the interval is back to its start."""
        models = retrying or self._decide(step, rate_models, rate_free)
        if self._judge_retry and not retrying:
            self._retry_backoff = (min(self._retry_backoff + 1, RETRY_MAX_BACKOFF)
                                   if not models else 0)
            self._judge_retry = False
        return models

    def _decide(self, step: int, rate_models: float, rate_free: float) -> bool:
        if step - self._switched_at < MIN_DWELL_STEPS:
            return self.models_on
        if self.models_on:
            return rate_models >= rate_free
        return rate_models > rate_free * (1.0 + SWITCH_MARGIN)

    def commit(self, step: int, models: bool, greedy: bool) -> None:
        """The choice at ``step`` drafts with the model drafters or not; ``greedy``: it was
        the better-rate choice (a switch by exploration or a retry starts no dwell here)."""
        self._planned_retry = models and self._retry_start is not None
        if models != self.models_on:
            if greedy:
                self._switched_at = step
                self.switches += 1
            self.models_on = models

    # -- learning -----------------------------------------------------------------------------
    def observe_step(self, seconds: float, drafting: bool, seconds_without: float | None) -> None:
        """The last choice's target step took ``seconds``, with the model drafters drafting or
        not; ``seconds_without``: what the curve without model drafting predicts for its token
        count (None before it has measured anything): a retry's price is the difference."""
        self._elapsed_s += seconds
        if self._planned_retry and drafting and seconds_without is not None:
            self.retry_cost_s += max(0.0, seconds - seconds_without)

    def observe_feedback(self, drafted: bool, models_ready: bool) -> None:
        """The last choice's feedback: ``drafted``, whether any request had draft tokens;
        ``models_ready``, whether the model drafters had caught up with its requests."""
        if self._retry_start is not None and self.models_on and models_ready and drafted:
            self._retry_ready_steps += 1

    def snapshot(self) -> dict[str, Any]:
        return {
            "models_on": self.models_on,
            "switches": self.switches,
            "retries": self.retries,
            "retry_interval_steps": self.retry_interval_steps,
            "retry_cost_s": round(self.retry_cost_s, 6),
        }
