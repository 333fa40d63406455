"""How well what a controller could know before drafting predicts whether the model's first
draft token will be accepted: the area under the ROC curve (0.5: no better than chance, 1: the
hindsight ceiling's knowledge) of simple features, over every output position of greedy traces
recorded at a fixed lookahead (every position observed). `python predictability.py TRACE...`

Features at output position x of a request: `prev` the model's agreement at x-1 (known live only
where the model drafted there: an optimistic feature), `chain` whether the model-free voters have
a chain at x, `runmean` the request's agreement rate over positions < x, `combo` a hand-made sum
of the three (2 prev + prev-of-prev + runmean + chain / 2).
"""
import sys

import numpy as np

from vllm_smurfs.trace.format import read_trace
from vllm_smurfs.trace.simulator import reconstruct


def auc(score, y):
    """Mann-Whitney U / (n_pos n_neg), ties counted half."""
    score, y = np.asarray(score, float), np.asarray(y, bool)
    pos, neg = score[y], score[~y]
    greater = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return greater / (len(pos) * len(neg))


if __name__ == "__main__":
    for path in sys.argv[1:]:
        y, feats = [], {"prev": [], "chain": [], "runmean": [], "combo": []}
        for r in reconstruct(read_trace(path)):
            agree = (r.acc > 0).astype(int)
            for x in range(2, len(agree)):
                y.append(agree[x])
                feats["prev"].append(agree[x - 1])
                feats["chain"].append(int(r.free_len[x] > 0))
                feats["runmean"].append(agree[:x].mean())
                feats["combo"].append(2 * agree[x - 1] + agree[x - 2] + agree[:x].mean()
                                      + 0.5 * (r.free_len[x] > 0))
        print(f"{path}: {len(y)} positions, first token accepted at {np.mean(y):.3f}; AUC "
              + ", ".join(f"{k} {auc(v, y):.3f}" for k, v in feats.items()))
