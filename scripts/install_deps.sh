#!/usr/bin/env bash
# Installs the Debian 12 packages meshtrain needs to build, test and run its demo (only the
# missing ones; uses sudo when not root). Usage: scripts/install_deps.sh [--demo | --test]
#   --demo  adds `bible-kjv` (the quickstart's English text) and `fortunes` (configs/default.toml's)
#   --test  adds the oracles of the reference tests: Debian's python3-torch (the Hugging Face
#           weight-layout check; with libopenblas0-pthread, without which its BLAS is the
#           unoptimised reference one and the bench scripts' PyTorch peer runs tens of times slower),
#           the `tokenizers` package from PyPI (the tokenizer.json check)
#           and `transformers` from PyPI for Debian's python3 (the export check); and clang with
#           libclang-rt-14-dev (libFuzzer, the sanitizers) and libomp-14-dev for the fuzz targets
#           (scripts/fuzz.sh); none is a dependency of meshtrain itself.
set -euo pipefail
pkgs=(g++ cmake ninja-build pkg-config libgtest-dev libopenmpi-dev openmpi-bin libdnnl-dev
      libtomlplusplus-dev nlohmann-json3-dev python3)
[[ "${1:-}" == "--demo" ]] && pkgs+=(fortunes bible-kjv)
[[ "${1:-}" == "--test" ]] && pkgs+=(python3-torch libopenblas0-pthread python3-pip clang libclang-rt-14-dev libomp-14-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if [[ "${1:-}" == "--test" ]] && ! python3 -c "import tokenizers" 2>/dev/null; then
  echo "installing: tokenizers (PyPI, for the tokenizer oracle test)"
  # Debian's own python3 refuses pip installs outside a venv (PEP 668) unless told otherwise.
  python3 -m pip install -q tokenizers 2>/dev/null ||
    $SUDO python3 -m pip install -q --break-system-packages tokenizers ||
    echo "warning: could not install tokenizers; HfTokenizerOracle will be skipped"
fi
if [[ "${1:-}" == "--test" ]] && ! /usr/bin/python3 -c "import transformers" 2>/dev/null; then
  echo "installing: transformers (PyPI, for the Hugging Face export oracle test)"
  # Releases before 4.46 still run on Debian 12's torch 1.13.
  /usr/bin/python3 -m pip install -q "transformers<4.46" 2>/dev/null ||
    $SUDO /usr/bin/python3 -m pip install -q --break-system-packages "transformers<4.46" ||
    echo "warning: could not install transformers; HfExport will be skipped"
fi
