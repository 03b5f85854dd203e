#!/usr/bin/env bash
# Installs what is missing, builds everything (warnings as errors) and runs the whole test suite,
# single-process and multi-rank (mpirun) tests alike.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh --test
scripts/build.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ctest --test-dir build --output-on-failure --timeout 900 "$@"
