#!/usr/bin/env bash
# The first thing to run: installs what is missing, builds, prepares a default corpus (the King
# James Bible from Debian's `bible-kjv` package, one verse per line, GPT-2's BPE cut to its 2,048
# most frequent tokens) and trains a small GPT on it for 1 to 3 minutes on 2 ranks
# (SHARD_GRAD_OP; bf16 mixed precision where the CPU has native bf16, fp32 elsewhere), printing
# the validation loss (nats per token and bits per byte of text) before and after, the loss as it
# falls, the memory per rank, a generated sample and what to try next. Extra arguments are config
# overrides (--train.steps 100).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh --demo
scripts/build.sh meshtrain
D=data/kjv
if [[ ! -f $D/train.bin || ! -f $D/val.bin ]]; then
  mkdir -p "$D"
  # `bible` prints chapter headings and numbered verses wrapped at the line width: keep the verses,
  # one per line, without their numbers.
  bible -l 5000 gen1:1-rev22:21 | awk '
    /^ +[0-9]+ / { if (v != "") print v; sub(/^ +[0-9]+ /, ""); v = $0; next }
    /^$/ || /^[1-3]? ?[A-Z][a-z]+( [A-Za-z]+)* [0-9]+$/ { next }
    { v = v " " $0 }
    END { if (v != "") print v }' > "$D/kjv.txt"
  ./build/meshtrain prepare --tokenizer gpt2 --vocab-size 2048 --input "$D/kjv.txt" --out "$D" --val-fraction 0.02
fi
dtype=fp32
grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo && dtype=bf16  # emulated bf16 is slower than fp32
steps=$(sed -n 's/^steps *= *\([0-9]*\).*/\1/p' configs/quickstart.toml)
echo "precision: $dtype ($( [[ $dtype == bf16 ]] && echo "native bf16 on this CPU" || echo "this CPU has no native bf16"))"
echo "training $steps steps on 2 ranks: 1 to 3 minutes on 2 idle cores (longer when the machine is busy);"
echo "Ctrl-C stops cleanly after the current step and keeps a checkpoint"
./build/meshtrain launch -n 2 -- train --config configs/quickstart.toml --train.dtype "$dtype" "$@"
cat <<'EOF'

What to try next:
  ./build/meshtrain sample --checkpoint data/kjv/checkpoint --prompt "And Jesus said" --tokens 200
  ./build/meshtrain plot --metrics data/kjv/metrics.jsonl --out data/kjv/plot.svg   # the run's curves
  ./build/meshtrain launch -n 2 -- train --config configs/quickstart.toml --train.steps 3000   # 4x longer: lower loss
  ./build/meshtrain plan --model llama3-8b --gpus 16 --cluster h100-80g-ib400   # lay out a cluster run
  ./build/meshtrain --help                                                        # every command
README.md has the tour: your own text, a Hugging Face model, several machines.
EOF
