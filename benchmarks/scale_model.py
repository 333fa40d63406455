"""When a drafter further away pays: predicted speedup against drafter distance (docs/scale.md).

    python -m benchmarks.scale_model [--rtt-ms-node 0.9] [--rtt-ms-remote 2.0] [--json]

A model, not a measurement: it combines step costs and acceptance measured here (or published,
for GPUs) with a drafter's round trip at each distance. Per scenario and distance it picks the
lookahead k (1-4) with the best predicted speedup, as the controller would:

- same worker (in-worker drafter, synchronous): a step is ``t_v + k * t_d`` (the drafter's k
  forwards, then the target verifies k+1 tokens);
- same node or other node (a streaming drafter: process or Ray actor, on a device of its own,
  drafting past the voted chain while the target verifies): a step is
  ``max(t_v, k * t_d) + rtt + (1 - a_k) * k * t_d``: when the target accepts the whole chain
  (probability ``a_k``) the drafts for the next step are already made and only the round trip
  is paid; otherwise the drafter restarts from the target's token and the step waits k forwards.

Expected tokens per step are ``1 + a_1 + ... + a_k`` (``a_i``: the share of steps whose i-th
draft token is accepted, per position, as vLLM counts it); speedup is that over the step time,
against ``t_1`` per token without speculation. Pure (stdlib only).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Scenario:
    name: str
    t_1_ms: float  # target step without speculation (one token)
    t_v_ms: float  # target step verifying a draft (k+1 tokens, k <= 4)
    t_d_ms: float  # one drafter forward (one token, batch 1)
    acceptance: tuple[float, ...]  # a_1..a_4
    source: str  # which figures are measured and which modelled


#: The 0.5B drafter's acceptance per position on the 1.5B target, measured here (Spec-Bench,
#: vLLM's draft_model k=4, benchmarks/results/2026-12-05-inworker-batch1).
MEASURED_ACCEPTANCE = (0.68, 0.55, 0.44, 0.34)

SCENARIOS = (
    Scenario("CPU: Qwen2.5-Coder 1.5B target, 0.5B drafter (2 cores)", 146.0, 146.0, 57.0,
             MEASURED_ACCEPTANCE,
             "measured here: t_v 146 ms (Smurfs' verification step, batch 1), t_d 57 ms (in-worker "
             "0.5B forward on both cores); t_1 taken equal to t_v; assumed: a streaming drafter "
             "has a device of its own as fast (here it would have to take a core from the "
             "target, which halves the target's speed)"),
    Scenario("GPU: 70B target (A100-class, TP), 1B drafter on its own GPU", 30.0, 31.0, 3.0,
             MEASURED_ACCEPTANCE,
             "published: ~25-33 ms per token for a 70B model on A100s at batch 1; modelled: t_v "
             "= t_1 + 1 ms (verification is memory-bound), t_d 3 ms (a 1B forward is launch-"
             "bound), acceptance as measured here"),
    Scenario("GPU: 8B target on one H100, 0.5B drafter on its own GPU", 7.0, 7.3, 2.0,
             MEASURED_ACCEPTANCE,
             "modelled: t_1 from 16 GB of weights over 3.35 TB/s (~5 ms) plus overheads, t_d 2 ms, "
             "acceptance as measured here"),
)


def expected_tokens(acceptance: tuple[float, ...], k: int) -> float:
    return 1.0 + sum(acceptance[:k])


def step_ms(s: Scenario, k: int, rtt_ms: float | None) -> float:
    """One step's predicted time; ``rtt_ms`` None: the drafter is in the target's worker."""
    if rtt_ms is None:
        return s.t_v_ms + k * s.t_d_ms
    all_accepted = s.acceptance[k - 1]
    return max(s.t_v_ms, k * s.t_d_ms) + rtt_ms + (1.0 - all_accepted) * k * s.t_d_ms


def best(s: Scenario, rtt_ms: float | None) -> tuple[float, int]:
    """(speedup, k) at the best lookahead k in 1..4 (1.0, 0: no speculation pays)."""
    options = [(expected_tokens(s.acceptance, k) * s.t_1_ms / step_ms(s, k, rtt_ms), k)
               for k in range(1, len(s.acceptance) + 1)]
    speedup, k = max(options)
    return (speedup, k) if speedup > 1.0 else (1.0, 0)


def table(rtt_ms_node: float, rtt_ms_remote: float) -> list[dict[str, object]]:
    rows = []
    for s in SCENARIOS:
        row: dict[str, object] = {"scenario": s.name}
        for distance, rtt in (("same_worker", None), ("same_node", rtt_ms_node),
                              ("other_node", rtt_ms_remote)):
            speedup, k = best(s, rtt)
            row[distance] = {"speedup": round(speedup, 2), "k": k}
        row["inputs"] = asdict(s)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rtt-ms-node", type=float, default=3.8,
                        help="a streaming drafter's round trip on the same node, ms (measured: "
                        "benchmarks.drafter_rtt)")
    parser.add_argument("--rtt-ms-remote", type=float, default=4.3,
                        help="its round trip from another node, ms (modelled)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = table(args.rtt_ms_node, args.rtt_ms_remote)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print("| scenario | same worker | same node | other node |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        cells = [f"{row[d]['speedup']:.2f}x (k={row[d]['k']})"  # type: ignore[index]
                 for d in ("same_worker", "same_node", "other_node")]
        print(f"| {row['scenario']} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
