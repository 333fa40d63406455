"""How fast could any lookahead policy be at temperature > 0 with this drafter pair? An
expected-value oracle, replayed on sampled outputs of the target.

Issue 26 asks Smurfs at temperature 0.7 and 1.0 for >= 1.15x the best vLLM configuration (vLLM's
`ngram` k=4 on Spec-Bench here). This bounds what choosing the lookahead can give at all.

Inputs: the target's own sampled outputs recorded by a benchmark run (`result.json` of
`python -m benchmarks run ... --temperature T`: every method's output is a sample of the target at
T, lossless), the target and the draft model. For each output and each position x of it (the
context: the prompt and the output before x), offline in float32 with Hugging Face
`transformers` at the run's temperature:

* `alpha[x] = sum_y min(p(y), q(y))`: the probability that the draft model's sampled token at x
  is accepted (speculative sampling);
* the n-gram voter's and the suffix voter's chains at x (`vllm_smurfs.drafters.model_free`, the
  voters Smurfs runs; the n-gram one is also vLLM's `ngram`, k=4 its first 4 tokens) and the
  probability the target accepts each prefix of them: prod p(c_i | context, c_<i). Known while
  the chain follows the recorded output; past its first token that does not, the context is not
  the recorded one: `--unknown 1` counts those positions as accepted (optimistic), `0` as
  rejected (pessimistic).

A replay walks each output step by step, as the engine would, with costs from a measured curve
(`--costs`: a trace; the target's step seconds by tokens verified, the drafter's forward by
tokens computed), the draft model's catch-up included (its forward at the first step after a
gap covers the tokens it missed; its first forward computes the prompt). Acceptance is drawn at
random from the probabilities above (`--draws` realizations per output; the output then goes on
along the recorded tokens, an approximation: the accepted drafted tokens are distributed as
min(p, q) / alpha, not as p). Policies:

* `none`; vLLM's `ngram` k=4 (the n-gram chain's first 4 tokens wherever it has one); vLLM's
  `draft_model` k=2 (probabilistic drafts, 2 tokens in every step);
* `oracle`: at each step the option of the highest expected tokens minus rho x seconds (rho: the
  policy's own tokens per second, iterated), over no draft, either voter's chain at 1..K tokens,
  and the draft model at 1..K tokens, knowing each position's exact acceptance probability (what
  no real policy knows), and per output whether to let the model draft at all (in hindsight of
  the realizations' mean time). Not covered: a policy that reads the drafted tokens' own
  probabilities before choosing, and mixtures of the model with the voters' point masses (the
  mixture rule can accept more than either member where they disagree).

`python bound.py RESULT_JSON [RESULT_JSON ...] --target T --draft D --costs TRACE [--passes
1,2] [--max-lookahead 6] [--draws 200] [--unknown 1]` (the forwards, minutes, are kept beside
this script as `arrays-tTEMPERATURE.pkl`).
"""
import argparse
import collections
import functools
import json
import os
import pickle
import random
import sys
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from vllm_smurfs.control.plan import cumulative
from vllm_smurfs.drafters.model_free import NgramVoter, SuffixVoter
from vllm_smurfs.trace.format import read_trace
from vllm_smurfs.trace.simulator import fit_pass_cost, fit_target_cost

SOURCES = ("ngram", "suffix")


@dataclass
class Output:
    """One sampled output and what the replays need of it."""
    label: str  # pass / method / prompt index
    family: str
    prompt_len: int
    tokens: list[int]
    alpha: np.ndarray = None  # [L]
    chains: dict = field(default_factory=dict)  # source -> per x, the chain's tokens
    chain_probs: dict = field(default_factory=dict)  # source -> per x, p of each chain token
    # (None past the first token that leaves the recorded output)


def voter_chains(prompt, outputs, k):
    """Per output, per source, per position x: the voter's chain at prompt + output[:x]. Each
    output has a suffix voter of its own: the outputs of one prompt are samples of the same
    answer, and a global tree holding the others would draft from them (the live engine sees
    each prompt once)."""
    ngram = NgramVoter(2, 4)
    result = []
    for out in outputs:
        suffix = SuffixVoter()
        ids = np.asarray(prompt + out, dtype=np.int64)
        chains = {s: [] for s in SOURCES}
        for x in range(len(out)):
            ctx = ids[: len(prompt) + x]
            chains["ngram"].append(ngram.propose(ctx, k))
            chains["suffix"].append(suffix.propose("r", ctx, k, len(prompt)))
        result.append(chains)
    return result


def output_logprobs(model, prompt, outputs, temperature):
    """Per output, log p(. | prompt + output[:x]) at temperature for x = 0 .. len - 1."""
    with torch.no_grad():
        first = model(torch.tensor([prompt]), use_cache=True)
        cache, last = first.past_key_values, first.logits[0, -1:].float()
        for out in outputs:
            logits = last
            if len(out) > 1:
                rest = model(torch.tensor([out[:-1]]), past_key_values=cache, use_cache=True)
                logits = torch.cat([last, rest.logits[0].float()])
                cache.crop(len(prompt))
            yield torch.log_softmax(logits / temperature, -1)


def arrays(result_paths, target_path, draft_path, passes, k):
    """Every selected output with alpha and its chains' probabilities (forwards cached)."""
    temperature = json.load(open(result_paths[0]))["settings"]["temperature"]
    cache_path = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                              f"arrays-t{temperature}.pkl")
    key = ([os.path.relpath(p, os.path.dirname(cache_path)) for p in result_paths],
           list(passes), k, "a suffix voter per output")
    if os.path.exists(cache_path):
        cached = pickle.load(open(cache_path, "rb"))
        if cached["key"] == key:
            return [Output(**fields) for fields in cached["outputs"]], temperature
    torch.set_num_threads(2)
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_path, dtype=torch.float32).eval()
    by_prompt = {}  # prompt index -> (prompt ids, family, [(label, output ids)])
    for path in result_paths:
        result = json.load(open(path))
        run_pass = int(os.path.basename(os.path.dirname(path)).split("-")[-1])
        if run_pass not in passes:
            continue
        for method in result["methods"]:
            for i, p in method["loads"]["batch1"]["per_prompt"].items():
                prompt = result["prompts"][int(i)]
                entry = by_prompt.setdefault(int(i), (prompt["prompt_token_ids"],
                                                      prompt["family"], []))
                entry[2].append((f"{run_pass}/{method['name']}/{i}", p["output_token_ids"]))
    outputs = []
    for i, (prompt, family, outs) in sorted(by_prompt.items()):
        chains = voter_chains(prompt, [o for _, o in outs], k)
        for (label, out), lp, lq, ch in zip(
                outs, output_logprobs(target, prompt, [o for _, o in outs], temperature),
                output_logprobs(draft, prompt, [o for _, o in outs], temperature), chains,
                strict=True):
            o = Output(label, family, len(prompt), out)
            o.alpha = torch.minimum(lp.exp(), lq.exp()).sum(-1).numpy()
            for s in SOURCES:
                o.chains[s] = ch[s]
                probs = []
                for x, chain in enumerate(ch[s]):
                    row = []
                    for j, tok in enumerate(chain):
                        if x + j >= len(out):
                            break
                        row.append(float(lp[x + j, tok].exp()))
                        if tok != out[x + j]:
                            break  # past this token the context is not the recorded one
                    probs.append(row)
                o.chain_probs[s] = probs
            outputs.append(o)
        print(f"prompt {i} ({family}): {len(outs)} outputs", file=sys.stderr, flush=True)
    pickle.dump({"key": key, "outputs": [vars(o) for o in outputs]}, open(cache_path, "wb"))
    return outputs, temperature


def chain_prefix_probs(o, source, x, k, unknown):
    """P(the first j tokens of the source's chain at x are accepted), j = 1 .. <= k."""
    chain, probs = o.chains[source][x], o.chain_probs[source][x]
    out, acc = [], 1.0
    for j in range(min(k, len(chain), len(o.tokens) - x - 1)):
        acc *= probs[j] if j < len(probs) else unknown
        out.append(acc)
    return out


def model_prefix_probs(alpha, x, k):
    """P(the first j tokens the draft model samples at x are accepted), j = 1 .. <= k (none past
    the output's last token)."""
    return cumulative(np.asarray(alpha[x:len(alpha) - 1], dtype=float).tolist(), k)


def value(option, rho, extra_s=0.0):
    """What a step option is worth at rate ``rho``: its expected tokens (the accepted drafts, as
    the choice assumes them, and the target's own) minus rho x its seconds."""
    return 1 + sum(option[1]) - rho * (option[3] + extra_s)


# What the oracle policies know of the draft model's acceptance when they choose (the replay
# always draws from the exact alpha): each position's (`oracle`), the output's mean over its
# positions (`oracle-request`: what a request's running estimate could at best converge to), one
# mean over every output (`oracle-global`: a single learnt rate). The chains' probabilities are
# exact in all three. `rates` knows no more than a controller that has learnt, over every output,
# one acceptance rate of the model and one per source and chain position (conditional on the
# positions before), and chooses by them alone: the best a per-step choice without per-step
# information reaches.
# `rates-by-agreement` learns the chains' rates apart by what the voters show before drafting:
# whether the n-gram and the suffix voters' chains start with the same token, and how long the
# suffix voter's chain is (its own confidence: it stops at a token under 0.1 of its matches, and
# at its match's length).
# `smurfs-estimates` chooses by the rates the live Smurfs controller had learnt in the runs (its
# temperature band's conditional acceptance of the model's drafts and of the voters' chain at
# the run's last request, averaged over the runs): how the replay prices the live estimates.
KNOWS = {"oracle": "position", "oracle-request": "request", "oracle-global": "global",
         "rates": "global", "rates-by-agreement": "global", "smurfs-estimates": "global"}


def last_controllers(result_paths):
    """Each run's Smurfs controller snapshot at its last request."""
    out = []
    for path in result_paths:
        for method in json.load(open(path))["methods"]:
            if method["name"] == "smurfs":
                per_prompt = method["loads"]["batch1"]["per_prompt"]
                out.append(per_prompt[max(per_prompt, key=int)]["smurfs_stats"]["controller"])
    return out


def live_estimates(controllers):
    """The controllers' temperature band estimates, averaged: (the model's conditional
    acceptance by position, the voters' chain's)."""
    bands = [next(iter(c["bands"].values())) for c in controllers]
    return (np.mean([b["acceptance_models"] for b in bands], axis=0),
            np.mean([b["acceptance_free"] for b in bands], axis=0))


def chain_feature(o, x, policy):
    """The bucket whose rates a rates policy assumes for the chains at x."""
    if policy != "rates-by-agreement":
        return None
    ngram, suffix = o.chains["ngram"][x], o.chains["suffix"][x]
    agree = bool(ngram) and bool(suffix) and ngram[0] == suffix[0]
    return agree, min(len(suffix), 6) // 3  # suffix chain 0-2, 3-5, 6 tokens


def chain_rates(outputs, k, unknown, policy="rates"):
    """Per source and feature bucket, the mean conditional acceptance of its chain at positions
    1..k (a bucket seen fewer than 20 times at a position takes the source's overall rate)."""
    num, den = collections.Counter(), collections.Counter()
    for s in SOURCES:
        for o in outputs:
            for x in range(len(o.tokens)):
                probs = chain_prefix_probs(o, s, x, k, unknown)
                for j, p in enumerate(probs):
                    before = probs[j - 1] if j else 1.0
                    if before > 0:  # (0: a position past one that counts as rejected)
                        for bucket in (None, chain_feature(o, x, policy)):
                            num[s, bucket, j] += p / before
                            den[s, bucket, j] += 1
    rates = collections.defaultdict(lambda: np.zeros(k))
    for (s, bucket, j), n in den.items():
        if bucket is None or n >= 20:
            rates[s, bucket][j] = num[s, bucket, j] / n
    for (s, bucket), r in list(rates.items()):
        rates[s, bucket] = np.where(r > 0, r, rates[s, None])
    return dict(rates)


def plans(o, policy, tc, dc1, k, unknown, rho, model_on, global_alpha, rates=None):
    """Per position x: the best option without the model and the best with it, each as (tokens
    drafted, cumulative acceptance the choice assumes, the exact one, seconds without the model's
    catch-up); the model's is None where it is not an option."""
    out = []
    n_out = len(o.tokens)
    if policy == "smurfs-estimates":
        assumed = None  # (the model's conditional rates by draft position, below)
    elif KNOWS.get(policy) == "request":
        assumed = np.full(n_out, float(o.alpha.mean()))
    elif KNOWS.get(policy) == "global":
        assumed = np.full(n_out, global_alpha)
    else:
        assumed = o.alpha

    for x in range(n_out):
        free = (0, [], [], tc[1])
        model = None
        if policy == "ngram":
            probs = chain_prefix_probs(o, "ngram", x, 4, unknown)
            if probs:
                free = (len(probs), probs, probs, tc[len(probs) + 1])
        elif policy.startswith("draft_model"):
            n = int(policy.removeprefix("draft_model k="))
            probs = model_prefix_probs(o.alpha, x, n)
            if probs:
                model = (len(probs), probs, probs, tc[len(probs) + 1] + (len(probs) - 1) * dc1)
        elif policy in KNOWS:
            for s in SOURCES:
                probs = chain_prefix_probs(o, s, x, k, unknown)
                if policy == "smurfs-estimates":
                    assumed_chain = cumulative(rates["free"], len(probs))
                elif policy.startswith("rates"):
                    assumed_chain = cumulative(rates.get(
                        (s, chain_feature(o, x, policy)), rates[s, None]), len(probs))
                else:
                    assumed_chain = probs
                for j in range(1, len(probs) + 1):
                    option = (j, assumed_chain[:j], probs[:j], tc[j + 1])
                    if value(option, rho) > value(free, rho):
                        free = option
            if model_on:
                exact = model_prefix_probs(o.alpha, x, k)
                probs = (model_prefix_probs(assumed, x, k) if assumed is not None
                         else cumulative(rates["models"], len(exact)))
                for j in range(1, len(probs) + 1):
                    option = (j, probs[:j], exact[:j], tc[j + 1] + (j - 1) * dc1)
                    if model is None or value(option, rho) > value(model, rho):
                        model = option
        out.append((free, model))
    return out


# (policy, family, "model" / "chain" / "none" [+ " tokens"]) -> steps [drafted tokens], over
# every replay of the last run of the policy
COUNTS = collections.Counter()


def replay(o, policy, plan, dc, rng, rho, model_on):
    """Seconds to produce output ``o`` under ``policy`` with the precomputed ``plan``; with
    ``model_on`` the draft model computes the prompt first (as at the target's prefill)."""
    x, synced, seconds = 0, 0, 0.0
    if model_on:
        synced, seconds = o.prompt_len, dc(o.prompt_len)
    while x < len(o.tokens):
        free, model = plan[x]
        option, is_model = free, False
        if model is not None:
            catch_up = dc(o.prompt_len + x - synced)
            if (policy.startswith("draft_model")
                    or value(model, rho, catch_up) > value(free, rho)):
                option, is_model = (model[0], model[1], model[2], model[3] + catch_up), True
        n, _, probs, cost = option
        seconds += cost
        kind = "model" if is_model else ("chain" if n else "none")
        COUNTS[policy, o.family, kind] += 1
        COUNTS[policy, o.family, kind + " tokens"] += n
        voters = o.chain_probs["suffix"][x] or o.chain_probs["ngram"][x]
        if voters:  # the first token's acceptance of a voters' chain, at the steps visited
            COUNTS[policy, "steps with a chain"] += 1
            COUNTS[policy, "chain p1"] += voters[0]
        accepted = 0
        for j in range(n):  # probs are cumulative: P(the first j + 1 accepted)
            if rng.random() < probs[j] / (probs[j - 1] if j else 1.0):
                accepted += 1
            else:
                break
        if is_model:
            synced = o.prompt_len + x + accepted
        x += accepted + 1
    return seconds


# The oracle-global and rates policies let the model draft for prompts up to this long (Smurfs
# defers a drafter's catch-up over 256 tokens until the request's own steps show it pays).
SHORT_PROMPT = 256


def run_policy(outputs, policy, tc, dc, k, draws, unknown, rho=0.0, global_alpha=0.0,
               rates=None):
    """Mean seconds per output (over draws), per output. Whether the model drafts for the output
    at all (and computes its prompt): the oracle and oracle-request choose the faster, in
    hindsight; oracle-global and rates for prompts up to SHORT_PROMPT tokens."""
    for key in [key for key in COUNTS if key[0] == policy]:
        del COUNTS[key]
    times = []
    for n, o in enumerate(outputs):
        best = None
        if policy in KNOWS and KNOWS[policy] != "global":
            choices = (False, True)  # in hindsight
        elif policy in KNOWS:
            choices = (o.prompt_len <= SHORT_PROMPT,)  # Smurfs' default rule
        else:
            choices = (policy != "none" and policy != "ngram",)
        for model_on in choices:
            plan = plans(o, policy, tc, dc(1), k, unknown, rho, model_on, global_alpha, rates)
            rng = random.Random(n)
            t = np.mean([replay(o, policy, plan, dc, rng, rho, model_on) for _ in range(draws)])
            best = t if best is None else min(best, t)
        times.append(best)
    return np.array(times)


def curves_of_runs(controllers):
    """The target's step and the drafter's forward seconds by tokens, as the controllers had them
    (their fitted knots), averaged."""
    target = [np.array(c["target_cost"]["knots"]).T for c in controllers]
    drafter = [np.array(c["drafters"][0]["pass_cost"]["knots"]).T for c in controllers]

    def curve(knots):
        # (the controller's curves hold their last knot's seconds beyond it: so do these)
        return lambda n: float(np.mean([np.interp(n, x, y) for x, y in knots]))
    return curve(target), curve(drafter)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--costs", required=True,
                        help="a trace (.jsonl) to fit the curves to, or 'runs': the Smurfs "
                        "controller's own curves in RESULT_JSON")
    parser.add_argument("--passes", default="1,2")
    parser.add_argument("--max-lookahead", type=int, default=6)
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--unknown", type=float, default=1.0)
    args = parser.parse_args()
    k = args.max_lookahead
    outputs, temperature = arrays(args.results, args.target, args.draft,
                                  [int(p) for p in args.passes.split(",")], k)
    controllers = last_controllers(args.results)
    if args.costs.endswith(".jsonl"):
        trace = read_trace(args.costs)
        target, drafter = fit_target_cost(trace), fit_pass_cost(trace)
    else:
        target, drafter = curves_of_runs(controllers)
    tc = [0.0] + [target(n) for n in range(1, k + 2)]
    dc = functools.lru_cache(maxsize=None)(drafter)
    tokens = np.array([len(o.tokens) for o in outputs])
    families = sorted({o.family for o in outputs}, key=[o.family for o in outputs].index)
    print(f"temperature {temperature}: {len(outputs)} outputs, {tokens.sum()} tokens; target "
          "step (ms) at 1..7 tokens " + " ".join(f"{1000 * target(n):.0f}" for n in range(1, 8))
          + f", drafter forward {1000 * drafter(1):.1f} ms; unknown chain positions count as "
          f"{args.unknown:g}")
    alpha = np.concatenate([o.alpha for o in outputs])
    times = {p: run_policy(outputs, p, tc, dc, k, args.draws, args.unknown)
             for p in ("none", "ngram", "draft_model k=1", "draft_model k=2", "draft_model k=3")}
    live_models, live_free = live_estimates(controllers)
    base_rates = chain_rates(outputs, k, args.unknown)
    rates_of = {"rates": base_rates,
                "rates-by-agreement": chain_rates(outputs, k, args.unknown, "rates-by-agreement"),
                "smurfs-estimates": {"models": live_models, "free": live_free}}
    for policy in KNOWS:
        rates = rates_of.get(policy)
        rho = tokens.sum() / times["ngram"].sum()
        for _ in range(4):  # the policy's own rate
            times[policy] = run_policy(outputs, policy, tc, dc, k, args.draws, args.unknown,
                                       rho, float(alpha.mean()), rates)
            rho = tokens.sum() / times[policy].sum()
    print(f"alpha (the draft model's sampled token accepted): mean {alpha.mean():.3f}, "
          f"median {np.median(alpha):.3f}")
    print("the live controller's estimates (smurfs-estimates), conditional at positions 1..K: "
          "model " + " ".join(f"{r:.2f}" for r in live_models) + "; voters' chain "
          + " ".join(f"{r:.2f}" for r in live_free))
    print("chains' conditional acceptance at positions 1..K (rates): " + "; ".join(
        f"{s} " + " ".join(f"{r:.2f}" for r in base_rates[s, None]) for s in SOURCES))
    print("| policy | x none | x ngram k=4 | " + " | ".join(families)
          + " (x ngram) | steps: model (tokens) / chain (tokens) / none |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in families) + " | --- |")
    per_step = {}
    for p, t in times.items():
        fam = []
        for f in families:
            sel = np.array([o.family == f for o in outputs])
            fam.append(f"{times['ngram'][sel].sum() / t[sel].sum():.2f}")
        steps = {kind: sum(COUNTS[p, f, kind] for f in families)
                 for kind in ("model", "chain", "none", "model tokens", "chain tokens")}
        total = steps["model"] + steps["chain"] + steps["none"]
        share = " / ".join(
            f"{steps[kind] / total:.2f}"
            + (f" ({steps[kind + ' tokens'] / max(steps[kind], 1):.1f})" if kind != "none" else "")
            for kind in ("model", "chain", "none"))
        per_step[p] = COUNTS[p, "chain p1"] / max(COUNTS[p, "steps with a chain"], 1)
        print(f"| {p} | {times['none'].sum() / t.sum():.3f} | {times['ngram'].sum() / t.sum():.3f}"
              f" | " + " | ".join(fam) + f" | {share} |")
    print("\nthe voters' chain's first token accepted (the suffix voter's, else the n-gram's), "
          "mean over the steps each policy visited: " + ", ".join(
              f"{p} {v:.2f}" for p, v in per_step.items()))


if __name__ == "__main__":
    main()
