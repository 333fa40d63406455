"""Acceptance estimation, learnt online from what the target accepted: per position conditional
acceptance of drafts, per request with a global prior (:class:`AcceptanceModel`), with an
optimistic bound for exploration; and the calibration of a drafter's own probabilities
(:class:`ConfidenceCalibration`), which the in-worker stop rule reads; how often a request's
model-free voters have no chain (:class:`ChainlessShare`), where the models draft; and accepted
over predicted drafts per kind of plan (:class:`PlanYield`), the winner's-curse correction.

Pure module (stdlib only).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from vllm_smurfs.control.feedback import StepFeedback
from vllm_smurfs.control.step_costs import isotonic_regression

# Prior of the conditional acceptance at position 1 before anything was verified: the mean of a
# uniform prior. It weighs one pseudo-observation, so the first verified drafts override it.
_PRIOR_ACCEPTANCE = 0.5
# A position never observed globally inherits the estimate of the position before it, with the
# weight of one observation: after an accepted prefix the next token is, in practice, about as
# predictable as the previous one (copying stays copying). Without it position 8 would sit at the
# 0.5 prior until a draft of 8 had reached it, i.e. long drafts would look worse than they are.
_POSITION_PRIOR_STRENGTH = 1.0
# The global estimate is the prior of new requests and of positions a request has not reached
# recently. It forgets with a time constant of 256 verified drafts: ~8 steps at 32 requests,
# ~256 steps at batch 1, long enough to be a stable average over many requests and short enough
# to follow a change of workload (a new benchmark, a new prompt mix) within a few seconds.
_DEFAULT_GLOBAL_MEMORY = 256.0
# Per request, counts decay with a half-life of 2 steps (factor 0.707 per step, at most ~3.4
# effective observations of position 1): a request that turns from copying text (acceptance
# ~0.9) to free generation (~0.3) has its estimate of the new regime weighted 75% after 4 steps
# and 87% after 6. Longer memories (half-life 8) average over both regimes and keep drafting long
# for ~20 steps after the switch; shorter ones (1) make the estimate a coin flip of the last step.
_DEFAULT_REQUEST_HALF_LIFE_STEPS = 2.0
# The global estimate enters a request's estimate as this many pseudo-observations at every
# position: a new request starts at the global prior, and 1 pseudo-observation against at most
# ~3.4 real ones leaves a request that differs from the average most of its own evidence.
_DEFAULT_PRIOR_STRENGTH = 1.0
# The global evidence also fades with time (steps), not only with new evidence: a plan that is
# not taken gets no new verified drafts, and evidence that never ages would keep a pessimistic
# estimate for good (a controller that talked itself out of model drafting could never learn it
# was wrong). With a time constant of 1024 steps (about 30 requests at batch 1, a minute of
# serving), unused evidence halves in ~700 steps and the optimistic bound widens again.
_DEFAULT_GLOBAL_STEP_MEMORY = 1024.0


# Temperature bands the acceptance is learnt in apart: a sampled draft is accepted with
# probability sum min(p, q), which falls with the temperature (at 1 it is often half the greedy
# acceptance), so one estimate across temperatures would mislead both. Band 0 is greedy; the
# edges split the usual chat settings (0.2-0.5, 0.6-0.8, 1.0) from hotter ones.
TEMPERATURE_BAND_EDGES = (1e-5, 0.55, 0.9, 1.1)


def temperature_band(temperature: float) -> int:
    """The band of a request's temperature: 0 greedy (<= 1e-5, vLLM's threshold), 1 up to 0.55,
    2 up to 0.9, 3 up to 1.1, 4 hotter."""
    for band, edge in enumerate(TEMPERATURE_BAND_EDGES):
        if temperature <= edge:
            return band
    return len(TEMPERATURE_BAND_EDGES)


@dataclass
class _RequestCounts:
    successes: list[float]
    trials: list[float]


class AcceptanceModel:
    """Conditional acceptance ``p_i = P(position i accepted | positions < i accepted)``.

    A verified draft of ``k`` tokens with ``a`` accepted says: positions ``1..a`` accepted,
    position ``a + 1`` rejected (when ``a < k``), later positions unobserved. Counts of trials and
    successes are kept per position, globally (exponential forgetting per verified draft) and per
    request (exponential forgetting per step, shrunk towards the global estimate by
    ``prior_strength`` pseudo-observations).

    Why per position: the naive estimate "accepted / drafted" depends on the lookahead itself (with
    i.i.d. acceptance 0.7 it is 0.60 at k=2 and 0.34 at k=6), so after a change of lookahead it
    drifts for as long as the memory spans old and new drafts: the "mixed period" the paper drops.
    A per-position conditional estimate is updated only at positions a draft actually reached,
    and the evidence there does not depend on how long the draft was, so switching from k=2 to
    k=6 leaves p_1 and p_2 where they were and only starts to fill in p_3..p_6 (which until then
    come from the global prior). Nothing has to be discarded.
    """

    def __init__(
        self,
        max_positions: int,
        request_half_life_steps: float = _DEFAULT_REQUEST_HALF_LIFE_STEPS,
        prior_strength: float = _DEFAULT_PRIOR_STRENGTH,
        global_memory: float = _DEFAULT_GLOBAL_MEMORY,
        global_step_memory: float = _DEFAULT_GLOBAL_STEP_MEMORY,
    ) -> None:
        """Raises ValueError naming the setting when an argument is out of range."""
        if max_positions < 1:
            raise ValueError(f"max_positions must be >= 1, got {max_positions}")
        if not (math.isfinite(request_half_life_steps) and request_half_life_steps > 0):
            raise ValueError(
                f"request_half_life_steps must be finite and > 0, got {request_half_life_steps!r}"
            )
        if not (math.isfinite(prior_strength) and prior_strength > 0):
            raise ValueError(f"prior_strength must be finite and > 0, got {prior_strength!r}")
        if not (math.isfinite(global_memory) and global_memory > 0):
            raise ValueError(f"global_memory must be finite and > 0, got {global_memory!r}")
        if not (math.isfinite(global_step_memory) and global_step_memory > 0):
            raise ValueError(
                f"global_step_memory must be finite and > 0, got {global_step_memory!r}")
        self.max_positions = max_positions
        self.prior_strength = prior_strength
        self.global_memory = global_memory
        self._request_decay = 0.5 ** (1.0 / request_half_life_steps)
        self._step_decay = math.exp(-1.0 / global_step_memory)
        self._g_succ = [0.0] * max_positions
        self._g_trials = [0.0] * max_positions
        self._global_cache: list[float] | None = None
        self._upper_cache: dict[float, list[float]] = {}  # valid while _global_cache is
        self._requests: dict[str, _RequestCounts] = {}

    # -- updates ----------------------------------------------------------------------------
    def tick(self, req_ids: Iterable[str]) -> None:
        """One step passed for these requests: their own evidence decays (drafted for or not).

        Decaying also while a request is not drafted for lets its estimate relax to the global
        one, so a request set to k=0 on bad evidence is reconsidered once that evidence is old.
        The global evidence fades by one step's worth too (``global_step_memory``).
        """
        g = self._step_decay
        for i in range(self.max_positions):
            self._g_succ[i] *= g
            self._g_trials[i] *= g
        self._global_cache = None
        self._upper_cache = {}
        d = self._request_decay
        for req_id in req_ids:
            counts = self._requests.get(req_id)
            if counts is None:
                continue
            s, n = counts.successes, counts.trials
            for i in range(len(s)):
                s[i] *= d
                n[i] *= d

    def observe(self, feedback: Sequence[StepFeedback]) -> None:
        """Add one step's verification outcomes."""
        drafted = [fb for fb in feedback if fb.num_draft_tokens > 0]
        if not drafted:
            return
        g = math.exp(-len(drafted) / self.global_memory)
        gs, gn = self._g_succ, self._g_trials
        for i in range(self.max_positions):
            gs[i] *= g
            gn[i] *= g
        K = self.max_positions
        for fb in drafted:
            counts = self._requests.get(fb.req_id)
            if counts is None:
                counts = self._requests[fb.req_id] = _RequestCounts([0.0] * K, [0.0] * K)
            rs, rn = counts.successes, counts.trials
            a = fb.num_accepted
            for i in range(min(a, K)):
                gs[i] += 1.0
                gn[i] += 1.0
                rs[i] += 1.0
                rn[i] += 1.0
            if a < fb.num_draft_tokens and a < K:
                gn[a] += 1.0
                rn[a] += 1.0
        self._global_cache = None
        self._upper_cache = {}

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._requests.pop(req_id, None)

    # -- estimates --------------------------------------------------------------------------
    def global_acceptance(self, optimism: float = 0.0) -> list[float]:
        """``[p_1, ..., p_max_positions]`` over all requests, each in [0, 1].

        ``optimism`` > 0 gives an upper confidence bound instead of the estimate: each position
        raised by ``optimism`` standard errors of a proportion, ``sqrt(p (1 - p) / (n + 1))``
        with ``n`` its (decayed) observations. Where a plan has seldom been verified the bound
        is wide and the plan looks as good as it may be, so it is tried (bounded by the
        controller's exploration budget); where it has been verified often the bound is the
        estimate.
        """
        if optimism <= 0.0 and self._global_cache is not None:
            return list(self._global_cache)
        if optimism > 0.0 and self._global_cache is not None and optimism in self._upper_cache:
            return list(self._upper_cache[optimism])
        out = []
        prev = _PRIOR_ACCEPTANCE
        for s, n in zip(self._g_succ, self._g_trials, strict=True):
            prev = (s + _POSITION_PRIOR_STRENGTH * prev) / (n + _POSITION_PRIOR_STRENGTH)
            out.append(prev)
        if optimism <= 0.0:
            self._global_cache = out
            return list(out)
        self._global_cache = list(out)
        upper = self._upper_cache[optimism] = [
            min(1.0, p + optimism * math.sqrt(p * (1.0 - p) / (n + 1.0)))
            for p, n in zip(out, self._g_trials, strict=True)]
        return list(upper)

    def global_trials(self) -> list[float]:
        """Effective (decayed) number of observations per position, globally."""
        return list(self._g_trials)

    def request_acceptance(self, req_id: str, optimism: float = 0.0) -> list[float]:
        """``[p_1, ..., p_max_positions]`` of one request (the global estimate if unknown;
        ``optimism``: the global estimate is its upper bound, see `global_acceptance`).

        Each position's own evidence is shrunk towards a prior worth ``prior_strength``
        observations: the global estimate ``g_i``, except that a request doing worse than the
        population at position i-1 gets ``min(g_i, p_{i-1})``. The population's later positions
        are high partly by selection (only copying requests reach them), so they are no evidence
        for a request that fails early; this matters after a change of character, when drafts
        are rejected at position 1, later positions get no fresh evidence, and their old
        evidence says "copying": through the prior they follow position 1 down. A request doing
        better keeps the plain global prior (scaling it up would count the selection twice). In
        the simulator, over requests turning from acceptance 0.9 to 0.3 (batch 1, synchronous
        drafting) this is worth +3% throughput, with mixed workloads unchanged. A new request
        gets exactly the global estimate; position i depends only on positions <= i, so
        evidence at later positions never moves earlier ones.
        """
        glob = self.global_acceptance(optimism)
        counts = self._requests.get(req_id)
        if counts is None:
            return glob
        c = self.prior_strength
        out: list[float] = []
        prev = prev_glob = 1.0
        for s, n, pg in zip(counts.successes, counts.trials, glob, strict=True):
            prior = min(pg, prev) if prev < prev_glob else pg
            prev = (s + c * prior) / (n + c)
            prev_glob = pg
            out.append(prev)
        return out

    def expected_tokens(self, req_id: str, k: int) -> float:
        """``E(k) = 1 + sum_{j<=k} prod_{i<=j} p_i``: tokens a draft of ``k`` yields, bonus
        included.

        Positions beyond ``max_positions`` count as rejected.
        """
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        total, q = 1.0, 1.0
        for p in self.request_acceptance(req_id)[:k]:
            q *= p
            total += q
        return total

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)


# ----------------------------------------------------------------------- confidence calibration

# Bins of the drafter's probability for its token; each starts from the belief that the
# probability is calibrated (acceptance = the bin's centre) with the weight of this many
# observations, so a few hundred verified tokens set the curve.
_CALIBRATION_BINS = 10
_CALIBRATION_PRIOR_STRENGTH = 4.0
# The calibration forgets with a time constant of this many verified tokens (a workload change).
_CALIBRATION_MEMORY = 2048.0


class ConfidenceCalibration:
    """``P(accepted | the draft before it accepted, the drafter's probability c)``, learnt online.

    Binned by ``c``, each bin a Beta estimate starting at the bin's centre; the bins' estimates
    are made non-decreasing in ``c`` (a more confident drafter is never less right) by isotonic
    regression, and forget with a time constant of ``memory`` observations.
    """

    def __init__(self, bins: int = _CALIBRATION_BINS,
                 prior_strength: float = _CALIBRATION_PRIOR_STRENGTH,
                 memory: float = _CALIBRATION_MEMORY) -> None:
        if bins < 1:
            raise ValueError(f"bins must be >= 1, got {bins}")
        if not (prior_strength > 0 and memory > 0):
            raise ValueError("prior_strength and memory must be > 0")
        self.bins = bins
        self.prior_strength = prior_strength
        self._decay = math.exp(-1.0 / memory)
        self._succ = [0.0] * bins
        self._trials = [0.0] * bins
        self._curve: list[float] | None = None
        self.num_observations = 0

    def _bin(self, conf: float) -> int:
        return min(self.bins - 1, max(0, int(conf * self.bins)))

    def observe(self, conf: float, accepted: bool) -> None:
        d = self._decay
        for i in range(self.bins):
            self._succ[i] *= d
            self._trials[i] *= d
        b = self._bin(conf)
        self._succ[b] += 1.0 if accepted else 0.0
        self._trials[b] += 1.0
        self._curve = None
        self.num_observations += 1

    def observe_draft(self, confidences: Sequence[float], matched: int, observed: int) -> None:
        """One draft: its tokens' probabilities, how many leading tokens matched the target's,
        and how many of its positions the target's tokens can judge. Positions after the first
        rejection say nothing (the target's text went elsewhere)."""
        for j in range(min(len(confidences), observed)):
            accepted = j < matched
            self.observe(confidences[j], accepted)
            if not accepted:
                break

    def curve(self) -> list[float]:
        if self._curve is None:
            c = self.prior_strength
            raw = [(s + c * (i + 0.5) / self.bins) / (n + c)
                   for i, (s, n) in enumerate(zip(self._succ, self._trials, strict=True))]
            weights = [n + c for n in self._trials]
            self._curve = isotonic_regression(raw, weights)
        return self._curve

    def __call__(self, conf: float) -> float:
        return self.curve()[self._bin(conf)]


class BandEstimates:
    """What the controller learns of acceptance in one temperature band: the model-free chain's,
    the voted chain's with model drafts (with a model-free chain beside them, and alone: where a
    model draft pays most), and each in-worker drafter's confidence calibration."""

    def __init__(self, max_lookahead: int, num_worker_drafters: int) -> None:
        self.free = AcceptanceModel(max_lookahead)
        self.models = {True: AcceptanceModel(max_lookahead),
                       False: AcceptanceModel(max_lookahead)}
        self.calibrations = [ConfidenceCalibration() for _ in range(num_worker_drafters)]

    def acceptance_models(self) -> list[AcceptanceModel]:
        return [self.free, *self.models.values()]


# The share of a request's steps whose model-free voters have no chain (the steps its catch-up
# is spread over, `plan_search.spread_steps`): its own request-steps, shrunk towards all
# requests' with CHAINLESS_PRIOR_STEPS steps of weight; all requests' start at 1 of 2 and fade
# with a time constant of CHAINLESS_MEMORY request-steps. Whether the voters have a chain does
# not depend on the plan, so this cannot feed back on the models' own use (a share of steps
# with the models, tried before, did: fewer model steps, dearer catch-ups, fewer model steps).
CHAINLESS_PRIOR_STEPS = 4.0
CHAINLESS_MEMORY = 1024.0


class ChainlessShare:
    """(request-steps planned without a model-free chain, request-steps): per request, and all
    requests' (decayed); see CHAINLESS_PRIOR_STEPS."""

    def __init__(self) -> None:
        self.requests: dict[str, list[float]] = {}
        self._all = [1.0, 2.0]

    def observe(self, req_id: str, with_chain: bool) -> None:
        own = self.requests.setdefault(req_id, [0.0, 0.0])
        own[0] += not with_chain
        own[1] += 1.0
        decay = 1.0 - 1.0 / CHAINLESS_MEMORY
        self._all = [decay * self._all[0] + (not with_chain), decay * self._all[1] + 1.0]

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.requests.pop(req_id, None)

    def own_steps(self, req_id: str) -> float:
        """Request-steps of ``req_id`` observed."""
        return self.requests.get(req_id, [0.0, 0.0])[1]

    def __call__(self, req_id: str) -> float:
        """The expected share of ``req_id``'s steps whose model-free voters have no chain."""
        everyone = self._all[0] / self._all[1]
        own = self.requests.get(req_id, [0.0, 0.0])
        return (own[0] + CHAINLESS_PRIOR_STEPS * everyone) / (own[1] + CHAINLESS_PRIOR_STEPS)


# --------------------------------------------------------------------------------- plan yield

# Predicted against realized: the drafts a plan is predicted to get accepted against those
# accepted, summed over the last ~32 steps of its kind (in hand, with the model drafters) with
# a prior of 4 tokens each way. Plans are taken where their estimates are high, so on average
# they are overestimated there (the winner's curse: at 32 requests a predicted gain of 7% came
# out as a loss of 4% in the simulator); the ratio scales each kind's chances back.
YIELD_MEMORY = 32.0
YIELD_PRIOR_TOKENS = 4.0
# The evidence also fades with every step planned, of either kind, with this time constant: a
# kind of plan no longer taken gets no new evidence, and a ratio that never aged held a low value
# for good. (On the real models at batch 1 a first request's experiments put the models' ratio
# at 0.59, then 0.51, and it held for seven prompts in which the models drafted only in
# experiments, every model estimate halved by it, the optimistic bound that decides experiments
# too: math prompts then ran at 0.77-0.81x vLLM's draft_model. With 128, a ratio of 0.60 from
# 13 experiments' evidence is back at 0.76 after 150 steps without model plans. The ratio also
# moves up: experiments on good requests after bad ones raise it, which the simulator's test of
# probes relies on; experiments therefore still count.)
YIELD_STEP_MEMORY = 128.0


class PlanYield:
    """Accepted over predicted drafts of the recent plans of one kind (see YIELD_MEMORY)."""

    def __init__(self) -> None:
        self._predicted = YIELD_PRIOR_TOKENS
        self._accepted = YIELD_PRIOR_TOKENS

    @property
    def factor(self) -> float:
        return self._accepted / self._predicted

    def tick(self) -> None:
        """A step was planned: the evidence fades towards the prior (YIELD_STEP_MEMORY)."""
        g = math.exp(-1.0 / YIELD_STEP_MEMORY)
        self._predicted = YIELD_PRIOR_TOKENS + g * (self._predicted - YIELD_PRIOR_TOKENS)
        self._accepted = YIELD_PRIOR_TOKENS + g * (self._accepted - YIELD_PRIOR_TOKENS)

    def observe(self, predicted: float, accepted: float) -> None:
        """A plan of this kind predicted ``predicted`` accepted drafts; ``accepted`` were."""
        decay = 1.0 - 1.0 / YIELD_MEMORY
        self._predicted = decay * self._predicted + predicted
        self._accepted = decay * self._accepted + accepted
