#!/usr/bin/env bash
# Checkpoints at scale (summary in docs/benchmarks.md): saving and loading a model of
# ~300 MB of checkpoint state (gpt2 arch, 8 layers, width 512: 25.4M parameters x 12 bytes of fp32
# weights + two Adam moments) on 1, 2 and 4 ranks under FULL_SHARD, the sharded format (every rank
# writes its own file; sync and async) against the rank-0 "full" path (rank 0 gathers and writes
# everything, unit by unit). Per run: the training stall per save (main-thread time in checkpoint
# code, rank 0), the step time, bytes written per rank (metadata.json / the files), and the extra
# workspace peak per rank against the same run without checkpoints; then a resume from step 2:
# load time and bytes read (rank 0) and the loading's workspace peak.
#
# One machine: all ranks share one disk and the page cache, so wall times do not fall as 1/N
# here; bytes and memory per rank do. docs/checkpoints.md has the arithmetic for 70B on 64 GPUs.
#
# usage: bench/checkpoint_scale.sh [--ranks "1 2 4"] [--build DIR] [--data DIR] [--out DIR]
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/bench/common.sh"
RANKS="1 2 4"
BUILD=$ROOT/build
DATA=/tmp/mt_ckbench_data
OUT=
bench_opt --ranks RANKS
bench_parse "$@"
bench_out ckscale
# The corpus: this repository's sources and docs, byte-level (what the model learns does not matter here).
if [[ ! -f "$DATA/train.bin" ]]; then
  [[ -x "$BUILD/meshtrain" ]] || bench_setup "$BUILD" /dev/null 2>/dev/null || true
  "$BUILD/meshtrain" prepare --tokenizer byte --input "$ROOT/docs" --input "$ROOT/src" --out "$DATA" >/dev/null
fi
bench_setup "$BUILD" "$DATA"
echo "load at start: $(cut -d' ' -f1-3 /proc/loadavg)   out: $OUT"

MODEL=(--model.preset gpt2-mini --model.n_layer 8 --model.n_embd 512 --model.n_head 8 --model.seq_len 64)
ARGS=("${MODEL[@]}" --data.train "$DATA/train.bin" --data.val '' --train.eval_every 0 --train.threads 1
  --train.warmup_steps 1 --parallel.strategy FULL_SHARD --log.print_every 1000)

summary() {  # summary METRICS CKDIR N LABEL BASELINE_METRICS
  python3 - "$@" <<'PY'
import json, os, sys
m, ck, n, label, base = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
def final(p):
    return [json.loads(l) for l in open(p) if '"final"' in l][-1]
def steps(p):
    return [json.loads(l)["step_ms"] for l in open(p) if '"final"' not in l]
f, b = final(m), final(base)
def ws(j):
    per = j.get("mem_peak_by_category_per_rank", [j["mem_peak_by_category"]])
    return [r["workspace"] for r in per]
extra = [x - y for x, y in zip(ws(f), ws(b))]
step = os.path.join(ck, open(os.path.join(ck, "latest")).read().strip())
if os.path.exists(os.path.join(step, "metadata.json")):
    meta = json.load(open(os.path.join(step, "metadata.json")))
    written = [x["bytes"] for x in meta["files"]]
else:
    written = [os.path.getsize(os.path.join(step, x)) for x in ("model.safetensors", "optimizer.safetensors")]
    written = [sum(written)] + [0] * (n - 1)
c = f["checkpoint"]
st = steps(m)
print(f"{label:<13} {n:>2}  stall/save {c['stall_ms_per_save']:6.0f} ms (+{c.get('final_wait_ms', 0):4.0f} at end)  "
      f"step {sorted(st)[len(st)//2]:5.0f} ms  "
      f"written/rank MB {' '.join(f'{x/1e6:6.1f}' for x in written)}  extra workspace/rank MB "
      f"{' '.join(f'{x/2**20:6.1f}' for x in extra)}")
PY
}

load_summary() {  # load_summary METRICS N LABEL
  python3 - "$@" <<'PY'
import json, sys
m, n, label = sys.argv[1], int(sys.argv[2]), sys.argv[3]
f = [json.loads(l) for l in open(m) if '"final"' in l][-1]
l = f["checkpoint_load"]
br = l.get("bytes_read")
print(f"{label:<13} {n:>2}  load {l['ms']:8.0f} ms  bytes read (rank 0) "
      f"{'every byte of both files' if br is None else f'{br/1e6:.1f} MB'}  "
      f"load workspace peak (rank 0) {l['workspace_peak_bytes']/2**20:.1f} MB")
PY
}

for N in $RANKS; do
  MB=$((8 / N))
  run() {  # run TAG extra args...
    local tag=$1
    shift
    rm -rf "$OUT/ck_$tag"
    "$MT" launch -n "$N" -- train "${ARGS[@]}" --train.micro_batch "$MB" --log.metrics_out "$OUT/m_$tag.jsonl" \
      "$@" >"$OUT/log_$tag.txt" 2>&1
  }
  run "base_$N" --train.steps 6
  for fmt in sharded async full; do
    extra=(--train.checkpoint_format "$fmt")
    [[ $fmt == async ]] && extra=(--train.checkpoint_format sharded --train.checkpoint_async true)
    run "${fmt}_$N" --train.steps 6 --train.checkpoint_every 2 --train.checkpoint_dir "$OUT/ck_${fmt}_$N" "${extra[@]}"
    summary "$OUT/m_${fmt}_$N.jsonl" "$OUT/ck_${fmt}_$N" "$N" "save $fmt" "$OUT/m_base_$N.jsonl"
  done
  for fmt in sharded full; do
    "$MT" launch -n "$N" -- train "${ARGS[@]}" --train.micro_batch "$MB" --train.steps 3 \
      --train.resume "$OUT/ck_${fmt}_$N/step_00000002" --log.metrics_out "$OUT/m_load_${fmt}_$N.jsonl" \
      >"$OUT/log_load_${fmt}_$N.txt" 2>&1
    load_summary "$OUT/m_load_${fmt}_$N.jsonl" "$N" "load $fmt"
  done
done
echo "load at end: $(cut -d' ' -f1-3 /proc/loadavg)"
