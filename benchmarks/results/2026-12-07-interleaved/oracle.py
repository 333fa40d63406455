"""`python oracle.py TRACE [MAX_LOOKAHEAD] [DRAFTER_COST_SCALE]` (from the repository root's venv).

Oracle ceiling at batch 1 on a recorded trace: a policy that knows, before each step, how many
tokens each option would have accepted (model draft, model-free chain, none) and verifies exactly
those, priced on the trace's fitted curves (target step, drafter forward incl. catch-up).
Compared with the simulator's own policies on the same costs."""
import sys
from vllm_smurfs.trace.simulator import (read_trace, reconstruct, fit_target_cost, fit_pass_cost,
                                         replay, default_policies)

def oracle(reqs, target, drafter, kmax, rho, use_model=True, use_free=True):
    toks = secs = 0.0
    steps = model_steps = 0
    for r in reqs:
        x, synced = 0, -1
        while x < r.length:
            ctx = r.prompt + x
            left = r.length - x - 1
            opts = [(1, target(1), None)]
            if use_free and r.free_len[x]:
                a = min(int(r.free_acc[x]), int(r.free_len[x]), left, kmax)
                if a:
                    opts.append((a + 1, target(1 + a), None))
            if use_model and drafter is not None:
                a = min(int(r.acc[x]), left, kmax)
                if a:
                    catch = ctx - min(synced, ctx - 1) if synced >= 0 else ctx
                    cost = target(1 + a) + drafter(catch) + (a - 1) * drafter(1)
                    opts.append((a + 1, cost, ctx + a))
            best = max(opts, key=lambda o: o[0] - rho * o[1])
            toks += best[0]; secs += best[1]; steps += 1
            if best[2] is not None:
                synced = best[2]; model_steps += 1
            x += best[0]
    return toks, secs, model_steps / steps

trace = read_trace(sys.argv[1]); kmax = int(sys.argv[2]) if len(sys.argv) > 2 else 6
reqs = reconstruct(trace)
target, _pc = fit_target_cost(trace), fit_pass_cost(trace)
scale = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
pass_cost = lambda n: scale * _pc(n)
print("target(1, 4, 8) ms:", [round(1000 * target(n), 1) for n in (1, 4, 8)])
print("drafter(1,4,52) ms:", [round(1000 * pass_cost(n), 1) for n in (1, 4, 52)])
base_t = sum(r.length for r in reqs); base_s = sum(r.length * target(1) for r in reqs)
base = base_t / base_s
for name, um, uf in [("oracle model+free", True, True), ("oracle model only", True, False),
                     ("oracle free only", False, True)]:
    rho = base
    for _ in range(30):
        t, s, share = oracle(reqs, target, pass_cost, kmax, rho, um, uf)
        rho = t / s
    print(f"{name:22s} {rho / base:.3f}x none  model share {share:.2f}")
pols = default_policies(kmax)
for name, f in pols.items():
    r = replay(reqs, f, 1, target, pass_cost, kmax)
    print(f"{name:22s} {r.tokens_per_second / base:.3f}x none  MAL {r.mean_accepted_length:.2f}  model share {r.model_share:.2f}")
