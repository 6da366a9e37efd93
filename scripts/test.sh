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
# A full build needs ~1 GB (one 720 MB precompiled torch header) plus ccache's
# copies; running out shows up as a cryptic "cannot write PCH file" mid-build.
avail_mb=$(df -Pm . | awk 'NR == 2 {print $4}')
if [ "${avail_mb:-0}" -lt 3000 ]; then
  echo "[test] warning: only ${avail_mb} MB free on $(df -P . | awk 'NR == 2 {print $6}'); the build needs ~3000 MB" >&2
fi
echo "[test] building with $jobs jobs" >&2
cmake --build "$BUILD_DIR" -j "$jobs"
echo "[test] running tests" >&2
ctest --test-dir "$BUILD_DIR" --output-on-failure --no-tests=error "$@"
