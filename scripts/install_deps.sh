#!/usr/bin/env bash
# Installs the Debian 12 packages meshtrain needs to build, test and run its demo (only the
# missing ones; uses sudo when not root). Usage: scripts/install_deps.sh [--demo]
set -euo pipefail
pkgs=(g++ cmake ninja-build pkg-config libgtest-dev libopenmpi-dev openmpi-bin libdnnl-dev
      libtomlplusplus-dev nlohmann-json3-dev python3)
[[ "${1:-}" == "--demo" ]] && pkgs+=(fortunes)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
