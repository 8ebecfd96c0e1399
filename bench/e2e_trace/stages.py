"""Per-message stage table for a traced run (branch-aware: client decode may run inside the read)."""
import os, pickle, sys, bisect
import numpy as np
def load(tag):
    return (pickle.load(open(f"{tag}.broker.pkl", "rb")), pickle.load(open(f"{tag}.client.pkl", "rb")))
def rows(tag):
    B, C = load(tag); req = C["req"]
    sresp = {}; presp = {}
    for (o, t, t2, qid, qoff, cnt) in C["resp"]:
        r = req.get(o)
        if r is None: continue
        if r[0] in (320, 10) and qoff is not None: sresp[o] = (qid, qoff, cnt)
        presp[o] = (t, t2)
    send_of = {}
    for o, (qid, off, cnt) in sresp.items():
        for i in range(cnt or 1): send_of[(qid, off + i)] = o
    pulls = {}
    for o, r in req.items():
        if r[0] == 11 and r[1] is not None: pulls.setdefault(r[1], []).append((r[2], r[3], o))
    for v in pulls.values(): v.sort()
    bsend = {o: (cur, t, t2) for (o, cur, t, t2) in B["send"]}
    bpull = {o: (t, t2) for (o, cur, t, t2) in B["pull"]}
    bheld = {o: (t, t2) for (o, qid, off, sus, t, t2) in B["held"]}
    wr = sorted(B["wr"]); wt = [w[0] for w in wr]
    pushes = {}
    for (qid, off, n, trd, tp) in C["push"]:
        for i in range(n): pushes[(qid, off + i)] = tp
    out = []
    for (qid, off, t0, tpoll) in C["recv"]:
        so = send_of.get((qid, off)); pl = pulls.get(qid)
        if so is None or not pl: continue
        i = bisect.bisect_right(pl, (off, float("inf"), 0)) - 1
        if i < 0: continue
        po = pl[i][2]; rq = req[so]; bs = bsend.get(so)
        ph = bheld.get(po) or bpull.get(po); pr = presp.get(po); tp = pushes.get((qid, off))
        if not (bs and ph and pr and tp and rq[4]): continue
        j = bisect.bisect_left(wt, ph[1])
        pw = wr[j][0] if j < len(wr) else ph[1]
        out.append((t0, rq[4], bs[0], bs[2], ph[0], ph[1], pw, pr[0], tp, tpoll))
    return np.array(out, dtype=np.float64)
names = ["send call -> frame written (client)", "-> broker reads it", "-> put done", "-> woken pull runs", "pull runs (read messages)",
         "-> its answer written", "-> client reads it", "-> decoded, ready for poll", "-> poll returns"]
tags = sys.argv[1:]
res = {t: rows(t) for t in tags}
print("| stage (µs) | " + " | ".join(f"{os.path.basename(t)} p50 / p90 / p99" for t in tags) + " |")
print("|---|" + "---|" * len(tags))
for j, n in enumerate(names):
    cells = []
    for t in tags:
        s = np.diff(res[t], axis=1)[:, j] / 1e3
        cells.append(" / ".join(f"{v:.0f}" for v in np.percentile(s, [50, 90, 99])))
    print(f"| {n} | " + " | ".join(cells) + " |")
cells = []
for t in tags:
    lat = (res[t][:, 9] - res[t][:, 0]) / 1e3
    cells.append(" / ".join(f"{v:.0f}" for v in np.percentile(lat, [50, 90, 99])))
print("| end to end | " + " | ".join(cells) + " |")
