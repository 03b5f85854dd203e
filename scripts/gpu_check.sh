#!/usr/bin/env bash
# The GPU check, run on the GPU machine from the kit that scripts/gpu_kit.sh builds:
#
#   gpu_kit/gpu_check.sh                      the check; results under $OUT (else ./gpu_check_out)
#   gpu_kit/gpu_check.sh --reference FILE     (gpu_kit.sh) the parity configs' CPU losses into FILE
#
# Single process, no mpirun, at most about 8 minutes (each step has a time limit and the steps
# after the budget are skipped with that reason). It writes gpu_check.json, gpu_check.md (a table
# of every step: ok / FAIL / skipped, and what it measured) and gpu_check.log (every command's
# output). The steps (docs/gpu.md):
#   1. environment: the GPU, driver and memory (nvidia-smi), the host, the kit's MANIFEST;
#   2. cuBLASLt, which the kit does not carry: found with `ldconfig -p`, in /usr/local/cuda/lib64,
#      or in the lib folder of python3's nvidia-cublas wheel (torch's), then put on
#      LD_LIBRARY_PATH; missing libraries stop the check with their names;
#   3. no GPU stops the check here;
#   4. `meshtrain check-ops --device cuda --shapes all` with CUDA_LAUNCH_BLOCKING=1;
#   5. compute-sanitizer memcheck, racecheck and synccheck on check-ops at small shapes (every CUDA
#      kernel), skipped with the reason when compute-sanitizer is absent;
#   5b. the attention kernels timed with CUDA events (`meshtrain bench attention`): the simple fp32
#      kernels and the tensor-core bf16 ones, ms per call, TFLOP/s and the share of the bf16 peak;
#   6. training on the GPU (train.device = cuda), found by a 2-step run; where it is refused the
#      refusal line is reported and 7-9 are skipped;
#   7. loss parity of GPT-2 and Llama (fp32, bf16) against the kit's CPU losses, 8 steps;
#   8. GPT-2 124M, bf16, T 1024: tokens/s and MFU against the GPU's dense bf16 peak;
#   9. the same model in PyTorch, eager and torch.compile, when python3 imports torch with CUDA.
# Exit status: 0 every step ran and passed, 1 a step failed or was skipped, 2 missing libraries.
set -uo pipefail
KIT=$(cd "$(dirname "$0")" && pwd)
BIN="$KIT/bin/meshtrain"
export LD_LIBRARY_PATH="$KIT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
COMMON=(--data.train "$KIT/data/train.bin" --data.val "$KIT/data/val.bin" --data.tokenizer byte --train.steps 8
  --train.micro_batch 4 --model.seq_len 64 --train.eval_every 0 --train.sample_tokens 0 --log.print_every 100
  --train.warmup_steps 2 --train.lr 3e-3)
# name|arguments|largest relative loss difference accepted
PARITY=("gpt2_fp32|--model.preset gpt2-mini --train.dtype fp32|1e-3" "gpt2_bf16|--model.preset gpt2-mini --train.dtype bf16|1e-2"
  "llama_fp32|--model.preset llama-mini --train.dtype fp32|1e-3" "llama_bf16|--model.preset llama-mini --train.dtype bf16|1e-2")
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# losses DEVICE NAME ARGS...: trains and prints "NAME loss1 loss2 ..." (returns the run's status).
losses() {
  local dev=$1 name=$2
  shift 2
  "$BIN" train "${COMMON[@]}" "$@" --train.device "$dev" --log.metrics_out "$TMP/$name.jsonl" >"$TMP/$name.log" 2>&1 ||
    return 1
  python3 -c 'import json,sys
r=[json.loads(l) for l in open(sys.argv[1])]
print(sys.argv[2], " ".join(repr(x["loss"]) for x in r if "loss" in x and "step" in x))' "$TMP/$name.jsonl" "$name"
}

if [ "${1:-}" = --reference ]; then
  [ $# = 2 ] || { echo "usage: gpu_check.sh --reference FILE" >&2; exit 2; }
  : >"$2"
  for p in "${PARITY[@]}"; do
    IFS='|' read -r name args _ <<<"$p"
    # shellcheck disable=SC2086
    losses cpu "$name" $args >>"$2" || { echo "gpu_check.sh: the CPU run $name failed:" >&2; tail -3 "$TMP/$name.log" >&2; exit 1; }
  done
  exit 0
fi
[ $# = 0 ] || { echo "usage: gpu_check.sh [--reference FILE] (results go under \$OUT)" >&2; exit 2; }

OUTDIR=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu_check.log"
: >"$LOG"
: >"$TMP/rows"
BUDGET=${GPU_CHECK_BUDGET_S:-450}
status=0
# row STEP RESULT DETAIL: one line of the report (RESULT ok / FAIL / skipped).
row() {
  printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$TMP/rows"
  echo "gpu_check: $1: $2: $3" | tee -a "$LOG"
  [ "$2" = ok ] || status=1
}
# left: seconds of the budget left.
left() { echo $((BUDGET - SECONDS)); }
# run LIMIT_S LABEL CMD...: the command's output into the log; its status (124: out of time).
run() {
  local lim=$1 label=$2
  shift 2
  echo "== $label: $*" >>"$LOG"
  timeout "$lim" "$@" >"$TMP/out" 2>&1
  local rc=$?
  cat "$TMP/out" >>"$LOG"
  return $rc
}
json_str() { printf '"%s"' "$(printf '%s' "$1" | sed 's/\\/\\\\/g; s/"/\\"/g')"; }
report() {
  {
    echo "{"
    echo "  \"steps\": ["
    local first=1
    while IFS=$'\t' read -r s r d; do
      [ $first = 1 ] || echo ","
      first=0
      printf '    {"step": %s, "result": %s, "detail": %s}' "$(json_str "$s")" "$(json_str "$r")" "$(json_str "$d")"
    done <"$TMP/rows"
    echo
    echo "  ],"
    echo "  \"passed\": $([ $status = 0 ] && echo true || echo false)"
    echo "}"
  } >"$OUTDIR/gpu_check.json"
  {
    echo "| step | result | detail |"
    echo "|---|---|---|"
    while IFS=$'\t' read -r s r d; do echo "| $s | $r | ${d//|/\\|} |"; done <"$TMP/rows"
  } >"$OUTDIR/gpu_check.md"
  echo "gpu_check: $([ $status = 0 ] && echo PASS || echo 'NOT PASSED'); report in $OUTDIR/gpu_check.md"
}

# 1. Environment.
gpu=""
if command -v nvidia-smi >/dev/null && q=$(nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap \
  --format=csv,noheader 2>>"$LOG") && [ -n "$q" ]; then
  gpu=$(head -1 <<<"$q" | cut -d, -f1)
  row environment ok "GPU: $(head -1 <<<"$q" | sed 's/, */; /g')"
else
  row environment FAIL "no GPU: nvidia-smi $(command -v nvidia-smi >/dev/null && echo 'found no device' || echo 'is not installed')"
fi
row host ok "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) CPUs; kit: $(head -1 "$KIT/MANIFEST" 2>/dev/null)"

# 2. cuBLASLt (and whatever else the binaries lack).
dirs=()
while read -r lib; do
  p=$(ldconfig -p 2>/dev/null | awk -v l="$lib" '$1 == l {print $NF; exit}')
  for d in ${p:+"$(dirname "$p")"} /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    "$(python3 -c 'import nvidia.cublas as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null)" \
    "$(python3 -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null)"; do
    if [ -n "$d" ] && [ -e "$d/$lib" ]; then dirs+=("$d"); break; fi
  done
done < <(readelf -d "$BIN" "$KIT/bin/test_kernels" | sed -n 's/.*Shared library: \[\(libcublas[^]]*\)\]/\1/p' | sort -u)
for d in "${dirs[@]}"; do export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$d"; done
missing=$(for b in "$KIT"/bin/*; do ldd "$b"; done 2>&1 | awk '/not found/{print $1}' | sort -u | tr '\n' ' ')
if [ -n "$missing" ]; then
  row libraries FAIL "missing: ${missing}(looked in: ldconfig -p, /usr/local/cuda/lib64, python3's nvidia-cublas and torch lib folders)"
  report
  exit 2
fi
row libraries ok "cuBLASLt from ${dirs[*]:-the default search path}"

# 3. No GPU: nothing else can run.
if [ -z "$gpu" ]; then
  row gpu-steps skipped "no GPU: check-ops, compute-sanitizer and training need one"
  report
  exit 1
fi

# 4. Every kernel against the CPU.
if run 150 check-ops env CUDA_LAUNCH_BLOCKING=1 "$BIN" check-ops --device cuda --shapes all; then
  row check-ops ok "$(tail -1 "$TMP/out")"
else
  rc=$?
  why="status $rc"
  [ $rc = 124 ] && why="did not finish in 150 s"
  row check-ops FAIL "$why, $(grep -c FAIL "$TMP/out") failing cases: $(grep -m1 -A1 FAIL "$TMP/out" | tr '\n' ' ' || tail -1 "$TMP/out")"
fi

# 5. compute-sanitizer.
san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer 2>/dev/null | head -1)
for tool in memcheck racecheck synccheck; do
  if [ -z "$san" ]; then
    row "sanitizer $tool" skipped "compute-sanitizer not found (PATH, /usr/local/cuda/bin)"
  elif [ "$(left)" -lt 60 ]; then
    row "sanitizer $tool" skipped "time budget spent"
  else
    run 60 "$tool" "$san" --tool "$tool" --error-exitcode 9 "$BIN" check-ops --device cuda --shapes small
    rc=$?
    summary=$(grep -m1 'ERROR SUMMARY' "$TMP/out" || tail -1 "$TMP/out")
    case $rc in
      0) row "sanitizer $tool" ok "$summary" ;;
      124) row "sanitizer $tool" skipped "stopped after 60 s: $summary" ;;
      *) row "sanitizer $tool" FAIL "status $rc: $summary" ;;
    esac
  fi
done

# 5b. The attention kernels timed per call with CUDA events: the simple fp32 ones against the
# tensor-core bf16 ones, GPT-2 124M's and a Llama-style shape, with the share of the dense bf16 peak
# (vendor data sheets, SXM parts unless named; also step 8's).
case "$gpu" in
  *H100*PCIe*) peak=756e12 ;; *H100* | *H200*) peak=989e12 ;; *A100*) peak=312e12 ;; *) peak=0 ;;
esac
peak_arg=()
[ "$peak" != 0 ] && peak_arg=(--peak "$(python3 -c 'import sys; print(float(sys.argv[1]) / 1e12)' "$peak")")
if [ "$(left)" -lt 60 ]; then
  row attention skipped "time budget spent"
elif run 60 attention "$BIN" bench attention --device cuda --shapes gpt2,llama --iters 5 "${peak_arg[@]}"; then
  while read -r shape dims kernel rest; do
    row "attention $shape $kernel" ok "$dims: $rest (ms/call, TFLOP/s, share of peak)"
  done < <(grep -E '^(gpt2|llama) ' "$TMP/out")
else
  row attention FAIL "status $?: $(tail -1 "$TMP/out")"
fi

# 6. Is training on the GPU wired?
if ! losses cuda probe --model.preset gpt2-mini --train.steps 2 >/dev/null; then
  cat "$TMP/probe.log" >>"$LOG"
  row training skipped "train.device = cuda refused: $(grep -m1 'meshtrain' "$TMP/probe.log" || tail -1 "$TMP/probe.log")"
  report
  exit 1
fi
row training ok "a 2-step run on cuda finished"

# 7. Parity with the CPU losses the kit carries.
for p in "${PARITY[@]}"; do
  IFS='|' read -r name args tol <<<"$p"
  # shellcheck disable=SC2086
  if ! got=$(losses cuda "$name" $args); then
    row "parity $name" FAIL "the run failed: $(tail -1 "$TMP/$name.log")"
    continue
  fi
  verdict=$(python3 -c 'import sys
ref = {l.split()[0]: [float(x) for x in l.split()[1:]] for l in open(sys.argv[1]) if l.strip()}
got = sys.argv[2].split(); name, g = got[0], [float(x) for x in got[1:]]
r = ref.get(name)
if not r or len(r) != len(g): print("FAIL no reference losses of the same length"); sys.exit()
d = max(abs(a - b) / max(abs(b), 1.0) for a, b in zip(g, r))
print("ok" if d <= float(sys.argv[3]) else "FAIL", "max relative loss difference %.2e over %d steps (accepted %s); last loss %.6f against %.6f" % (d, len(g), sys.argv[3], g[-1], r[-1]))' \
    "$KIT/ref/losses.txt" "$got" "$tol")
  row "parity $name" "${verdict%% *}" "${verdict#* }"
done

# 8. GPT-2 124M throughput (peak: step 5b).
if [ "$(left)" -lt 60 ]; then
  row "gpt2-124m bf16" skipped "time budget spent"
elif run 90 gpt2-124m "$BIN" train "${COMMON[@]}" --model.preset gpt2-124m --model.seq_len 1024 --train.micro_batch 8 \
  --train.dtype bf16 --train.steps 12 --train.device cuda --log.peak_flops "$peak" --log.metrics_out "$TMP/tp.jsonl"; then
  row "gpt2-124m bf16" ok "$(python3 -c 'import json,sys
r=[json.loads(l) for l in open(sys.argv[1])]; r=[x for x in r if "tokens_per_s" in x][2:]
t=sum(x["tokens_per_s"] for x in r)/len(r); m=[x["mfu"] for x in r if x.get("mfu")]
print("B 8, T 1024: %.0f tokens/s, MFU %s (steps 3-%d, peak %s FLOP/s)" % (t, "%.1f%%" % (100*sum(m)/len(m)) if m else "n/a", len(r)+2, sys.argv[2]))' "$TMP/tp.jsonl" "$peak")"
else
  row "gpt2-124m bf16" FAIL "status $?: $(tail -1 "$TMP/out")"
fi

# 9. PyTorch on the same model.
if ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  row pytorch skipped "python3 cannot import torch with CUDA"
elif [ "$(left)" -lt 90 ]; then
  row pytorch skipped "time budget spent"
elif run "$(($(left) - 5))" pytorch python3 "$KIT/gpu_torch_bench.py" --batch 8 --seq 1024 --steps 12 --peak "$peak"; then
  while read -r mode line; do row "pytorch $mode" ok "$line"; done < <(grep '^result ' "$TMP/out" | cut -d' ' -f2-)
else
  row pytorch FAIL "status $?: $(tail -1 "$TMP/out")"
fi
report
exit $status
