"""Offline trace simulator: replay the lookahead controller on a recorded trace, in seconds.

The trace format: `vllm_smurfs.trace.format`; the reconstruction of what each drafter would draft at
every position: `vllm_smurfs.trace.reconstruct`.

Replay (:func:`replay`). Requests enter in trace order when one of ``concurrency`` slots is free
and run to their recorded output length; a request's first step is a decode step (its prompt is
not replayed, but its length is what an in-worker drafter catches up with first). Each step the
policy plans, as it does live, from what it would know: the model-free chain's length at each
request's position, each request's catch-up (the replayed drafter follows what it computed) and
remaining tokens. Then, per request:

* a model row drafts the length the plan priced (``Plan.draft_lens``: the live stop rule
  reads the drafter's confidences, which the trace does not hold), its chain accepted as far as
  the model drafts' accepted run at that position (the vote's other drafts are not modelled);
* any other row verifies its model-free chain cut to the plan's lookahead, accepted as far as
  that chain's accepted run.

A step costs the target's curve at its token count (one token per request plus its drafts, and
the prompt tokens of ``prompt_steps``), fitted on the trace's steps
(`control.step_costs.StepCostModel` over every recorded step), plus the in-worker drafter's
forwards: the first over every model row's catch-up, then one per further draft position over the
rows still going, priced on the curve fitted on the trace's ``passes``. The policy is told what it
would be told live: the step's timing, each forward, each request's outcome.

What the replay leaves out: streaming (process and Ray) drafters, the vote among several drafts
of one request (a model row's chain is the model's), prefill steps (only as ``prompt_steps``).

As live, the policy is first told of the drafter's start-up warm-up (each shape twice). Fault
injection for regression tests: ``poison_first_pass_s`` makes the first drafter forward of the
run proper take that long (a first call that built kernels); ``prompt_steps[i] = n``
adds ``n`` prompt-chunk tokens to step ``i`` (its cost and its `StepTiming`); ``pending_steps``
are the steps planned while a prompt is pending (a chunked prefill still going).

Its command line is `trace.report`'s (``python -m vllm_smurfs.trace``: tables of policies
compared, ``--summary`` of a recorded run); the runtime never imports either module.

Pure module (stdlib + numpy, no vllm/torch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_smurfs.control.feedback import StepTiming
from vllm_smurfs.control.fixed import FixedLookahead
from vllm_smurfs.control.plan import DrafterOutcome, Plan, PlanRequest, RequestOutcome
from vllm_smurfs.control.step_costs import StepCostModel
from vllm_smurfs.length_controller import LengthController
from vllm_smurfs.trace.format import (
    TraceFormatError,
    TraceRequest,
    TraceStep,
    read_trace,
    write_trace,
)
from vllm_smurfs.trace.reconstruct import ReplayRequest, acc_from_agreement, reconstruct

__all__ = [
    "NoSpeculation",
    "ReplayRequest",
    "SimResult",
    "SimStep",
    "TraceFormatError",
    "TraceRequest",
    "TraceStep",
    "acc_from_agreement",
    "default_policies",
    "fit_pass_cost",
    "fit_target_cost",
    "hindsight",
    "read_trace",
    "reconstruct",
    "replay",
    "write_trace",
]

Policy = LengthController | FixedLookahead
PolicyFactory = Callable[[], Any]
#: The context limit of replayed requests (the trace does not record the engine's).
_MAX_MODEL_LEN = 1 << 20


class NoSpeculation(FixedLookahead):
    """Never drafts (the k=0 baseline)."""

    def __init__(self) -> None:
        super().__init__(1, 0)

    def plan(self, requests: Sequence[PlanRequest], max_lookahead: int, *,
             prompt_pending: bool = False) -> Plan:
        return Plan(lookaheads=[0] * len(requests), model_rows=[], mode="none")

    def snapshot(self) -> dict[str, Any]:
        return {"policy": "none"}


@dataclass(frozen=True)
class SimStep:
    num_reqs: int
    num_tokens: int  # the target's tokens (prompt tokens included)
    seconds: float  # the target's and the drafter's
    drafter_seconds: float
    model_rows: int


@dataclass
class SimResult:
    total_tokens: int = 0  # output tokens
    total_seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    request_steps: int = 0
    model_request_steps: int = 0
    steps: list[SimStep] = field(default_factory=list)

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def tokens_per_second(self) -> float:
        return self.total_tokens / self.total_seconds if self.total_seconds > 0 else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Output tokens per request and step (1 + accepted drafts)."""
        return self.total_tokens / self.request_steps if self.request_steps else 0.0

    @property
    def model_share(self) -> float:
        """Share of request-steps the model drafter drafted for."""
        return self.model_request_steps / self.request_steps if self.request_steps else 0.0


def fit_target_cost(trace: Sequence[TraceStep]) -> StepCostModel:
    """The target's step seconds by token count, over every recorded step."""
    curve = StepCostModel(window=None, max_age=None, drift_rate=0.0)
    for step in trace:
        curve.observe(step.num_tokens, step.seconds)
    return curve


def fit_pass_cost(trace: Sequence[TraceStep]) -> StepCostModel | None:
    """The in-worker drafter's forward seconds by token count (None: no forward recorded)."""
    passes = [(n, s) for step in trace for _, n, s in step.passes]
    if not passes:
        return None
    curve = StepCostModel(window=None, max_age=None, drift_rate=0.0)
    for n, s in passes:
        curve.observe(n, s)
    return curve


@dataclass
class _Active:
    req: ReplayRequest
    x: int = 0  # output position
    synced: int = 0  # context positions the replayed drafter has computed


def replay(requests: Sequence[ReplayRequest], factory: PolicyFactory, concurrency: int,
           target: Callable[[float], float], drafter: Callable[[float], float] | None,
           max_lookahead: int = 8, *, poison_first_pass_s: float | None = None,
           prompt_steps: Mapping[int, int] | None = None,
           pending_steps: Collection[int] = (),
           on_plan: Callable[[int, Plan, list[PlanRequest]], None] | None = None) -> SimResult:
    """Replay ``requests`` under the policy ``factory()`` (see the module docstring).

    ``target(tokens)`` and ``drafter(tokens)`` price a target step and a drafter forward
    (``drafter`` None: no model drafter, model rows draft nothing). ``prompt_steps``: prompt-chunk
    tokens added to a step's target tokens, by step index; ``pending_steps``: the steps planned
    with a prompt pending (`LengthController.plan`'s ``prompt_pending``). ``on_plan(step, plan,
    plan_requests)`` sees every plan (for tests of the decisions).
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if max_lookahead < 1:
        raise ValueError(f"max_lookahead must be >= 1, got {max_lookahead}")
    policy = factory()
    if getattr(policy, "num_worker_drafters", 0) == 0:
        drafter = None  # a policy without model drafters: nothing to draft with
    if drafter is not None:
        # The start-up warm-up of an in-worker drafter (`InWorkerDrafter.warm_up`): each shape
        # twice.
        for n in [*range(1, max_lookahead + 3), 16, 32, 64, 128, 256, 512, *range(2, 9)]:
            for _ in range(2):
                policy.observe_pass(0, n, drafter(n))
    prompt_steps = dict(prompt_steps or {})
    queue = list(requests)
    active: list[_Active] = []
    result = SimResult()
    poisoned = poison_first_pass_s is None
    step_index = 0
    while queue or active:
        while queue and len(active) < concurrency:
            active.append(_Active(queue.pop(0)))
        plan_reqs = []
        for a in active:
            r = a.req
            context = r.prompt + a.x
            plan_reqs.append(PlanRequest(
                r.req_id, context, _MAX_MODEL_LEN, int(r.free_len[a.x]),
                catch_up=(context - min(a.synced, context - 1),) if drafter else (),
                remaining=r.length - a.x))
        plan = policy.plan(plan_reqs, max_lookahead,
                           prompt_pending=step_index in pending_steps)
        if on_plan is not None:
            on_plan(step_index, plan, plan_reqs)
        model_rows = sorted(plan.model_row_set) if drafter is not None else []
        ks = list(plan.lookaheads)
        drafted = {}
        for i in model_rows:
            ks[i] = min(ks[i], plan.draft_lens.get(i, ks[i]))
            drafted[i] = ks[i]
        passes: list[tuple[int, float]] = []
        if model_rows and drafter is not None:
            catch_up = sum(pr.catch_up[0] for pr, i in
                           ((plan_reqs[i], i) for i in model_rows))
            passes.append((catch_up, drafter(catch_up)))
            for depth in range(2, max(drafted.values()) + 1):
                going = sum(1 for k in drafted.values() if k >= depth)
                passes.append((going, drafter(going)))
        prompt = prompt_steps.get(step_index, 0)
        tokens = prompt
        outcomes = []
        for i, a in enumerate(active):
            r = a.req
            x = a.x
            free_len = int(r.free_len[x])
            free = (DrafterOutcome(free_len, min(free_len, int(r.free_acc[x])), 0)
                    if free_len else None)
            if i in drafted:
                k = drafted[i]
                acc = min(k, int(r.acc[x]))
                a.synced = r.prompt + x + k  # the drafter computed up to its last draft token
            else:
                k = min(ks[i], free_len)
                acc = min(k, int(r.free_acc[x]))
            acc = min(acc, r.length - x - 1)
            produced = acc + 1
            if free is not None:
                free = DrafterOutcome(free.tokens, min(free.matched, produced), produced)
            outcomes.append(RequestOutcome(r.req_id, free=free, voted=(k, acc) if k else None,
                                           models=i in drafted, with_free=free_len > 0))
            result.drafted += k
            result.accepted += acc
            result.total_tokens += produced
            result.request_steps += 1
            result.model_request_steps += i in drafted
            tokens += 1 + k
            a.x += produced
        target_s = target(tokens)
        drafter_s = sum(s for _, s in passes)
        result.total_seconds += target_s + drafter_s
        result.steps.append(SimStep(len(active), tokens, target_s + drafter_s, drafter_s,
                                    len(model_rows)))
        for n, s in passes:
            if not poisoned:
                s, poisoned = float(poison_first_pass_s), True  # type: ignore[arg-type]
            policy.observe_pass(0, n, s)
        policy.observe_step(StepTiming(len(active), tokens, target_s, prompt_tokens=prompt))
        policy.observe(outcomes)
        finished = [a.req.req_id for a in active if a.x >= a.req.length]
        policy.forget(finished)
        active = [a for a in active if a.x < a.req.length]
        step_index += 1
    return result


def hindsight(requests: Sequence[ReplayRequest], target: Callable[[float], float],
              drafter: Callable[[float], float] | None, max_lookahead: int = 8) -> SimResult:
    """The fastest any lookahead policy could serve ``requests`` one at a time (concurrency 1),
    knowing every draft's fate in advance: a ceiling for the controller, not a policy.

    Per request, a shortest path over (output position, the in-worker drafter's catch-up): each
    step either drafts nothing, verifies the model-free chain cut to any length, or has the model
    draft any length up to ``max_lookahead`` (its forwards priced as `replay` prices them: one
    over the catch-up, then one token per further position; afterwards the catch-up is 1), and
    the step's target cost is ``target(1 + drafts)``. Accepted runs are the trace's, as in
    `replay`; ``drafter`` None: the model-free choices only.
    """
    if max_lookahead < 1:
        raise ValueError(f"max_lookahead must be >= 1, got {max_lookahead}")
    target = functools.cache(target)
    drafter = functools.cache(drafter) if drafter is not None else None
    result = SimResult()
    for r in requests:
        # best[(x, gap)]: (seconds to the end, produced, drafts, model) of the best first step.
        # At x the catch-up is 1..x (the model drafted at some earlier step) or prompt + x
        # (never yet); the table is filled from the end back.
        best: dict[tuple[int, int], tuple[float, int, int, int]] = {}

        def rest(x: int, gap: int) -> float:
            return best[(x, gap)][0] if x < r.length else 0.0

        def forwards(gap: int, k: int) -> float:
            """The model's forwards for ``k`` drafts: over the catch-up, then one a position."""
            return drafter(gap) + (k - 1) * drafter(1)  # type: ignore[misc]

        for x in range(r.length - 1, -1, -1):
            room = r.length - x - 1  # drafts past the last token are never accepted
            for gap in [*range(1, x + 1), r.prompt + x]:
                options = [(target(1) + rest(x + 1, gap + 1), 1, 0, 0)]
                for k in range(1, min(int(r.free_len[x]), max_lookahead) + 1):
                    p = min(k, int(r.free_acc[x]), room) + 1
                    options.append((target(1 + k) + rest(x + p, gap + p), p, k, 0))
                if drafter is not None:
                    for k in range(1, max_lookahead + 1):
                        p = min(k, int(r.acc[x]), room) + 1
                        s = target(1 + k) + forwards(gap, k)
                        options.append((s + rest(x + p, 1), p, k, 1))
                best[(x, gap)] = min(options)
        x, gap = 0, r.prompt
        result.total_seconds += rest(x, gap)
        while x < r.length:  # walk the best path for its counts
            _, p, k, model = best[(x, gap)]
            drafter_s = forwards(gap, k) if model else 0.0
            result.steps.append(SimStep(1, 1 + k, target(1 + k) + drafter_s, drafter_s, model))
            result.total_tokens += p
            result.drafted += k
            result.accepted += p - 1
            result.request_steps += 1
            result.model_request_steps += model
            x, gap = x + p, (1 if model else gap + p)
    return result


def default_policies(max_lookahead: int, models: bool = True) -> dict[str, PolicyFactory]:
    """k=0, the model-free voters alone (adaptive), fixed k=1..max with the model drafter, and
    the adaptive controller."""
    out: dict[str, PolicyFactory] = {"k=0": NoSpeculation,
                                     "model-free": lambda: LengthController(max_lookahead, 0)}
    if models:
        for k in range(1, max_lookahead + 1):
            out[f"k={k}"] = lambda k=k: FixedLookahead(k, 1)
        out["adaptive"] = lambda: LengthController(max_lookahead, 1)
    return out
