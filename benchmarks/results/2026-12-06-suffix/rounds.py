"""Per pass, per round, per method: speedup vs none, MAL; round 1 per family; Smurfs steps."""
import json, glob, sys, math
from collections import defaultdict

def agg(recs):
    toks = sum(v['num_output_tokens'] for v in recs); el = sum(v['elapsed_s'] for v in recs)
    acc = sum(v.get('num_accepted_tokens', 0) for v in recs); nd = sum(v.get('num_drafts', 0) for v in recs)
    return toks / el, (1 + acc / nd) if nd else None

out_dir = sys.argv[1]
per_pass = defaultdict(dict)  # (label, round) -> [speedups]
fam_pass = defaultdict(list)
for f in sorted(glob.glob(out_dir + '/pass-*/result.json')):
    r = json.load(open(f))
    n = r['settings']['num_prompts'] // r['settings'].get('rounds', 1)
    fams = {p['index']: p['family'] for p in r['prompts']}
    rounds = r['settings'].get('rounds', 1)
    base = {}
    rows = []
    order = [m['label'] for m in r['methods']]
    for m in r['methods']:
        pp = m['loads']['batch1']['per_prompt']
        for rd in range(rounds):
            recs = [v for k, v in pp.items() if int(k) // n == rd]
            tps, mal = agg(recs)
            if m['name'] == 'none':
                base[rd] = tps
            rows.append((m, rd, tps, mal, recs))
    print(f"{f.split('/')[-2]} order: {', '.join(order)}")
    for m, rd, tps, mal, recs in rows:
        sp = tps / base[rd]
        per_pass[(m['label'], rd)][f] = sp
        extra = ''
        if m['name'] == 'smurfs':
            st = [v['smurfs_stats'] for v in recs]
            s = sum(x['steps'] for x in st); wo = sum(x['steps_without_models'] for x in st)
            rs = sum(x['request_steps'] for x in st)
            fc = sum(x['request_steps_without_models_free_chain'] for x in st)
            nc = sum(x['request_steps_without_models_no_chain'] for x in st)
            dr = {d['name']: (d['drafted_tokens'], d['accepted_tokens'], d['vote_wins']) for x in st for d in x['drafters']}
            agg_d = defaultdict(lambda: [0, 0, 0])
            for x in st:
                for d in x['drafters']:
                    a = agg_d[d['name']]; a[0] += d['drafted_tokens']; a[1] += d['accepted_tokens']; a[2] += d['vote_wins']
            extra = (f" w/o model {wo/s:.2f} (free chain {fc/rs:.2f}, none {nc/rs:.2f}) "
                     + " ".join(f"{k}: {v[1]}/{v[0]} wins {v[2]}" for k, v in agg_d.items()))
        print(f"  round {rd+1} {m['label']:28s} {tps:6.3f} tok/s {sp:5.2f}x MAL {mal if mal is None else round(mal, 2)}{extra}")
        if rd == 0:
            fam = defaultdict(list)
            for k, v in m['loads']['batch1']['per_prompt'].items():
                if int(k) // n == 0:
                    fam[fams[int(k)]].append(v)
            fam_pass[m['label']].append({fa: agg(v)[0] for fa, v in fam.items()})
print("\ngeomean over passes:")
for (label, rd), d in sorted(per_pass.items(), key=lambda x: (x[0][1], x[0][0])):
    v = list(d.values())
    print(f"  round {rd+1} {label:28s} {math.exp(sum(map(math.log, v))/len(v)):.3f}x  passes {' '.join(f'{x:.2f}' for x in v)}")
print("\nround 1 per family (x none, per pass):")
nonelab = next(l for l in fam_pass if l.startswith('none'))
for label, passes in fam_pass.items():
    cells = []
    for fa in passes[0]:
        cells.append(f"{fa} " + "/".join(f"{p[fa]/fam_pass[nonelab][i][fa]:.2f}" for i, p in enumerate(passes)))
    print(f"  {label:28s} " + "; ".join(cells))
