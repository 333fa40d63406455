"""Round trip of a draft from a process drafter and from a Ray-actor drafter, on loopback.

    python -m benchmarks.drafter_rtt --draft D --out rtt.json

Each trial tracks a request the drafter has not seen (a ``context_tokens``-token context) and
polls the client as the proposer does until the first ``tokens`` draft tokens are in it: the
round trip of a draft (message out, the drafter's engine steps, the tokens back). The drafter's
own engine time (its reported step seconds) is subtracted to give what the transport adds. The
same drafter client code serves both (`drafters.ray_actor.RayDrafterClient` is a
`drafters.process_client.ModelDrafterClient` with Ray calls for a socket); both run on the same
core. Also measured: an empty Ray actor call (``ray.get(actor.echo.remote())``) on the same cluster.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.provenance import provenance
from vllm_smurfs.config import ModelDrafterConfig
from vllm_smurfs.drafters.process_client import ModelDrafterClient
from vllm_smurfs.drafters.ray_actor import RayDrafterClient


def trials(client: ModelDrafterClient, n: int, context_tokens: int, tokens: int,
           vocab: int) -> list[tuple[float, float]]:
    """(round trip s, drafter engine s) per trial; each trial is a new request."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(n + 3):  # 3 warm-ups
        context = rng.integers(100, vocab, size=context_tokens, dtype=np.int32)
        req_id = f"rtt-{i}"
        busy = client.health.busy_s
        started = time.perf_counter()
        client.track([(req_id, context, tokens, len(context))])
        while len(client.draft_for(req_id, context, tokens)) < tokens:
            client.poll(0.0005)
            if not client.alive:
                raise RuntimeError(f"drafter {client.name} died: {client.health.last_error}")
        elapsed = time.perf_counter() - started
        client.forget([req_id])
        client.poll(0.05)  # let the forget land before the next trial
        if i >= 3:
            out.append((elapsed, client.health.busy_s - busy))
    return out


def measure(placement: str, draft: str, dtype: str, n: int, context_tokens: int, tokens: int,
            cpus: list[int]) -> dict[str, object]:
    spec = ModelDrafterConfig(model=draft, placement=placement, dtype=dtype, cpus=cpus)
    kind = RayDrafterClient if placement == "ray" else ModelDrafterClient
    client = kind(spec, dtype, 2048, 8, False, hang_timeout_s=60.0, cpus=cpus, num_threads=1)
    client.start()
    client.wait_ready(600)
    try:
        vocab = int(client.health.extra["vocab_size"])
        rows = trials(client, n, context_tokens, tokens, vocab)
        row: dict[str, object] = {"placement": placement, "trials": n,
                                  "context_tokens": context_tokens, "draft_tokens": tokens}
        row["round_trip_ms_median"] = 1000 * statistics.median(r for r, _ in rows)
        row["drafter_engine_ms_median"] = 1000 * statistics.median(b for _, b in rows)
        row["transport_ms_median"] = 1000 * statistics.median(r - b for r, b in rows)
        if placement == "ray":
            row["empty_actor_call_ms_median"] = _empty_call_ms(client._ray)
        return row
    finally:
        client.close()


def _empty_call_ms(ray) -> float:  # noqa: ANN001 - the ray module, connected
    @ray.remote(num_cpus=0)
    class Echo:
        async def echo(self, x: int) -> int:
            return x

    actor = Echo.remote()
    ray.get(actor.echo.remote(0))
    times = []
    for i in range(200):
        started = time.perf_counter()
        ray.get(actor.echo.remote(i))
        times.append(time.perf_counter() - started)
    ray.kill(actor)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--context-tokens", type=int, default=64)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--cpus", type=int, nargs="+", default=[1])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    rows = []
    for placement in ("process", "ray"):
        for tokens in args.tokens:
            row = measure(placement, args.draft, args.dtype, args.trials, args.context_tokens,
                          tokens, args.cpus)
            print(json.dumps(row), flush=True)
            rows.append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"provenance": provenance(sys.argv, args.dtype), "rows": rows},
                              indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
