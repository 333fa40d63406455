"""What a lookahead policy could gain from knowing more: the target's own confidence, the
drafter's, and oracles of each decision, on a greedy trace recorded at a fixed lookahead.

1. Prediction. Known before drafting, for free: the target's distribution at the token it just
   produced (the logits its sampler had). This recomputes the target's and the drafter's
   distributions along each recorded output offline (Hugging Face `transformers`, float32, the
   prompt and output token ids of the run that wrote the trace) and reports the area under the
   ROC curve (0.5: chance) of features at output position x for "the model's first draft token
   at x was accepted" (`predictability.py`'s target, the same positions):
   `tgt_prev_top`, `tgt_prev_ent` the target's top probability / minus its entropy at the token
   it produced last (known before drafting); `runmean` the request's agreement rate so far;
   `prev+tgt_prev_top` the model's agreement at x-1 plus `tgt_prev_top`; for reference, not known
   before drafting: `tgt_top` the target's top probability at x, `drf_top` the drafter's.
2. Policies, replayed at batch 1 (`vllm_smurfs.trace.simulator.replay`, the trace's costs, at most
   K ahead), against the adaptive controller and the hindsight ceiling (`hindsight`). Each
   step of a request: the model drafts (and its draft alone is verified) where a rule says so,
   else the voters' chain is verified (or nothing, without one). The rules:
   * `score >= threshold` for each feature of 1., the model drafting 1-3 tokens, at the best
     threshold and length of a sweep (chosen in hindsight: a ceiling for the feature);
   * the drafter's confidence: the model drafts on while its last token's top probability
     reaches tau (exact offline: along an accepted draft the drafter saw the target's tokens);
   * oracles: `first` the model drafts where its first token will be accepted; `choice` where its
     accepted run will be longer than the voters' (both with the confidence stop).

`python confidence.py TRACE RESULT_JSON TARGET DRAFT [--max-lookahead K] [--costs TRACE2]`
(K: the most drafted ahead, 3 unless given; TRACE2: price the replays with the cost curves fitted
to another trace, e.g. one whose steps verified every token count where TRACE's fixed k saw one;
RESULT_JSON: the run's result.json, which holds each prompt's token ids and output token ids; the
trace's request i is prompt i - 1: the benchmark's warm-up request comes first). The forwards
(minutes) are kept beside the trace in `TRACE-target-f32.npz` and `TRACE-draft-f32.npz`.
"""
import argparse
import json

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from predictability import auc
from vllm_smurfs.control.fixed import FixedLookahead
from vllm_smurfs.control.plan import Plan
from vllm_smurfs.trace.format import read_trace
from vllm_smurfs.trace.simulator import (
    default_policies,
    fit_pass_cost,
    fit_target_cost,
    hindsight,
    reconstruct,
    replay,
)

K = 3


class ModelWhere(FixedLookahead):
    """The model drafts where ``use[(req_id, x)]`` (absent: True), up to ``k`` tokens and on
    while its last token's top probability reaches ``tau``; elsewhere the voters' chain."""

    def __init__(self, starts, use, k=None, tau=0.0, confidence=None):
        super().__init__(K, 1)
        self.starts, self.use, self.k, self.tau = starts, use, k or K, tau
        self.confidence = confidence or {}  # req_id: the drafter's top probability by output x

    def plan(self, requests, max_lookahead, *, prompt_pending=False):
        ks, rows = [], []
        for i, r in enumerate(requests):
            x = r.num_tokens - self.starts[r.req_id]
            if self.use.get((r.req_id, x), True):
                top = self.confidence.get(r.req_id)
                k = 1
                while (k < min(self.k, r.cap) and top is not None and x + k - 1 < len(top)
                       and top[x + k - 1] >= self.tau):
                    k += 1
                ks.append(min(k if top is not None else self.k, r.cap))
                rows.append(i)
            else:
                ks.append(min(K, r.free_len, r.cap))
        return Plan(lookaheads=ks, model_rows=[rows], streaming=True, mode="rule")


def distributions(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    p = logp.exp()
    return p.max(-1).values.numpy(), (p * logp).sum(-1).numpy(), logits.argmax(-1).numpy()


def cached_distributions(model_path, ids_by_prompt, cache):
    """Per prompt index, `distributions` of the model at ``model_path`` (kept in ``cache``)."""
    try:
        data = np.load(cache)
        return {i: tuple(data[f"{i}_{j}"] for j in range(3)) for i in ids_by_prompt}
    except (OSError, KeyError):
        pass
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    out = {i: distributions(model, ids) for i, ids in ids_by_prompt.items()}
    np.savez_compressed(cache, **{f"{i}_{j}": v[j] for i, v in out.items() for j in range(3)})
    return out


def main(trace_path, result_path, target_path, draft_path, costs_path=None):
    torch.set_num_threads(2)
    result = json.load(open(result_path))
    prompts = result["prompts"]
    per_prompt = result["methods"][0]["loads"]["batch1"]["per_prompt"]
    ids_by_prompt = {int(i): prompts[int(i)]["prompt_token_ids"] + p["output_token_ids"]
                     for i, p in per_prompt.items()}
    stem = trace_path.removesuffix(".jsonl")
    target = cached_distributions(target_path, ids_by_prompt, f"{stem}-target-f32.npz")
    draft = cached_distributions(draft_path, ids_by_prompt, f"{stem}-draft-f32.npz")
    trace = read_trace(trace_path)
    # The trace's request i is prompt i - 1 (request 0: the benchmark's warm-up, left out).
    recorded = reconstruct(trace)
    prompt_of = {r.req_id: int(r.req_id.split("-")[0]) - 1 for r in recorded}
    requests = [r for r in recorded if prompt_of[r.req_id] >= 0]
    starts = {r.req_id: r.prompt for r in requests}

    # 1. Prediction.
    y, keys, checks = [], [], []
    feats = {k: [] for k in ("tgt_prev_top", "tgt_prev_ent", "runmean", "prev+tgt_prev_top",
                             "tgt_top", "drf_top")}
    drafter_top = {}  # req_id: the drafter's top probability at each output position x
    for r in requests:
        index = prompt_of[r.req_id]
        ids = ids_by_prompt[index]
        t_top, t_negent, _ = target[index]
        d_top, _, d_arg = draft[index]
        # x = 0 is the context r.prompt: the logits predicting x's token sit at r.prompt - 1.
        at = r.prompt - 1
        drafter_top[r.req_id] = d_top[at:]
        agree = (r.acc > 0).astype(int)
        for x in range(2, min(len(agree), len(ids) - at - 1)):
            y.append(agree[x])
            keys.append((r.req_id, x))
            feats["tgt_prev_top"].append(t_top[at + x - 1])
            feats["tgt_prev_ent"].append(t_negent[at + x - 1])
            feats["runmean"].append(agree[:x].mean())
            feats["prev+tgt_prev_top"].append(agree[x - 1] + t_top[at + x - 1])
            feats["tgt_top"].append(t_top[at + x])
            feats["drf_top"].append(d_top[at + x])
            checks.append((d_arg[at + x] == ids[at + x + 1]) == agree[x])
    print(f"{trace_path}: {len(y)} positions, the model's first token accepted at "
          f"{np.mean(y):.3f} (the drafter's float32 argmax agrees with the trace's verdict at "
          f"{np.mean(checks):.3f} of them)")
    print("AUC " + ", ".join(f"{k} {auc(v, y):.3f}" for k, v in feats.items()))

    # 2. Policies.
    costs = read_trace(costs_path) if costs_path else trace
    target_cost, drafter_cost = fit_target_cost(costs), fit_pass_cost(costs)
    print("target step (ms) at 1..8 tokens: "
          + " ".join(f"{1000 * target_cost(n):.0f}" for n in range(1, 9))
          + f"; drafter forward at 1 token {1000 * drafter_cost(1):.1f} ms")

    def speed(factory):
        return replay(requests, factory, 1, target_cost, drafter_cost, K).tokens_per_second

    base = speed(default_policies(K)["k=0"])
    rows = {name: speed(factory) / base for name, factory in default_policies(K).items()
            if name != "k=0"}
    rows["hindsight"] = (hindsight(requests, target_cost, drafter_cost, K).tokens_per_second
                         / base)
    for k in range(1, K + 1):
        rows[f"the model drafts {k} in every step"] = speed(
            lambda k=k: ModelWhere(starts, {}, k)) / base
    for name, values in feats.items():
        best = (0.0, 0.0, 0)  # (tokens per second, threshold, tokens the model drafts)
        for t in sorted(set(np.quantile(values, np.linspace(0, 1, 21))))[1:]:
            use = {key: v >= t for key, v in zip(keys, values, strict=True)}
            for k in range(1, K + 1):
                best = max(best, (speed(lambda k=k: ModelWhere(starts, use, k)), t, k))
        rows[f"{name} >= {best[1]:.3f}, the model drafts {best[2]}"] = best[0] / base
    for tau in (0.3, 0.5, 0.6, 0.7, 0.9):
        rows[f"every step, on while the drafter's top prob >= {tau}"] = speed(
            lambda tau=tau: ModelWhere(starts, {}, K, tau, drafter_top)) / base
    first = {(r.req_id, x): bool(r.acc[x] > 0) for r in requests for x in range(len(r.acc))}
    choice = {(r.req_id, x): min(int(r.acc[x]), K) > min(int(r.free_acc[x]),
                                                         int(r.free_len[x]), K)
              for r in requests for x in range(len(r.acc))}
    for name, oracle in (("first", first), ("choice", choice)):
        for tau in (0.0, 0.6):
            rows[f"oracle {name}, on while the drafter's top prob >= {tau}"] = speed(
                lambda o=oracle, tau=tau: ModelWhere(starts, o, K, tau, drafter_top)) / base
    print(f"| policy (batch 1, at most {K} ahead) | x k=0 |\n| --- | --- |")
    for name, value in rows.items():
        print(f"| {name} | {value:.3f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("trace", "result", "target", "draft"):
        parser.add_argument(name)
    parser.add_argument("--max-lookahead", type=int, default=3)
    parser.add_argument("--costs")
    args = parser.parse_args()
    K = args.max_lookahead
    main(args.trace, args.result, args.target, args.draft, args.costs)
