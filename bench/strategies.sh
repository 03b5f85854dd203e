#!/usr/bin/env bash
# Sharded data parallelism per strategy (results in docs/bench-notes/fsdp.md):
# NO_SHARD (DDP), ZERO1, SHARD_GRAD_OP, FULL_SHARD at 2 and 4 ranks, HYBRID_SHARD (2 replicas x
# 2 shards) at 4 ranks, on the benchmark config (gpt2-small-cpu, micro-batch 4 per rank, fp32,
# 1 thread per rank). Per run, from rank 0's metrics file (--log.metrics_out):
#   tokens/s   median of the per-step tokens_per_s (global tokens) over the steps after the first
#   step ms, comm ms, exposed ms   medians over the same steps (rank 0's communication thread)
#   memory     peak and resident-after-step bytes per rank by category (mem_peak_by_category_per_rank,
#              mem_resident_by_category_per_rank): the table shows rank 0 (all ranks are in the raw
#              files), the model state params+grads+optimizer, and the peak RSS (VmHWM) of every rank
#              process sampled from /proc every 0.5 s (max over ranks).
# Before each run the script waits until no other benchmark runs (WAIT_PATTERN), then until the
# 1-minute load average is at most --max-load (polled every 30 s, at most --load-wait seconds; after
# that it starts anyway and says so), and records `uptime` next to the run (uptime.txt; the load
# column of the table).
#
# usage: bench/strategies.sh [--steps N] [--repeats R] [--ranks "2 4"] [--strategies "NO_SHARD ..."]
#                            [--dtype f32|bf16] [--build DIR] [--data DIR] [--out DIR] [--no-wait]
#                            [--max-load L (1.5)] [--load-wait S (300)]
#                            [--resume: keep OUT's earlier results and skip the runs that succeeded]
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/bench/common.sh"
STEPS=8
REPEATS=1
RANKS="2 4"
STRATEGIES="NO_SHARD ZERO1 SHARD_GRAD_OP FULL_SHARD HYBRID_SHARD"
DTYPE=f32
BUILD=$ROOT/build-fsdpbench
DATA=/tmp/fsdpdata
OUT=
RESUME=0
bench_opt --steps STEPS --repeats REPEATS --ranks RANKS --strategies STRATEGIES --dtype DTYPE
bench_flag --resume RESUME=1
bench_quiet_options
bench_parse "$@"
bench_out strategies
BENCH_TEXTS="fortunes literature" bench_setup "$BUILD" "$DATA"

ARGS=(--model.preset gpt2-small-cpu --train.micro_batch 4 --data.train "$DATA/train.bin" --data.val ''
  --train.steps "$STEPS" --train.eval_every 0 --train.sample_tokens 0 --log.print_every 1000
  --train.threads 1 --train.dtype "$DTYPE")

runs=()
for n in $RANKS; do
  for s in $STRATEGIES; do
    if [[ $s == HYBRID_SHARD* ]]; then
      ((n == 4)) && runs+=("$s:$n")  # 2 replicas x 2 shards; at 2 ranks a hybrid mesh is degenerate
    else
      runs+=("$s:$n")
    fi
  done
done

echo "strategies: ${runs[*]}; $STEPS steps, $REPEATS repeat(s), $DTYPE; raw output in $OUT"
echo "load before: $(uptime)" | tee -a "$OUT/load.txt"
if [[ $RESUME == 1 ]]; then
  touch "$OUT/runs.txt" "$OUT/uptime.txt" "$OUT/cpu.txt"
  # drop failed or unfinished runs, keep the ones that succeeded
  awk '$2 != 0 {print $1}' "$OUT/runs.txt" >"$OUT/.drop"
  for f in runs uptime cpu; do
    grep -v -F -f "$OUT/.drop" "$OUT/$f.txt" >"$OUT/.$f" || true
    mv "$OUT/.$f" "$OUT/$f.txt"
  done
  rm -f "$OUT/.drop"
else
  : >"$OUT/runs.txt"
  : >"$OUT/uptime.txt"
  : >"$OUT/cpu.txt"
fi
for ((r = 1; r <= REPEATS; r++)); do
  for run in "${runs[@]}"; do
    s=${run%%:*} n=${run##*:}
    tag="${s}_n${n}_r${r}"
    if grep -q "^$tag 0 " "$OUT/runs.txt"; then
      echo "  $tag: done earlier (--resume)"
      continue
    fi
    extra=(--parallel.strategy "$s")
    [[ $s == HYBRID_SHARD* ]] && extra+=(--parallel.dp_replicate 2 --parallel.dp_shard 2)
    bench_wait_quiet
    load=$(cut -d' ' -f1-3 /proc/loadavg | tr ' ' /)
    echo "$tag: $(uptime)" >>"$OUT/uptime.txt"
    t0=$(date +%s)
    b0=$(busy_ticks)
    "$MT" launch -n "$n" --threads 1 -- train "${ARGS[@]}" "${extra[@]}" \
      --log.metrics_out "$OUT/$tag.jsonl" >"$OUT/$tag.log" 2>&1 &
    pid=$!
    sample_ranks "$pid" "$OUT/$tag.hwm" &
    spid=$!
    rc=0
    wait "$pid" || rc=$?
    wait "$spid" || true
    echo "$tag $(($(busy_ticks) - b0)) $(($(date +%s) - t0))" >>"$OUT/cpu.txt"
    echo "$tag $rc $load" >>"$OUT/runs.txt"
    echo "  $tag: rc $rc, $(($(date +%s) - t0)) s, load before $load, uptime after: $(uptime | sed 's/.*load/load/')"
  done
done
echo "load after: $(uptime)" | tee -a "$OUT/load.txt"

python3 - "$OUT" "$REPEATS" <<'EOF'
import json, statistics, sys, collections
out, R = sys.argv[1], int(sys.argv[2])
med = statistics.median
MiB = 2**20
runs = [l.split() for l in open(f"{out}/runs.txt")]
cpu = {t: (int(b), int(w)) for t, b, w in (l.split() for l in open(f"{out}/cpu.txt"))}
import os
HZ, NCPU = os.sysconf("SC_CLK_TCK"), os.cpu_count()
rows = collections.OrderedDict()
for tag, rc, *load in runs:
    s, n, r = tag.rsplit("_", 2)
    key = (s, int(n[1:]))
    rec = {"rc": int(rc), "load": load[0]}
    if rc == "0":
        recs = [json.loads(l) for l in open(f"{out}/{tag}.jsonl") if l.strip()]
        st = [x for x in recs if not x.get("final")][1:]
        fin = [x for x in recs if x.get("final")][0]
        hwm = collections.defaultdict(int)
        ticks = collections.defaultdict(int)
        for l in open(f"{out}/{tag}.hwm"):
            p, kb, tk = l.split()
            hwm[p] = max(hwm[p], int(kb))
            ticks[p] = max(ticks[p], int(tk))
        busy, wall = cpu[tag]
        # CPU-seconds used during the run by everything but the rank processes (other users'
        # jobs, mpirun, this script's sampler), and that as a share of the machine's cores
        rec["other_cpu"] = (busy - sum(ticks.values())) / HZ
        rec["other_share"] = rec["other_cpu"] / (wall * NCPU)
        pk = fin.get("mem_peak_by_category_per_rank") or [fin["mem_peak_by_category"]]
        rs = fin.get("mem_resident_by_category_per_rank") or [fin["mem_resident_by_category"]]
        rec.update(tps=med(x["tokens_per_s"] for x in st), step=med(x["step_ms"] for x in st),
                   comm=med(x["comm_ms"] for x in st), exp=med(x["exposed_comm_ms"] for x in st),
                   peak=pk, res=rs, tracked=max(x.get("mem_peak_bytes", 0) for x in st) / MiB, hwm=max(hwm.values()) / 1024 if hwm else float("nan"),
                   state=[sum(x.get(k, 0) for k in ("params", "grads", "optimizer")) / MiB for x in rs])
    rows.setdefault(key, []).append(rec)

def cat(d, k): return d.get(k, 0) / MiB
print("\n### Throughput and communication (rank 0; medians over the steps after the first" +
      (", then over repeats" if R > 1 else "") + ")\n")
print("| strategy | ranks | tokens/s (global) | step ms | comm ms/step | exposed ms/step | hidden | vs NO_SHARD | load (1/5/15 min) before | CPU used by others during the run |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
base = {}
for (s, n), recs in rows.items():
    ok = [x for x in recs if x["rc"] == 0]
    if s == "NO_SHARD" and ok: base[n] = med(x["tps"] for x in ok)
for (s, n), recs in rows.items():
    ok = [x for x in recs if x["rc"] == 0]
    loads = ", ".join(x["load"] for x in recs)
    if not ok:
        print(f"| {s} | {n} | failed (rc {recs[0]['rc']}) | | | | | | {loads} | |"); continue
    tps, step, comm, exp = (med(x[k] for x in ok) for k in ("tps", "step", "comm", "exp"))
    hid = f"{100 * (1 - exp / comm):.0f}%" if comm > 0 else "-"
    rel = f"{tps / base[n]:.2f}x" if n in base else "-"
    per = " / ".join(f"{x['tps']:.0f}" for x in ok)
    print(f"| {s} | {n} | {tps:.0f}" + (f" ({per})" if len(ok) > 1 else "") +
          f" | {step:.0f} | {comm:.1f} | {exp:.1f} | {hid} | {rel} | {loads} | " +
          ", ".join(f"{x['other_cpu']:.0f} core-s ({100 * x['other_share']:.0f}%)" for x in ok) + " |")

print("\n### Memory per rank, MiB (rank 0's tracked allocator categories: peak / resident after the step)\n")
cats = ["params", "grads", "optimizer", "activations", "comm", "workspace"]
print("| strategy | ranks | " + " | ".join(cats) + " | tracked peak total (rank 0) | model state resident (all ranks) | peak RSS (max over ranks) |")
print("|---|---:|" + "---|" * len(cats) + "---:|---|---:|")
for (s, n), recs in rows.items():
    ok = [x for x in recs if x["rc"] == 0]
    if not ok: continue
    x = ok[-1]
    cells = [f"{cat(x['peak'][0], c):.1f} / {cat(x['res'][0], c):.1f}" for c in cats]
    st = sorted(set(f"{v:.2f}" for v in x["state"]))
    print(f"| {s} | {n} | " + " | ".join(cells) + f" | {x['tracked']:.0f} | {', '.join(st)} | {x['hwm']:.0f} |")
EOF
