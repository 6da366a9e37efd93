#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test (all ctest labels:
# unit, model, interop, gpu — gpu tests skip themselves without a GPU).
#
#   scripts/test.sh [ctest args...]      e.g. scripts/test.sh -L unit
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
scripts/setup.sh
jobs=$(nproc)
echo "[test] building with $jobs jobs" >&2
cmake --build "$BUILD_DIR" -j "$jobs"
echo "[test] running tests" >&2
ctest --test-dir "$BUILD_DIR" --output-on-failure --no-tests=error "$@"
