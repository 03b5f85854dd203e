#!/usr/bin/env bash
# The main job: installs what is missing, builds, prepares a default corpus (English text from
# Debian's `fortunes` package, GPT-2 BPE tokens from assets/gpt2) and trains a small GPT on it
# for a few minutes on 2 ranks (FULL_SHARD; bf16 mixed precision where the CPU has native bf16,
# fp32 elsewhere), printing the validation loss before and after, the loss as it falls, the
# memory per rank and a generated sample at the end. Extra arguments are config overrides
# (--train.steps 100).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh --demo
scripts/build.sh meshtrain
F=/usr/share/games/fortunes
D=data/fortunes-gpt2
if [[ ! -f $D/train.bin ]]; then
  mkdir -p "$D"
  # Every English collection (not the .dat indexes, the ASCII art or translate-me), as prose: no
  # `%` lines between fortunes, no "-- Author" attribution lines, no indentation, blank lines or
  # line breaks inside a collection (one line of running text per file).
  for f in "$F"/*; do
    case "$(basename "$f")" in *.dat | *.u8 | art | ascii-art | translate-me) continue ;; esac
    if [[ -f $f ]]; then
      sed -e '/^%$/d' -e 's/^[[:space:]]*//' -e '/^--/d' -e '/^$/d' "$f" | tr '\n' ' '
      echo
    fi
  done > "$D/fortunes.txt"
  ./build/meshtrain prepare --tokenizer gpt2 --input "$D/fortunes.txt" --out "$D" --val-fraction 0.05
fi
dtype=fp32
grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo && dtype=bf16  # emulated bf16 is slower than fp32
echo "precision: $dtype ($( [[ $dtype == bf16 ]] && echo "native bf16 on this CPU" || echo "this CPU has no native bf16"))"
exec ./build/meshtrain launch -n 2 -- train --config configs/quickstart.toml --train.dtype "$dtype" "$@"
