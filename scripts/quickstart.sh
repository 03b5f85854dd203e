#!/usr/bin/env bash
# The main job: installs what is missing, builds, prepares a default corpus (English text from
# Debian's `fortunes` package, byte-level tokens) and trains a small GPT on it for a few minutes on
# 2 ranks (FULL_SHARD, bf16 mixed precision), printing the loss as it falls, the memory per rank
# and a generated sample at the end. Extra arguments are config overrides (--train.steps 100).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh --demo
scripts/build.sh meshtrain
F=/usr/share/games/fortunes
if [[ ! -f data/default/train.bin ]]; then
  inputs=()
  for f in fortunes literature wisdom science people humorists computers definitions; do
    [[ -f $F/$f ]] && inputs+=(--input "$F/$f")
  done
  ./build/meshtrain prepare --tokenizer byte --out data/default --val-fraction 0.05 "${inputs[@]}"
fi
exec ./build/meshtrain launch -n 2 -- train --config configs/default.toml "$@"
