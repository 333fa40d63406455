"""Sampled drafts at temperature > 0: the requests' settings, the drafters' sampling, and the
mixture distribution the target verifies a sampled chain against.

The rule (which drafter's token enters the chain, and why verifying against the mixture is
lossless) is `vote_sampler`'s: pure, derived and tested there. This module is its torch side:

- `RowSampling` reads each drafted request's sampling settings from the runner's input batch
  (temperature, top-k, top-p, its seeded generator); None when every request is greedy, and then
  nothing here runs: greedy drafting and the vote are exactly as before.
- `sample_draft_rows` is what an in-worker drafter does with a forward's logits: greedy rows take
  the argmax; the others sample from softmax(top-k/top-p(logits / T)) and keep that distribution.
  Top-k and top-p follow the target's, so the drafter proposes where the target may emit. Min-p,
  penalties and logits processors are not applied to drafts: any q is lossless (the verifier
  tests min(1, p/q) and recovers from the residual); a q closer to p only accepts more. vLLM's
  own probabilistic drafts apply the temperature only.
- `mixture_rows` builds, for a chain picked by `vote_sampler.pick_mixture_chain`, each position's
  q_j = sum_i share_i q_i: a sampling drafter's kept row, or a point mass on the token of a
  drafter that drafts deterministically (the model-free voters; process and Ray drafters, which
  draft greedily: a point mass that depends on the text only, so still a valid q_i).

Seeds. A seeded request's draft samples and member picks come from its own generator, so with
the fixed lookahead policy and the same batch the same seeds give the same output (tested). The
adaptive controller's plans depend on measured times: with it the lookahead, and with it how
much of each request's random stream a step uses, can differ between runs, and so can a seeded
request's output (its distribution cannot).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

# vLLM's threshold for greedy sampling (`vllm.v1.sample.sampler._SAMPLING_EPS`).
SAMPLING_EPS = 1e-5


@dataclass
class RowSampling:
    """The sampling settings of the requests a drafter drafts for, in the order of its rows."""

    temperature: np.ndarray  # [n] float; <= SAMPLING_EPS: greedy
    top_k: np.ndarray  # [n] int; >= the vocabulary (or <= 0): none
    top_p: np.ndarray  # [n] float; 1: none
    generators: dict[int, torch.Generator]  # row -> the request's own generator (seeded ones)

    @classmethod
    def from_input_batch(cls, input_batch, rows: Sequence[int]) -> RowSampling | None:
        """The settings of input-batch ``rows`` (vLLM's `InputBatch`); None when all are greedy."""
        index = np.asarray(rows, dtype=np.int64)
        temperature = np.asarray(input_batch.temperature_cpu[index], dtype=np.float64)
        if not (temperature > SAMPLING_EPS).any():
            return None
        position = {int(row): i for i, row in enumerate(index)}
        return cls(temperature,
                   np.asarray(input_batch.top_k_cpu[index], dtype=np.int64),
                   np.asarray(input_batch.top_p_cpu[index], dtype=np.float64),
                   {position[row]: gen for row, gen in input_batch.generators.items()
                    if row in position})

    @cached_property
    def sampled(self) -> np.ndarray:
        """[n] bool: which rows sample (temperature > 0); computed once (read per request)."""
        return self.temperature > SAMPLING_EPS

    def take(self, rows: Sequence[int]) -> RowSampling:
        """The settings of ``rows`` (indices into these), renumbered 0.."""
        index = np.asarray(rows, dtype=np.int64)
        position = {int(r): i for i, r in enumerate(index)}
        return RowSampling(self.temperature[index], self.top_k[index], self.top_p[index],
                           {position[r]: g for r, g in self.generators.items() if r in position})


def sample_draft_rows(logits: torch.Tensor, sampling: RowSampling
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft tokens [n], each one's probability under its row's q [n], and q [n, vocab] (the
    distribution each sampled row was drawn from; for greedy rows softmax(logits), unused).

    ``logits``: [n, vocab] float32, one row per entry of ``sampling``.
    """
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p, random_sample

    device = logits.device
    vocab = logits.shape[-1]
    greedy = torch.from_numpy(~sampling.sampled).to(device)
    temperature = torch.from_numpy(
        np.where(sampling.sampled, sampling.temperature, 1.0).astype(np.float32)).to(device)
    scaled = logits / temperature.unsqueeze(1)
    top_k = np.where((sampling.top_k > 0) & (sampling.top_k < vocab), sampling.top_k, vocab)
    # vLLM's dtypes for these (its Triton top-k/top-p kernel asserts them on GPU)
    k = torch.from_numpy(top_k.astype(np.int32)).to(device) if (top_k < vocab).any() else None
    p = (torch.from_numpy(sampling.top_p.astype(np.float32)).to(device)
         if (sampling.top_p < 1.0).any() else None)
    scaled = apply_top_k_top_p(scaled, k, p)
    probs = scaled.softmax(dim=-1, dtype=torch.float32)
    # random_sample divides its input in place: q is kept as it is.
    tokens = random_sample(probs.clone(), sampling.generators)
    tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    return tokens, probs.gather(1, tokens.unsqueeze(1)).squeeze(1), probs


def member_uniforms(count: int, generator: torch.Generator | None) -> list[float]:
    """``count`` uniforms in [0, 1) for the mixture's member picks: from the request's own
    generator when it is seeded (on its device), else from torch's default stream."""
    if generator is None:
        return torch.rand(count, dtype=torch.float64).tolist()
    return torch.rand(count, dtype=torch.float64, generator=generator,
                      device=generator.device).tolist()


def mixture_rows(shares: Sequence[dict[int, float]], drafts: Sequence[Sequence[int]],
                 dists: Sequence[torch.Tensor | None], out: torch.Tensor) -> None:
    """Write q_j = sum_i shares[j][i] q_i(. | chain_<j) into ``out[j]`` for every position of a
    sampled chain (``out``: [>= len(shares), vocab], zeroed). ``dists[i]``: drafter i's kept
    rows [len(drafts[i]), <= vocab] (a sampling drafter), or None (a point mass on its token)."""
    for j, members in enumerate(shares):
        for i, share in members.items():
            rows = dists[i]
            if rows is None:
                out[j, int(drafts[i][j])] += share
            else:
                out[j, : rows.shape[1]].add_(rows[j], alpha=share)


def chain_probs(num_rows: int, vocab: int, device: torch.device | str,
                chains: Sequence[Sequence[int]], rows: Sequence[int],
                shares: Sequence[Sequence[dict[int, float]] | None],
                drafts: Sequence[Sequence[Sequence[int]]],
                dists: Sequence[Sequence[torch.Tensor | None]]) -> torch.Tensor | None:
    """[num_rows, longest chain, vocab] float32: what each chain position is verified against.
    Drafted request ``i`` sits in row ``rows[i]`` with chain ``chains[i]``; a sampling request
    (``shares[i]`` not None) gets its mixture q (`mixture_rows`), the others one-hot rows
    (greedy requests: the verifier reads no q for them; point masses anyway). None when no
    chain has a token."""
    longest = max((len(chain) for chain in chains), default=0)
    if longest == 0:
        return None
    out = torch.zeros((num_rows, longest, vocab), dtype=torch.float32, device=device)
    for i, (chain, row) in enumerate(zip(chains, rows, strict=True)):
        if shares[i] is not None:
            mixture_rows(shares[i], drafts[i], dists[i], out[row])
        elif chain:
            out[row, torch.arange(len(chain)), torch.tensor(chain)] = 1.0
    return out
