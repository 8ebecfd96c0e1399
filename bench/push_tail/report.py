"""Per-stage figures of bench/push_tail/run.py outputs (see run.py)."""

from __future__ import annotations

import json
import sys
from typing import Any


def _pct(v: list[float], p: float) -> float:
    if not v:
        return float("nan")
    v = sorted(v)
    return v[min(len(v) - 1, int(p * len(v)))]


def summary(out: dict[str, Any]) -> str:
    rec = out["rec"]
    lines = [f"sent {out['sent']} received {len(rec)} load {out.get('load')} "
             f"cpu {out.get('cpu')} stats {out.get('stats')}"]
    pc = out.get("phase_cpu")
    if pc and pc.get("received"):
        k = pc["received"]
        lines.append(f"phase CPU (go -> last delivery): consumer {pc['consumer']:.2f} s = "
                     f"{pc['consumer'] / k * 1e6:.1f} us/msg, broker {pc['broker']:.2f} s = "
                     f"{pc['broker'] / k * 1e6:.1f} us/msg ({k} delivered)")
    dr = out.get("drains")
    if dr:
        ms = sorted((e - t) / 1e6 for t, _n, e in dr)
        lines.append(f"answer slices: {len(dr)}, queues/slice p50 "
                     f"{sorted(n for _t, n, _e in dr)[len(dr) // 2]}; ms p50 {_pct(ms, .5):.2f} "
                     f"p99 {_pct(ms, .99):.2f} max {ms[-1]:.2f}")
    if not rec:
        return "\n".join(lines)
    # stages in ms: send->born (producer: ms clock), born->stored (ms clocks), stored->rx,
    # rx->listener, total
    rows = []
    for send, born, store, rx, lis in rec:
        s_ms = send / 1e6
        rows.append((born - s_ms, store - born, (rx / 1e6 - store) if rx else float("nan"),
                     ((lis - rx) / 1e6) if rx else float("nan"), (lis - send) / 1e6, send, lis))
    names = ["send->born", "born->stored", "stored->rx", "rx->listener", "total"]
    tot = sorted(r[4] for r in rows)
    lines.append("stage             p50      p90      p99      max   mean(slow1%) mean(>5ms)")
    p99 = _pct(tot, 0.99)
    slow = [r for r in rows if r[4] >= p99]
    over = [r for r in rows if r[4] > 5]
    for i, n in enumerate(names):
        v = [r[i] for r in rows if r[i] == r[i]]
        sv = [r[i] for r in slow if r[i] == r[i]]
        ov = [r[i] for r in over if r[i] == r[i]]
        lines.append(f"{n:14s} {_pct(v, .5):8.2f} {_pct(v, .9):8.2f} {_pct(v, .99):8.2f} "
                     f"{max(v):8.2f} {sum(sv) / max(1, len(sv)):10.2f} "
                     f"{sum(ov) / max(1, len(ov)):10.2f}")
    lines.append(f"over 5 ms: {len(over)} of {len(rows)}")
    # what the >5 ms messages overlapped: consumer stalls and collections
    stalls = out["stalls"]
    gcs = out["gcs"]
    big = sorted(stalls, key=lambda s: -s[1])[:8]
    lines.append(f"consumer loop stalls >2ms: {len(stalls)}, total {sum(s[1] for s in stalls):.0f} "
                 f"ms wall, {sum(s[2] for s in stalls):.0f} ms cpu; biggest (ms after go, wall, cpu): "
                 + ", ".join(f"({(e - out['t_go']) / 1e6:.0f}, {w:.1f}, {c:.1f})" for e, w, c in big))
    lines.append(f"gcs: {len(gcs)} (gen, wall ms, cpu ms): "
                 + ", ".join(f"({g[1]}, {g[2]:.1f}, {g[3]:.1f})" if len(g) > 3
                             else f"({g[1]}, {g[2]:.1f})" for g in gcs[:12]))
    if "gc_go" in out:
        lines.append(f"gc at the go: counts {out['gc_go']['count']}, objects per generation "
                     f"{out['gc_go']['objects']}, frozen {out['gc_go']['frozen']}")
    ans = out["answers"]
    if ans:
        gaps = [(b[0] - a[2]) / 1e6 for a, b in zip(ans, ans[1:])]
        work = [(a[2] - a[0]) / 1e6 for a in ans]
        lines.append(f"answers {len(ans)}: queues/answer p50 {_pct([a[1] for a in ans], .5)}; "
                     f"handling ms p50 {_pct(work, .5):.2f} p90 {_pct(work, .9):.2f} max "
                     f"{max(work):.2f}, total {sum(work):.0f}; from one's end to the next p50 "
                     f"{_pct(gaps, .5):.2f} p90 {_pct(gaps, .9):.2f}")
    st = out.get("stacks") or {}
    if st:
        tot_s = sum(st.values())
        lines.append(f"consumer loop late >3 ms: {tot_s} samples (1 ms); top stacks:")
        for k, v in sorted(st.items(), key=lambda kv: -kv[1])[:12]:
            lines.append(f"  {v:5d} {k[:300]}")
    lg = out.get("long") or []
    if lg:
        by: dict[str, list[float]] = {}
        for _t, c, _w, n in lg:
            by.setdefault(n, []).append(c)
        lines.append(f"consumer callbacks over 2 ms CPU: {len(lg)}, by callback (n, max ms, "
                     "total ms):")
        for n, v in sorted(by.items(), key=lambda kv: -sum(kv[1]))[:10]:
            lines.append(f"  {len(v):4d} {max(v):7.1f} {sum(v):8.1f} {n[:120]}")
    # when were the >5 ms messages sent (100 ms bins)
    bins: dict[int, int] = {}
    for r in over:
        b = int((r[5] - out["t_go"]) / 1e8)
        bins[b] = bins.get(b, 0) + 1
    lines.append("over-5ms by send time (100 ms bins: count): "
                 + " ".join(f"{b}:{c}" for b, c in sorted(bins.items())))
    return "\n".join(lines)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        with open(p) as f:
            print(p)
            print(summary(json.load(f)))
