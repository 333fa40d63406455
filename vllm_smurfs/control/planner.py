"""One step's plan search: given what the controller has learnt (each request's acceptance
curves, the cost curves), the plan in hand, the best model plan and an experiment with the
models, each priced in expected output tokens against the step's seconds.

`length_controller.LengthController` builds a `StepSearch` per step from its estimates, and
decides between the plans it returns (evidence, exploration budget, probes) and learns from the
outcome; this module only prices and searches. The arithmetic it uses (the greedy path, catch-up
charges) is `plan_search`.

Pure module (stdlib only).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vllm_smurfs.control.plan import PlanRequest, expected
from vllm_smurfs.control.plan_search import (
    CatchUpCharge,
    ModelChoice,
    Point,
    catch_ups,
    charged_catch_up,
    checkpoint_sizes,
    greedy_path,
    ks_of_path,
    marginal,
    spread_steps,
    total_catch_up,
)

__all__ = ["DRAFT_MARGIN", "EXPERIMENT_CATCH_UP_TOKENS", "EXPLORE_DRAFT_TOKENS", "StepSearch"]

# A plan with drafts must promise this much more than the plan without them (the model plan over
# the plan in hand, drafting over not drafting), as a share of the step's worth: predictions
# carry errors of a few percent (acceptance from a request's last steps, step costs that
# drift), and under load, where speculation breaks even at best on a 2-core CPU, a plan that
# only ties pays for them.
DRAFT_MARGIN = 0.03
# An experiment with the model drafters (see `LengthController`'s exploration) drafts
# EXPLORE_DRAFT_TOKENS tokens for the requests cheapest to catch up with, at most
# EXPERIMENT_CATCH_UP_TOKENS of catch-up in all but at least one request.
EXPLORE_DRAFT_TOKENS = 2
EXPERIMENT_CATCH_UP_TOKENS = 256
# A plan may verify at most twice the tokens of the step without drafts, and 8 more, beyond the
# largest token count the target's curve has measured: where nothing is measured the curve is
# extrapolated optimistically (flat), and at 32 requests a first plan of 6 drafts each would
# price 224 tokens like 32 (a tenfold error, seen in the simulator). Each step measured widens
# the region, so a plan grows to its size within a few steps.
TRUST_FACTOR = 2.0
TRUST_TOKENS = 8


class StepSearch:
    """The plans of one step.

    ``hand``: per request, the cumulative acceptance of the chain in hand (as far as it goes);
    ``target``: predicted target seconds for a token count; ``target_max_tokens``: the largest
    count its curve has measured; ``prompt``: predicted prompt-chunk tokens of the step;
    ``overhead_s``: the proposer's own time; ``pass_costs``: per in-worker drafter, seconds of a
    forward over a token count; ``sync_cost``: seconds of a synchronous drafter call for
    (lookahead, requests), None without such drafters; ``chainless``: per request id, the share
    of its steps whose voters have no chain (`acceptance.ChainlessShare`).

    On construction it finds the plan in hand (a prefix of each request's chain, the greedy
    path's best point, taken only with ``DRAFT_MARGIN``) and the step's rate ``rho``: the best
    rate of a step of this batch without its prompt chunk, at least the rate without drafting.
    A plan's worth is ``value``: expected tokens less ``rho`` times its seconds.
    """

    def __init__(self, requests: Sequence[PlanRequest], caps: list[int],
                 hand: list[list[float]], *, target: Callable[[float], float],
                 target_max_tokens: float, prompt: float, overhead_s: float,
                 pass_costs: Sequence[Any], sync_cost: Callable[[int, int], float] | None,
                 chainless: Callable[[str], float], max_lookahead: int, min_lookahead: int,
                 force_models: bool) -> None:
        n = len(requests)
        self.requests = requests
        self.caps = caps
        self.hand = hand
        self.target = target
        self.prompt = prompt
        self.overhead_s = overhead_s
        self.pass_costs = pass_costs
        self.sync_cost = sync_cost
        self.chainless = chainless
        self.max_lookahead = max_lookahead
        self.force_models = force_models
        self.lows = [min(min_lookahead, c) for c in caps]
        self.limit = max(target_max_tokens, TRUST_FACTOR * (n + prompt) + TRUST_TOKENS) - prompt
        path = [p for p in greedy_path(hand, [0] * n) if p.tokens <= self.limit] or \
            greedy_path(hand, [0] * n)[:1]
        self.rho = max(self.rate(p) for p in path)
        none_value = self.value(path[0])
        # The margin is a share of the decode step's worth: the prompt chunk's time is the same
        # in every plan of the step and carries no error of the plan's.
        self.margin = DRAFT_MARGIN * self.rho * (target(path[0].tokens) + overhead_s)
        best_i = max(range(len(path)), key=lambda i: self.value(path[i]))
        if self.value(path[best_i]) - none_value < self.margin:
            best_i = 0
        self.in_hand = best_i > 0  # the plan in hand drafts
        self.hand_point = path[best_i]
        self.hand_ks = ks_of_path(hand, best_i)
        self.hand_value = self.value(self.hand_point)
        # The same plan summed request by request: what model plans replace rows of.
        self._hand_sums = Point(
            sum(expected(q, k) for q, k in zip(hand, self.hand_ks, strict=True)),
            float(sum(1 + k for k in self.hand_ks)))
        self.verify_s = marginal(target, self.hand_point.tokens + prompt, max(1, n))

    def value(self, p: Point) -> float:
        """Expected tokens less ``rho`` times the step's seconds (its prompt chunk included)."""
        return p.expected - self.rho * (self.target(p.tokens + self.prompt) + self.overhead_s
                                        + p.extra_s)

    def rate(self, p: Point) -> float:
        """Expected tokens per second of a step at ``p`` without its prompt chunk."""
        return p.expected / max(self.target(p.tokens) + self.overhead_s + p.extra_s, 1e-9)

    def seconds(self, p: Point) -> float:
        """The step's predicted seconds at ``p`` (its prompt chunk included)."""
        return self.target(p.tokens + self.prompt) + self.overhead_s + p.extra_s

    def models_s(self, catch_up: Sequence[CatchUpCharge], num_rows: int, max_k: int) -> float:
        """Seconds the model drafters take for ``num_rows`` requests drafted up to ``max_k``
        tokens: each in-worker drafter's first forward (``catch_up[d]``, charged as
        `CatchUpCharge.seconds` says) and ``max_k - 1`` extensions; a synchronous drafter's
        call."""
        if num_rows <= 0 or max_k <= 0:
            return 0.0
        total = 0.0
        for d, cost in enumerate(self.pass_costs):
            if catch_up[d].full > 0:
                total += catch_up[d].seconds(cost) + (max_k - 1) * cost(num_rows)
        if self.sync_cost is not None:
            total += self.sync_cost(max_k, num_rows)
        return total

    def _charged(self, i: int, tokens_per_step: float) -> list[CatchUpCharge]:
        """Request ``i``'s catch-up per drafter as charged to this step (`charged_catch_up`),
        spread over its later chainless steps at ``tokens_per_step``."""
        r = self.requests[i]
        spread = spread_steps(r.remaining, tokens_per_step, self.chainless(r.req_id))
        return [charged_catch_up(c, self.max_lookahead, spread)
                for c in catch_ups(r, len(self.pass_costs))]

    def model_choice(self, can_model: list[int], curves: list[list[float]]
                     ) -> ModelChoice | None:
        """The best model plan, the model drafts valued by ``curves``: requests added by
        decreasing benefit, at every common draft length ``K``; the best (prefix, ``K``) taken.

        A request's model draft goes as far as a token's chance beats its verification (the
        stop rule decides while drafting; here at most ``K``); the forwards are priced as they
        run: the first over every drafted request's catch-up, then ``K - 1`` extensions. Plans of
        more than ``limit`` target tokens are not taken (see TRUST_FACTOR)."""
        nd = len(self.pass_costs)
        caps, lows, hand, hand_ks = self.caps, self.lows, self.hand, self.hand_ks
        rho, verify_s = self.rho, self.verify_s
        base_expected, base_tokens = self._hand_sums.expected, self._hand_sums.tokens
        cands = []
        for i in can_model:
            qs = curves[i]
            top = max(lows[i], 1)
            while top < caps[i] and qs[top] > rho * verify_s:
                top += 1
            top = min(top, caps[i])
            charged = self._charged(i, expected(qs, top))
            # Ordering: what the request gains against its verification and its catch-up.
            net = expected(qs, top) - expected(hand[i], hand_ks[i]) - rho * (
                verify_s * (top - hand_ks[i]) + sum(
                    max(0.0, c.seconds(cost) - cost(1)) for cost, c in zip(self.pass_costs,
                                                                          charged, strict=True)))
            cands.append((net, i, top, charged))
        if not cands:
            return None
        cands.sort(key=lambda c: -c[0])
        longest = max(top for _, _, top, _ in cands)
        checkpoints = checkpoint_sizes(len(cands))
        best_at: tuple[int, int] | None = None  # (K, prefix length) of the best so far
        best_value = 0.0
        for K in range(1, longest + 1):
            exp_tokens, tokens = base_expected, base_tokens
            catch_up = [CatchUpCharge()] * nd
            max_k = 0
            for m, (net, i, top, charged) in enumerate(cands, 1):
                if net <= 0 and m > 1 and not self.force_models:
                    break
                k = max(min(top, K), min(lows[i], caps[i]))
                exp_tokens += expected(curves[i], k) - expected(hand[i], hand_ks[i])
                tokens += k - hand_ks[i]
                for d in range(nd):
                    catch_up[d] = catch_up[d] + charged[d]
                max_k = max(max_k, k)
                if tokens > self.limit and not self.force_models:
                    break
                if m not in checkpoints and m < len(cands):
                    continue
                v = self.value(Point(exp_tokens, tokens, self.models_s(catch_up, m, max_k)))
                if best_at is None or v > best_value or (self.force_models and m > best_at[1]):
                    best_at, best_value = (K, m), v
        if best_at is None:
            return None
        K, m = best_at
        rows = [i for _, i, _, _ in cands[:m]]
        ks = {i: max(min(top, K), min(lows[i], caps[i])) for _, i, top, _ in cands[:m]}
        exp_tokens = base_expected + sum(expected(curves[i], k) - expected(hand[i], hand_ks[i])
                                         for i, k in ks.items())
        tokens = base_tokens + sum(k - hand_ks[i] for i, k in ks.items())
        charged_all = [sum((c[3][d] for c in cands[:m]), CatchUpCharge()) for d in range(nd)]
        extra = self.models_s(charged_all, m, max(ks.values()))
        return ModelChoice(rows, ks, best_value, exp_tokens, tokens, extra)

    def experiment(self, candidates: list[int], mean_curves: list[list[float]]
                   ) -> ModelChoice | None:
        """An experiment with the model drafters among ``candidates``: their first
        EXPLORE_DRAFT_TOKENS tokens (at least the lookahead floor) for the requests cheapest to
        catch up with, EXPERIMENT_CATCH_UP_TOKENS of catch-up in all but at least one request,
        valued by the mean estimates ``mean_curves``."""
        if not candidates:
            return None
        caps, lows, hand, hand_ks = self.caps, self.lows, self.hand, self.hand_ks
        nd = len(self.pass_costs)
        rows: list[int] = []
        budget = EXPERIMENT_CATCH_UP_TOKENS
        for i in sorted(candidates, key=lambda i: total_catch_up(self.requests[i])):
            cost = total_catch_up(self.requests[i])
            if rows and cost > budget:
                break
            rows.append(i)
            budget -= cost
        ks = {i: max(min(caps[i], EXPLORE_DRAFT_TOKENS), min(lows[i], caps[i])) for i in rows}
        exp_tokens, tokens = self._hand_sums.expected, self._hand_sums.tokens
        catch_up = [CatchUpCharge()] * nd
        for i in rows:
            exp_tokens += expected(mean_curves[i], ks[i]) - expected(hand[i], hand_ks[i])
            tokens += ks[i] - hand_ks[i]
            for d, c in enumerate(self._charged(i, expected(mean_curves[i], ks[i]))):
                catch_up[d] = catch_up[d] + c
        extra = self.models_s(catch_up, len(rows), max(ks.values()))
        return ModelChoice(rows, ks, self.value(Point(exp_tokens, tokens, extra)),
                           exp_tokens, tokens, extra)

    def experiment_price_s(self, experiment: ModelChoice) -> float:
        """What an experiment loses, by the mean estimates, against the chain in hand: seconds
        at the step's rate."""
        return max(0.0, self.value(self._hand_sums) - experiment.value) / max(self.rho, 1e-9)
