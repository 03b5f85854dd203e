#!/usr/bin/env python3
"""Where a pipeline step's idle time goes, from the executor's trace (MESHTRAIN_PP_TRACE=PREFIX,
one file PREFIX.rank<R> per pipeline rank of one machine; see docs/pipeline.md).

usage: bench/pipeline_trace.py PREFIX... [--step N]
  several PREFIXes (runs of the same configuration): means over all their steps after the first;
  --step N: also list step N's events (of each PREFIX)

Per rank, means over the steps after the first (ms): the span (first action to the last send's
completion), the compute (F, B, W), the idle rest, and what the idle was: receives waited for
while the peer had not yet sent ("peer"), receives waited for after the peer had sent (the
hand-off: "transfer"), the time the compute thread spent copying and posting messages ("post"),
and the rest ("other": between actions, the final wait for sends). "replay": the idle time the
same schedule would have had if every action took the time it took and every message arrived the
moment its compute ended (each rank's actions in its order, a forward after the previous stage's
forward of the micro-batch, a B after the next stage's B; all ranks starting together): the
schedule's own bubble with the measured costs, stage imbalance included. "executor" = idle -
replay: what the hand-offs, waits and everything between the actions added. "window": the idle
time within the step's common window (first start to last end over the ranks) - the engine's
pp_bubble takes each rank's own span, which leaves out a rank's wait after its last action for the
others to finish (the last rank's under 1F1B: a whole backward); "window replay": the same for the
replay. "win.median": the window replay with every action taking its rank's median time for its
kind and stage over the run: the schedule's idle with the ranks' imbalance but without the spread
from step to step and micro-batch to micro-batch. "win.pullW" (split schedules): the window replay
again, but a rank whose next F or B still waits for its input first runs its earliest weight
gradient W whose B is done: what running the W's out of order to fill late messages would save
(the W's keep their own order, so no more activations are in flight than the schedule's).
"""
import collections, statistics, sys

def load(path):
    steps, cur = [], []
    for line in open(path):
        if line.startswith("END"):
            steps.append(cur)
            cur = []
            continue
        k, key, *t = line.split()
        cur.append((k, int(key), *map(int, t)))
    return steps

def main():
    args = sys.argv[1:]
    show = None
    if "--step" in args:
        i = args.index("--step")
        show = int(args[i + 1])
        del args[i:i + 2]
    if not args:
        sys.exit(__doc__)
    tot = collections.defaultdict(float)
    steps_total, nranks = 0, 0
    for prefix in args:
        ranks = []
        while True:
            try:
                ranks.append(load(f"{prefix}.rank{len(ranks)}"))
            except FileNotFoundError:
                break
        if not ranks:
            sys.exit(f"pipeline_trace.py: no {prefix}.rank0")
        nranks = len(ranks)
        n = min(len(x) for x in ranks)
        steps_total += n - 1
        add_steps(ranks, n, show, tot)
    keys = ("span", "compute", "idle", "peer", "transfer", "post", "other", "replay", "executor", "window",
            "win.replay", "win.median") + (("win.pullW",) if any(k[1] == "win.pullW" for k in tot) else ())
    print(f"{steps_total} steps ({len(args)} runs, each without its first step); means in ms per step:")
    print("rank " + "".join(f"{k:>11s}" for k in keys))
    for rr in range(nranks):
        print(f"{rr:4d} " + "".join(f"{tot[(rr, k)] / steps_total / 1e6:11.2f}" for k in keys))

def replay(actions):
    """actions[r]: rank r's (kind, micro-batch, stage, duration) in order -> idle per rank."""
    done = {}  # (kind, m, s) -> end time
    pos = [0] * len(actions)
    clock = [0.0] * len(actions)
    busy = [sum(a[3] for a in acts) for acts in actions]
    left = sum(len(a) for a in actions)
    while left:
        moved = False
        for r, acts in enumerate(actions):
            while pos[r] < len(acts):
                k, m, st, d = acts[pos[r]]
                dep = ("F", m, st - 1) if k == "F" and st > 0 else ("B", m, st + 1) if k == "B" else None
                if dep and dep not in done and any(dep[0] == a[0] and dep[1] == a[1] and dep[2] == a[2]
                                                   for x in actions for a in x):
                    break
                start = max(clock[r], done.get(dep, 0.0) if dep else 0.0)
                clock[r] = start + d
                done[(k, m, st)] = clock[r]
                pos[r] += 1
                left -= 1
                moved = True
        if not moved:
            return None  # not the schedule this replay knows
    return [clock[r] - busy[r] for r in range(len(actions))], [max(clock) - busy[r] for r in range(len(actions))]

def replay_pull_w(actions):
    """Like replay(), each rank taking its actions in order, except that a rank whose next F or B
    waits for an input that has not arrived yet runs its earliest W whose B is done first. Returns
    the idle per rank within the common window, or None for a schedule this replay does not know."""
    order = [list(a) for a in actions]
    done = {}
    clock = [0.0] * len(actions)
    busy = [sum(a[3] for a in acts) for acts in actions]
    exists = {a[:3] for x in actions for a in x}
    while any(order):
        for r in sorted(range(len(order)), key=lambda r: clock[r]):  # the rank furthest behind first
            if not order[r]:
                continue
            k, m, st, d = order[r][0]
            dep = ("F", m, st - 1) if k == "F" and st > 0 else ("B", m, st + 1) if k == "B" else None
            dep = dep if dep in exists else None
            if dep and done.get(dep, float("inf")) > clock[r]:  # not arrived: a finished B's W first
                w = next((i for i, a in enumerate(order[r]) if a[0] == "W" and
                          done.get(("B", a[1], a[2]), float("inf")) <= clock[r]), None)
                if w is not None:
                    _, wm, ws, wd = order[r].pop(w)
                    clock[r] += wd
                    done[("W", wm, ws)] = clock[r]
                    break
            if dep and dep not in done:
                continue  # the rank that computes it is behind: let it move first
            clock[r] = max(clock[r], done[dep] if dep else 0.0) + d
            done[(k, m, st)] = clock[r]
            order[r].pop(0)
            break
        else:
            return None  # no rank could move
    return [max(clock) - busy[r] for r in range(len(actions))]

def step_actions(ranks, si):
    """Step si's compute actions per rank in order: (kind, micro-batch, stage, duration ns)."""
    acts = []
    for steps in ranks:
        ev = steps[si]
        tw = [e for e in ev if e[0] == "tiedwait"]
        a = []
        for e in sorted((e for e in ev if e[0] in ("F", "B", "W")), key=lambda e: e[2]):
            d = e[3] - e[2] - sum(t[3] - t[2] for t in tw if e[2] <= t[2] <= e[3])
            a.append((e[0], e[1], e[4], d))
        acts.append(a)
    if len(acts) > 1 and not any(a[2] for x in acts for a in x):
        acts = [[(k, m, r, d) for k, m, _, d in x] for r, x in enumerate(acts)]  # stage-less trace: stage = rank
    return acts

def add_steps(ranks, n, show, tot):
    # Each rank's median time per kind of action and stage over the run's steps after the first.
    times = collections.defaultdict(list)
    for si in range(1, n):
        for r, x in enumerate(step_actions(ranks, si)):
            for k, m, st, d in x:
                times[(r, k, st)].append(d)
    median = {key: statistics.median(v) for key, v in times.items()}
    for si in range(1, n):
        acts = step_actions(ranks, si)
        rep = replay(acts)
        even = replay([[(k, m, st, median[(r, k, st)]) for k, m, st, _ in x] for r, x in enumerate(acts)])
        pull = replay_pull_w(acts) if rep and any(a[0] == "W" for x in acts for a in x) else None
        issued = {}  # (sender, key) -> when the send was posted
        for rr, steps in enumerate(ranks):
            for e in steps[si]:
                if e[0] == "send":
                    issued.setdefault(e[1], []).append(e[4])
        t0 = min(e[2] for steps in ranks for e in steps[si] if e[0] == "step")
        t_end = max(e[3] for steps in ranks for e in steps[si] if e[0] == "step")
        for rr, steps in enumerate(ranks):
            ev = steps[si]
            step = [e for e in ev if e[0] == "step"][0]
            span = step[3] - step[2]
            busy = sum(e[3] - e[2] for e in ev if e[0] in ("F", "B", "W"))
            # a tied embedding's gradient is waited for inside the first stage's last W
            ws = [e for e in ev if e[0] == "W"]
            busy -= sum(e[3] - e[2] for e in ev if e[0] == "tiedwait" and any(w[2] <= e[2] <= w[3] for w in ws))
            peer = transfer = post = 0
            for e in ev:
                if e[0] in ("wait", "tiedwait"):
                    sent = min(issued.get(e[1], [e[2]]))
                    peer += max(0, min(sent, e[3]) - e[2])
                    transfer += e[3] - max(e[2], min(sent, e[3]))
                elif e[0] in ("stash", "psend", "precv"):
                    post += e[3] - e[2]
            for k, v in (("span", span), ("compute", busy), ("idle", span - busy), ("peer", peer),
                         ("transfer", transfer), ("post", post), ("other", span - busy - peer - transfer - post)):
                tot[(rr, k)] += v
            tot[(rr, "window")] += t_end - t0 - busy
            if rep:
                tot[(rr, "replay")] += rep[0][rr]
                tot[(rr, "executor")] += span - busy - rep[0][rr]
                tot[(rr, "win.replay")] += rep[1][rr]
                tot[(rr, "win.median")] += even[1][rr]
            if pull:
                tot[(rr, "win.pullW")] += pull[rr]
            if show == si:
                print(f"rank {rr} step {si}: span {span / 1e6:.2f} ms, compute {busy / 1e6:.2f} ms")
                for e in sorted(ev, key=lambda e: e[2] or e[4]):
                    if e[0] in ("send", "recv"):
                        print(f"  {e[0]:8s} {e[1]:6d} issued {(e[4] - t0) / 1e6:9.3f} started {(e[5] - t0) / 1e6:9.3f} "
                              f"done {(e[6] - t0) / 1e6:9.3f}")
                    else:
                        print(f"  {e[0]:8s} {e[1]:6d} {(e[2] - t0) / 1e6:9.3f} .. {(e[3] - t0) / 1e6:9.3f} "
                              f"({(e[3] - e[2]) / 1e6:.3f})")

if __name__ == "__main__":
    main()
