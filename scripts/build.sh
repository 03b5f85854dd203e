#!/usr/bin/env bash
# Configures and builds meshtrain into build/ (Release, warnings as errors).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMESHTRAIN_WERROR=ON >/dev/null
ninja -C build "$@"
