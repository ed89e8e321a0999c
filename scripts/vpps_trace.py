#!/usr/bin/env python3
"""Summarise a persistent-kernel instruction trace (RAMUS_VPPS_TRACE).

Each line of the trace is `launch cta opcode arg start_ns end_ns items`
(times on the GPU's global timer, low 32 bits; items: a product's item
count, 255 for that many or more, else 0; older traces lack it). For
every launch (or the one given with --launch) this prints the kernel's
span, each opcode's duration percentiles, and the critical path barrier
by barrier: for barrier b, the CTA whose SIGNAL came last, how long it
took to wake after the previous barrier, and the instructions it ran in
between.

    RAMUS_VPPS_TRACE=trace.txt ramus bench data.txt --device cuda \
        --engine persistent --batch-sizes 8 --reps 1
    python3 scripts/vpps_trace.py trace.txt --levels 20
"""

import argparse
import collections

# opcodes of ramus-core/src/vpps/{script,kernel}.rs
NAMES = {1: "SIGNAL", 2: "WAIT", 16: "MATVEC", 17: "MATVEC_T", 18: "OUTER",
         19: "UPDATE", 20: "FUSED", 21: "ROWS", 22: "SUM_CHILDREN",
         23: "SUM_ROWS", 24: "BROADCAST_ROWS", 25: "XENT", 26: "UPDATE_DENSE",
         27: "NOP"}
SIGNAL, WAIT = 1, 2


def name(op):
    return NAMES.get(op, str(op))


def read(path):
    launches = collections.defaultdict(list)
    with open(path) as f:
        for line in f:
            fields = list(map(int, line.split()))
            launch, cta, op, arg, start, end = fields[:6]
            items = fields[6] if len(fields) > 6 else 0
            launches[launch].append((cta, op, arg, start, end, items))
    return launches


def summarise(launch, records, levels, top):
    base = min(r[3] for r in records)
    # relative times (the timer's low 32 bits may wrap once)
    recs = [(c, op, arg, (s - base) & 0xFFFFFFFF, (e - base) & 0xFFFFFFFF, n)
            for c, op, arg, s, e, n in records]
    span = max(r[4] for r in recs)
    print(f"launch {launch}: {len(recs)} instructions on "
          f"{len({r[0] for r in recs})} CTAs, span {span / 1e3:.1f} us")
    durations = collections.defaultdict(list)
    by_cta = collections.defaultdict(list)
    for r in recs:
        durations[r[1]].append(r[4] - r[3])
        by_cta[r[0]].append(r)
    for op, d in sorted(durations.items()):
        d.sort()
        print(f"  {name(op):15s} n {len(d):6d}  p50 {d[len(d) // 2] / 1e3:7.2f} us"
              f"  p90 {d[len(d) * 9 // 10] / 1e3:7.2f} us  max {d[-1] / 1e3:7.2f} us")
    released = {}
    for r in recs:
        if r[1] == SIGNAL:
            released[r[2]] = max(released.get(r[2], 0), r[4])
    wake_total = work_total = 0
    work_by_op = collections.Counter()
    lines = []
    for b in sorted(released):
        # the CTA whose signal of b came last, and its work since its wait
        cta, at = max(((c, i) for c, rs in by_cta.items()
                       for i, r in enumerate(rs) if r[1] == SIGNAL and r[2] == b),
                      key=lambda ci: by_cta[ci[0]][ci[1]][4])
        rs = by_cta[cta]
        j = at - 1
        while j >= 0 and rs[j][1] != WAIT:
            j -= 1
        work = rs[j + 1:at]
        begin = rs[j][4] if j >= 0 else 0
        wake = begin - released.get(b - 1, 0) if j >= 0 else 0
        wake_total += wake
        work_total += rs[at][3] - begin
        for r in work:
            work_by_op[name(r[1])] += r[4] - r[3]
        steps = " ".join(f"{name(r[1])}:{r[2]}{'x' + str(r[5]) if r[5] else ''}"
                         f" {(r[4] - r[3]) / 1e3:.2f}" for r in work)
        gap = released[b] - released.get(b - 1, 0)
        lines.append((gap, f"  barrier {b:4d}: {gap / 1e3:6.2f} us"
                           f" (wake {wake / 1e3:.2f}) CTA {cta}: {steps}"))
    for gap, line in lines[:levels]:
        print(line)
    if top:
        print(f"  the {top} longest barrier intervals:")
        for gap, line in sorted(lines, key=lambda gl: -gl[0])[:top]:
            print(line)
    print(f"  critical path over {len(released)} barriers: waking {wake_total / 1e3:.1f} us,"
          f" work {work_total / 1e3:.1f} us; work by opcode: "
          + ", ".join(f"{k} {v / 1e3:.1f} us" for k, v in work_by_op.most_common()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--launch", type=int, help="only this launch")
    ap.add_argument("--levels", type=int, default=0,
                    help="print the critical path's first N barriers")
    ap.add_argument("--top", type=int, default=0,
                    help="print the critical path's N longest barrier intervals")
    a = ap.parse_args()
    for launch, records in sorted(read(a.trace).items()):
        if a.launch is None or a.launch == launch:
            summarise(launch, records, a.levels, a.top)


if __name__ == "__main__":
    main()
