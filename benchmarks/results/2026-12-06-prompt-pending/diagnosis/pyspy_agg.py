"""Aggregate py-spy raw (collapsed) stacks: inclusive share per pattern, and top self frames."""
import collections, re, sys
path = sys.argv[1]
pats = sys.argv[2:] or ["propose (", "proposer.py", "in_worker.py", "length_controller", "vote_sampler",
        "model_free.py", "suffix", "ngram", "execute_model", "_prepare_inputs", "_model_forward",
        "sample_tokens", "rejection", "scheduler", "_update_states", "build_attn_metadata", "_build_attention_metadata",
        "cpu_attn", "step_with_batch_queue", "step (", "runner_hooks", "block_table"]
total = 0
inc = collections.Counter(); selfc = collections.Counter(); thread = collections.Counter()
for line in open(path):
    line = line.rstrip()
    if not line: continue
    stack, _, n = line.rpartition(" ")
    n = int(n); total += n
    frames = stack.split(";")
    thread[frames[0][:60]] += n
    for p in pats:
        if p in stack: inc[p] += n
    selfc[frames[-1][:140]] += n
print("total samples", total)
for t, n in thread.most_common(6): print(f"  thread {n:6d} {t}")
for p in pats: print(f"{inc[p]:7d} {100*inc[p]/total:5.1f}%  {p}")
print("top self:")
for f, n in selfc.most_common(25): print(f"{n:7d} {100*n/total:5.1f}%  {f}")
