#!/usr/bin/env bash
# Fresh machine to optimized bundle in one command: installs what is missing,
# builds, runs `vlmopt pipeline` on the builtin model and prints where the
# bundle and the reports are.
#
#   scripts/demo.sh [OUT_DIR]          (default: out/demo)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/demo}
BUILD_DIR=${BUILD_DIR:-build}
scripts/setup.sh
cmake --build "$BUILD_DIR" -j "$(nproc)" --target vlmopt
VLMOPT=$BUILD_DIR/apps/vlmopt/vlmopt
if [[ ! -f models/builtin/config.json ]]; then
  echo "[demo] models/builtin is missing: training it (scripts/train_builtin.py, ~30 min on 2 cores)" >&2
  "$(cat .python-path)" scripts/train_builtin.py --vlmopt "$VLMOPT" --out models/builtin
fi
"$VLMOPT" inspect builtin
"$VLMOPT" pipeline --model builtin --out "$OUT" ${DEMO_EVAL_LIMIT:+--eval-limit "$DEMO_EVAL_LIMIT"}
echo
echo "bundle:  $OUT"
echo "reports: $OUT/vlmopt/reports/"
