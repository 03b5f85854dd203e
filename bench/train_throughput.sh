#!/usr/bin/env bash
# Training throughput of the benchmark config next to the GEMM ceiling measured in the same run
# (results and discussion in docs/bench-notes/train.md and docs/benchmarks.md).
#
# Config: --model.preset gpt2-small-cpu (GPT-2: 6 layers, 6 heads, width 384, seq 256, vocab
# 50257 padded to 50304, tied head) with --train.micro_batch 4 (1024 tokens per step), one process,
# fp32 and bf16, 1 and 2 threads, a fixed number of steps, no eval.
#
# Each repeat measures, one after the other (order reversed on every second repeat):
#   1. the GEMM ceiling: bench/kernel_bench times meshtrain's gemm_f32 (= oneDNN dnnl_sgemm behind a
#      thin wrapper) and gemm_bf16 at every linear-layer shape of the model (N = B*T = 1024 rows;
#      qkv, attn_proj, fc, proj, lm_head; forward NT, dinp NN, dW TN), 1 and 2 threads, as the
#      median time per call (robust to the short preemptions of a shared machine); the ceiling is
#      the rate at which one training step's GEMMs would run at those speeds:
#      sum(flops) / sum(flops_i / rate_i), each shape weighted by how often a step runs it
#      (6 layers x qkv/attn_proj/fc/proj, 1 x lm_head). (bench/gemm_libs measures the same
#      shapes for several libraries; it times a burst of calls, which the load on a shared
#      machine disturbs more: see docs/bench-notes/train.md.)
#      gemm_bf16 is the engine's own bf16 path on this CPU: the AMX tile GEMM, oneDNN's bf16 matmul
#      (AVX512_BF16), or, on a CPU without bf16 arithmetic (AVX2, plain AVX-512), bf16 blocks
#      widened to fp32 and sgemm - there the fp32 sgemm ceiling is the best any bf16 path reaches.
#      kernel_bench also measures the cores' fp32 FMA peak (independent vector FMA chains on every
#      thread): no GEMM, and so no engine that performs the model's flops, can run faster.
#   2. `meshtrain train` in fp32 1t, fp32 2t, bf16 1t, bf16 2t.
#   3. with --pytorch PY: bench/pytorch_compare.py (PyTorch eager, same model, tcmalloc) in fp32
#      and bf16 (torch.autocast) at each thread count ("1" pins torch and OpenBLAS to one thread, "2" gives both two).
# Reported per configuration: median over repeats of the run's tokens/s (the median of the per-step
# tokens_per_s of the metrics file, steps after the first), achieved GFLOP/s = tokens/s x
# flops/token (6 N + 12 L h T, N = parameters without the position table, h = n_embd, T = seq),
# the ceiling, and the median over repeats of achieved / ceiling (a ratio measured side by side).
# "cpu share" = process CPU time / (wall time x threads) of the whole run: < 1 means the machine
# was busy with other work (or threads were idle), so the wall-clock figures are pessimistic.
# "steal" per run: the share of the machine's CPU time the hypervisor gave other guests meanwhile.
#
# usage: bench/train_throughput.sh [options]
#   --steps N        training steps per run (default 12; the first is excluded as warm-up)
#   --repeats R      repeats (default 3); medians are reported
#   --threads LIST   thread counts (default "1 2")
#   --dtypes LIST    dtypes (default "fp32 bf16")
#   --kb-time S      kernel_bench --min-time: seconds of samples per op (default 0.03)
#   --build DIR      build directory with meshtrain and bench/kernel_bench (default build-bench;
#                    configured with -DMESHTRAIN_BENCH=ON and built when missing)
#   --data DIR       token shards (default /tmp/mt_benchdata, made from the fortunes file with the
#                    byte tokenizer when missing; ids < 256 are valid for the 50257-token model)
#   --pytorch PY     also run PyTorch eager (each of --dtypes) in every repeat with interpreter PY (e.g.
#                    /usr/bin/python3 with Debian's python3-torch); the summary then gives the
#                    meshtrain / PyTorch ratio per thread count and the largest ratio the FMA peak
#                    allows (peak / PyTorch's achieved model GFLOP/s). A comma-separated list
#                    (e.g. python3,/usr/bin/python3: PyPI's torch and Debian's) runs each in every
#                    repeat, a table per interpreter, then the ratio against the faster one per repeat
#   --out DIR        where raw outputs go (default: a new /tmp/mt_train_throughput.XXXXXX)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/bench/common.sh"
STEPS=12
REPEATS=3
THREADS="1 2"
DTYPES="fp32 bf16"
KB_TIME=0.03
BUILD=$ROOT/build-bench
DATA=/tmp/mt_benchdata
OUT=
PYTORCH=
bench_opt --steps STEPS --repeats REPEATS --threads THREADS --dtypes DTYPES --kb-time KB_TIME --pytorch PYTORCH
bench_parse "$@"
bench_out train_throughput

bench_setup "$BUILD" "$DATA" bench/kernel_bench

MODEL=(--model.preset gpt2-small-cpu --train.micro_batch 4)
TRAIN_ARGS=("${MODEL[@]}" --data.train "$DATA/train.bin" --data.val '' --train.steps "$STEPS"
  --train.eval_every 0 --train.sample_tokens 0 --log.print_every 1000)
GEMM_THREADS=$(echo $THREADS | tr ' ' ',')

echo "train_throughput: $REPEATS repeats x $STEPS steps, threads {$THREADS}, dtypes {$DTYPES}; raw output in $OUT"
grep -m1 'model name' /proc/cpuinfo | sed 's/^/cpu: /'
"$MT" bench --cpu-isa | sed 's/^/meshtrain: /'
echo "cpu flags: $(grep -m1 -o -w 'avx512f\|avx512_bf16\|avx2\|fma' /proc/cpuinfo | sort -u | tr '\n' ' ')($(nproc) cpus)"

# PyTorch at its best: OpenBLAS 0.3.21 (Debian's torch 1.13) does not recognise newer CPUs and
# falls back to generic kernels; name the core type it should use (only for the PyTorch runs).
if [[ -z "${OPENBLAS_CORETYPE:-}" ]]; then
  flags=$(grep -m1 '^flags' /proc/cpuinfo)
  if grep -q GenuineIntel /proc/cpuinfo; then
    if [[ $flags == *amx_bf16* || $flags == *avx512_bf16* ]]; then CORETYPE=SapphireRapids
    elif [[ $flags == *avx512f* ]]; then CORETYPE=SkylakeX; else CORETYPE=Haswell; fi
  elif [[ $flags == *avx512f* ]]; then CORETYPE=SkylakeX  # Zen 4/5: OpenBLAS's AVX-512 kernels
  else CORETYPE=Zen; fi
else
  CORETYPE=$OPENBLAS_CORETYPE
fi
PYS=()
[[ -n "$PYTORCH" ]] && IFS=, read -r -a PYS <<<"$PYTORCH"
TORCH_LABELS=()
for i in "${!PYS[@]}"; do
  check_torch_blas "${PYS[$i]}"
  ver=$("${PYS[$i]}" -c 'import torch; print(torch.__version__)' 2>/dev/null) ||
    { echo "train_throughput.sh: ${PYS[$i]} cannot import torch" >&2; exit 2; }
  TORCH_LABELS+=("torch $ver (${PYS[$i]})")
  echo "PyTorch runs [$i]: OPENBLAS_CORETYPE=$CORETYPE, ${TORCH_LABELS[$i]}"
done
printf '%s\n' "${TORCH_LABELS[@]}" >"$OUT/torch_labels.txt"

runs=()
for dt in $DTYPES; do for t in $THREADS; do runs+=("$dt:$t"); done; done

for ((r = 1; r <= REPEATS; r++)); do
  echo "repeat $r/$REPEATS: load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/load.txt"
  order=("${runs[@]}")
  if ((r % 2 == 0)); then  # reverse the order every second repeat
    order=(); for ((i = ${#runs[@]} - 1; i >= 0; i--)); do order+=("${runs[$i]}"); done
  fi
  "$BUILD/bench/kernel_bench" --threads "$GEMM_THREADS" --min-time "$KB_TIME" \
    >"$OUT/gemm_r$r.txt" 2>"$OUT/gemm_r$r.err"
  grep -A2 '^Per training step' "$OUT/gemm_r$r.txt" | sed 's/^/  kernel_bench: /' 
  for run in "${order[@]}"; do
    dt=${run%%:*}; t=${run##*:}
    tag=${dt}_${t}t_r$r
    TIMEFORMAT='%R %U %S'
    snap=$(cpu_snapshot)
    { time "$MT" train "${TRAIN_ARGS[@]}" --train.dtype "$dt" --train.threads "$t" \
        --log.metrics_out "$OUT/$tag.jsonl" >"$OUT/$tag.log" 2>&1; } 2>"$OUT/$tag.time"
    read -r wall user sys <"$OUT/$tag.time" || true
    printf '  %-10s wall %6ss  user %6ss  sys %5ss  steal %s\n' "$dt ${t}t" "$wall" "$user" "$sys" \
      "$(steal_since "$snap")" | tee -a "$OUT/load.txt"
  done
  for i in "${!PYS[@]}"; do
    for dt in $DTYPES; do for t in $THREADS; do
      f=$OUT/torch${i}_${dt}_${t}t_r$r
      OPENBLAS_CORETYPE=$CORETYPE "${PYS[$i]}" "$ROOT/bench/pytorch_compare.py" --mode eager --dtypes "$dt" --threads "$t" \
        --steps "$((STEPS - 1))" --bf16-steps "$((STEPS - 1))" --warmup 1 >"$f.json" 2>"$f.err"
      printf '  %-14s %s tokens/s\n' "torch[$i] $dt ${t}t" \
        "$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["tokens_per_s"])' "$f.json")"
    done; done
  done
done
echo "after: load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/load.txt"

python3 - "$OUT" "$REPEATS" "$THREADS" "$DTYPES" <<'EOF'
import json, re, statistics, sys
out, R = sys.argv[1], int(sys.argv[2])
CPUINFO = open("/proc/cpuinfo").read()
# bf16 arithmetic per cycle against the fp32 FMA peak (compute_probe.cpp): AMX-BF16 16x, AVX512-BF16 2x
BF16_FACTOR = 16 if re.search(r"\bamx_bf16\b", CPUINFO) else 2 if re.search(r"\bavx512_bf16\b", CPUINFO) else 1
threads = [int(t) for t in sys.argv[3].split()]
dtypes = sys.argv[4].split()
L, C, T, V, P_ALL = 6, 384, 256, 50304, None

def ceilings(path):
    """flop-weighted GEMM rate (wall clock, median per call) per column of kernel_bench's table"""
    cols, acc = None, {}
    for line in open(path):
        if line.startswith("| layer | op |"):
            cols = [c.strip() for c in line.strip().strip("|").split("|")][3:]
            continue
        m = re.match(r"\|\s*(\w+) [^|]*\|\s*\w+\s*\|\s*(\d+)x(\d+)x(\d+)\s*\|(.*)", line)
        if cols and m:
            per_step = 1 if m.group(1) == "lm_head" else L
            flops = 2.0 * int(m.group(2)) * int(m.group(3)) * int(m.group(4)) * per_step
            cells = [v.split() for v in m.group(5).strip().strip("|").split("|")]
            for c, v in zip(cols, cells):
                c = c.replace("f32", "sgemm").replace("bf16", "mtbf16")
                for key, val in ((c, v[0]), (c + " per-cpu-s", v[1].strip("()"))):
                    f, t = acc.get(key, (0.0, 0.0))
                    acc[key] = (f + flops, t + flops / float(val))
    res = {c: f / t for c, (f, t) in acc.items()}
    for line in open(path):
        if line.startswith("fp32 FMA peak"):
            for t, g in re.findall(r"(\d+)t ([\d.]+) GFLOP/s", line):
                res[f"peak {t}t"] = float(g)
    return res

def run(dt, t, r):
    tag = f"{out}/{dt}_{t}t_r{r}"
    recs = [json.loads(l) for l in open(tag + ".jsonl") if l.strip()]
    steps = [x for x in recs if not x.get("final")]
    fin = [x for x in recs if x.get("final")][0]
    tps = statistics.median(x["tokens_per_s"] for x in steps[1:])
    wall, user, sys_ = map(float, open(tag + ".time").read().split()[-3:])
    return tps, fin, (user + sys_) / (wall * t)

gem = [ceilings(f"{out}/gemm_r{r}.txt") for r in range(1, R + 1)]
fin = run(dtypes[0], threads[0], 1)[1]
n_params = fin["num_params"]
n_mat = n_params - T * C  # the position table is a lookup, not a matmul
fpt = 6.0 * n_mat + 12.0 * L * C * T
print(f"\nparameters {n_params} (without the position table {n_mat}); flops/token = 6N + 12*L*h*T = {fpt/1e6:.2f} M")
print("GEMM ceiling per repeat (GFLOP/s, flop-weighted over the model's GEMM shapes; wall clock, and per process CPU-second):")
for r, g in enumerate(gem, 1):
    print(f"  repeat {r}: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(g.items())))
med = lambda xs: statistics.median(xs)
print()
print("| dtype | threads | tokens/s | GFLOP/s | sgemm ceiling | % of sgemm ceiling | bf16-path ceiling (mtbf16) | % of it | FMA peak | % of it | cpu share | per-repeat tokens/s |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
res = {}
for dt in dtypes:
    for t in threads:
        rs = [run(dt, t, r) for r in range(1, R + 1)]
        tps = [x[0] for x in rs]
        gf = [x * fpt / 1e9 for x in tps]
        c32 = [g.get(f"sgemm {t}t", float("nan")) for g in gem]
        cbf = [g.get(f"mtbf16 {t}t", float("nan")) for g in gem]
        cpk = [g.get(f"peak {t}t", float("nan")) for g in gem]
        r32 = med([a / c for a, c in zip(gf, c32)])
        rbf = med([a / c for a, c in zip(gf, cbf)])
        rpk = med([a / c for a, c in zip(gf, cpk)])
        res[(dt, t)] = med(tps)
        print(f"| {dt} | {t} | {med(tps):.0f} | {med(gf):.1f} | {med(c32):.1f} | {100*r32:.0f}% | {med(cbf):.1f} | {100*rbf:.0f}% "
              f"| {med(cpk):.1f} | {100*rpk:.0f}% "
              f"| {med([x[2] for x in rs]):.2f} | {' / '.join(f'{x:.0f}' for x in tps)} |")
print()
for dt in dtypes:
    if (dt, 1) in res and (dt, 2) in res:
        print(f"{dt}: 2 threads / 1 thread = {res[(dt, 2)] / res[(dt, 1)]:.2f}x")
if ("fp32", 1) in res and ("bf16", 1) in res:
    for t in threads:
        print(f"bf16 / fp32 at {t} thread(s) = {res[('bf16', t)] / res[('fp32', t)]:.2f}x")

labels = [l.strip() for l in open(f"{out}/torch_labels.txt") if l.strip()]
torch_tps = lambda i, dt, t, r: json.load(open(f"{out}/torch{i}_{dt}_{t}t_r{r}.json"))["tokens_per_s"]
mt_tps = {(dt, t): [run(dt, t, r)[0] for r in range(1, R + 1)] for dt in dtypes for t in threads}
for i, label in enumerate(labels):
    for dt in dtypes:
        print()
        print(f"PyTorch [{i}] {label}, eager {dt} ({'torch.autocast bf16' if dt == 'bf16' else 'fp32'}; "
              "bench/pytorch_compare.py) in the same repeats.")
        print("'bound' = the FMA peak (for bf16 x2 with AVX512-BF16, x16 with AMX-BF16) / PyTorch's model GFLOP/s:")
        print("the largest meshtrain/PyTorch ratio any engine performing the model's flops could reach.")
        print("'GEMM bound' = meshtrain's own GEMM ceiling of this dtype measured in the same repeat (sgemm / mtbf16 above)")
        print("/ PyTorch's model GFLOP/s: the ratio meshtrain would reach if every flop ran at its GEMM rate and")
        print("nothing else in the step cost any time.")
        print()
        print("| dtype | threads | PyTorch tokens/s | PyTorch GFLOP/s | meshtrain tokens/s | meshtrain / PyTorch | bound | GEMM bound | per-repeat ratio |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
        for t in threads:
            pt = [torch_tps(i, dt, t, r) for r in range(1, R + 1)]
            mt = mt_tps[(dt, t)]
            pk = [g.get(f"peak {t}t", float("nan")) * (BF16_FACTOR if dt == "bf16" else 1) for g in gem]
            ratio = [a / b for a, b in zip(mt, pt)]
            bound = [p / (b * fpt / 1e9) for p, b in zip(pk, pt)]
            gc = [g.get(f"{'mtbf16' if dt == 'bf16' else 'sgemm'} {t}t", float("nan")) for g in gem]
            gbound = [c / (b * fpt / 1e9) for c, b in zip(gc, pt)]
            print(f"| {dt} | {t} | {med(pt):.0f} | {med(pt) * fpt / 1e9:.1f} | {med(mt):.0f} | {med(ratio):.2f}x | {med(bound):.2f}x "
                  f"| {med(gbound):.2f}x | {' / '.join(f'{x:.2f}' for x in ratio)} |")
if len(labels) > 1:
    print()
    print("Against the faster PyTorch of each repeat (meshtrain / max over the interpreters):")
    print()
    print("| dtype | threads | meshtrain / faster PyTorch | per repeat (faster one) |")
    print("|---|---:|---:|---|")
    for dt in dtypes:
        for t in threads:
            best = [max(range(len(labels)), key=lambda i: torch_tps(i, dt, t, r)) for r in range(1, R + 1)]
            ratio = [m / torch_tps(i, dt, t, r) for m, i, r in zip(mt_tps[(dt, t)], best, range(1, R + 1))]
            print(f"| {dt} | {t} | {med(ratio):.2f}x | {' / '.join(f'{x:.2f} ([{i}])' for x, i in zip(ratio, best))} |")
EOF
