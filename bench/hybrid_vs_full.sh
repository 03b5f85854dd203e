#!/usr/bin/env bash
# FULL_SHARD across all 4 ranks vs HYBRID_SHARD (dp_shard 2 inside a "node", dp_replicate 2 across)
# over two "nodes" joined by a shaped link (results in docs/bench-notes/fsdp.md). Needs root: it
# runs bench/two_nodes.sh, which builds the namespaces mtnode0/mtnode1 (10.99.0.1/.2, nothing else
# touched) and deletes them when the job ends.
#
# Layout: 2 ranks per node, ranks 0,1 on mtnode0 and 2,3 on mtnode1 (two_nodes.sh fills a node's
# slots first). meshtrain lays dp_shard out fastest, so HYBRID_SHARD's shard groups are {0,1} and
# {2,3} (one node each, shared memory) and its replica groups {0,2}, {1,3} (across the link): only
# the all-reduce of the gradient shards crosses it. FULL_SHARD's shard group is all 4 ranks, so
# every all-gather and reduce-scatter crosses it.
#
# Per configuration (gpt2-small-cpu, micro-batch 4 per rank, fp32, 1 thread per rank): tokens/s,
# step ms, comm and exposed comm ms (medians over the steps after the first, rank 0's metrics) and
# the bytes node 0 sent over the link (tc counters, divided by the steps run incl. start-up).
# Rates: each of RATES (default "1gbit unshaped": the slow inter-node link, and the bare veth as a
# control). Before each run it waits until no other benchmark runs, then until the 1-minute load
# average is at most --max-load (polled every 30 s, at most --load-wait seconds; after that it
# starts anyway and says so), and records `uptime` next to the run (uptime.txt, load column).
#
# usage: bench/hybrid_vs_full.sh [--steps N] [--repeats R] [--rates "1gbit unshaped"] [--build DIR]
#                                [--data DIR] [--out DIR] [--no-wait] [--max-load L (1.5)]
#                                [--load-wait S (300)]
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/bench/common.sh"
STEPS=6
REPEATS=1
RATES="1gbit unshaped"
BUILD=$ROOT/build-fsdpbench
DATA=/tmp/fsdpdata
OUT=
bench_opt --steps STEPS --repeats REPEATS --rates RATES
bench_quiet_options
bench_parse "$@"
[[ $EUID -eq 0 ]] || { echo "hybrid_vs_full.sh: needs root (network namespaces)" >&2; exit 1; }
bench_out hybrid
BENCH_TEXTS="fortunes literature" bench_setup "$BUILD" "$DATA"

ARGS=(--model.preset gpt2-small-cpu --train.micro_batch 4 --data.train "$DATA/train.bin" --data.val ''
  --train.steps "$STEPS" --train.eval_every 0 --train.sample_tokens 0 --log.print_every 1000
  --train.threads 1)

# The namespaces mtnode0/mtnode1 are shared with anyone else using bench/two_nodes.sh: wait while
# another job has them (and, with --no-wait, refuse); never delete namespaces this script did not make.
ns_busy() { ip netns list 2>/dev/null | awk '{print $1}' | grep -qE '^mtnode(0|1|br)$'; }
wait_quiet() {
  bench_wait_quiet ns_busy
  if ns_busy; then
    echo "hybrid_vs_full.sh: namespaces mtnode* exist (another two_nodes.sh job, or a --keep run); not touching them" >&2
    exit 1
  fi
}

echo "hybrid_vs_full: rates $RATES, $STEPS steps, $REPEATS repeat(s); raw output in $OUT"
echo "load before: $(uptime)" | tee "$OUT/load.txt"
: >"$OUT/runs.txt"
: >"$OUT/uptime.txt"
: >"$OUT/cpu.txt"
for ((r = 1; r <= REPEATS; r++)); do
  for rate in $RATES; do
    cfgs=(FULL_SHARD HYBRID_SHARD)
    ((r % 2 == 0)) && cfgs=(HYBRID_SHARD FULL_SHARD)
    for s in "${cfgs[@]}"; do
      tag="${s}_${rate}_r${r}"
      extra=(--parallel.strategy "$s")
      [[ $s == HYBRID_SHARD ]] && extra+=(--parallel.dp_replicate 2 --parallel.dp_shard 2)
      ropt=()
      [[ $rate != unshaped ]] && ropt=(-r "$rate")
      wait_quiet
      load=$(cut -d' ' -f1-3 /proc/loadavg | tr ' ' /)
      echo "$tag: $(uptime)" >>"$OUT/uptime.txt"
      t0=$(date +%s)
      rc=0
      b0=$(busy_ticks)
      "$ROOT/bench/two_nodes.sh" -p 2 "${ropt[@]}" -- "$MT" train "${ARGS[@]}" "${extra[@]}" \
        --log.metrics_out "$OUT/$tag.jsonl" >"$OUT/$tag.log" 2>&1 &
      jpid=$!
      sample_ranks "$jpid" "$OUT/$tag.ticks" &
      spid=$!
      wait "$jpid" || rc=$?
      wait "$spid" || true
      echo "$tag $(($(busy_ticks) - b0)) $(($(date +%s) - t0))" >>"$OUT/cpu.txt"
      # node 0's egress over the link (only with a tc qdisc, i.e. a shaped rate)
      sent=$(sed -n 's/.*node0 qdisc:  *Sent \([0-9]*\) bytes.*/\1/p' "$OUT/$tag.log" | head -1)
      echo "$tag $rc ${sent:-0} $load" >>"$OUT/runs.txt"
      echo "  $tag: rc $rc, $(($(date +%s) - t0)) s, load before $load, uptime after: $(uptime | sed 's/.*load/load/')"
    done
  done
done
echo "load after: $(uptime)" | tee -a "$OUT/load.txt"
if ip netns list 2>/dev/null | awk '{print $1}' | grep -qE '^mtnode(0|1|br)$'; then
  echo "warning: mtnode namespaces still exist after the runs" >&2
fi

python3 - "$OUT" "$STEPS" <<'EOF'
import json, statistics, sys, collections
out, steps = sys.argv[1], int(sys.argv[2])
med = statistics.median
import os
HZ, NCPU = os.sysconf("SC_CLK_TCK"), os.cpu_count()
cpu = {t: (int(b), int(w)) for t, b, w in (l.split() for l in open(f"{out}/cpu.txt"))}
rows = collections.OrderedDict()
for tag, rc, sent, *load in (l.split() for l in open(f"{out}/runs.txt")):
    s, rate, r = tag.rsplit("_", 2)
    rec = {"rc": int(rc), "load": load[0], "sent": int(sent)}
    ticks = collections.defaultdict(int)
    for l in open(f"{out}/{tag}.ticks"):
        p, _, tk = l.split()
        ticks[p] = max(ticks[p], int(tk))
    busy, wall = cpu[tag]
    # CPU-seconds used during the run by everything but the rank processes (other users' jobs,
    # mpirun/orted, tc, this script's sampler), and that as a share of the machine's cores
    rec["other"] = f"{(busy - sum(ticks.values())) / HZ:.0f} core-s ({100 * (busy - sum(ticks.values())) / HZ / (wall * NCPU):.0f}%)"
    if rc == "0":
        recs = [json.loads(l) for l in open(f"{out}/{tag}.jsonl") if l.strip()]
        st = [x for x in recs if not x.get("final")][1:]
        fin = [x for x in recs if x.get("final")][0]
        rec.update(tps=med(x["tokens_per_s"] for x in st), step=med(x["step_ms"] for x in st),
                   comm=med(x["comm_ms"] for x in st), exp=med(x["exposed_comm_ms"] for x in st),
                   groups=fin.get("comm_bytes_by_group", {}))
    rows.setdefault((rate, s), []).append(rec)
print("\n| link | strategy | tokens/s (global) | step ms | comm ms/step | exposed ms/step | node 0 -> link MB/step | load (1/5/15 min) before | CPU used by others during the run |")
print("|---|---|---:|---:|---:|---:|---:|---|---|")
for (rate, s), recs in rows.items():
    ok = [x for x in recs if x["rc"] == 0]
    loads = ", ".join(x["load"] for x in recs)
    if not ok:
        print(f"| {rate} | {s} | failed (rc {recs[0]['rc']}) | | | | | {loads} | |"); continue
    v = {k: med(x[k] for x in ok) for k in ("tps", "step", "comm", "exp")}
    sent = med(x["sent"] for x in ok)
    sent_s = f"{sent / steps / 1e6:.0f}" if sent else "-"
    per = " / ".join(f"{x['tps']:.0f}" for x in ok)
    print(f"| {rate} | {s} | {v['tps']:.0f}" + (f" ({per})" if len(ok) > 1 else "") +
          f" | {v['step']:.0f} | {v['comm']:.0f} | {v['exp']:.0f} | {sent_s} | {loads} | " +
          ", ".join(x["other"] for x in ok) + " |")
for (rate, s), recs in rows.items():
    ok = [x for x in recs if x["rc"] == 0]
    if ok:
        g = ", ".join(f"{k} {b / 2**20:.1f} MiB" for k, b in ok[-1]["groups"].items() if b)
        print(f"- {rate} {s}: bytes per rank by group over the run (rank 0): {g}")
EOF
