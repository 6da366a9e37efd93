#!/usr/bin/env bash
# Wall time of the vision and joint stages of scripts/train_builtin.py in one process (--ranks 1, two
# threads) against two processes of one thread each (--ranks 2, train_ranks.py), interleaved.
#
#   scripts/bench/train_ranks.sh VLMOPT WORK [REPEATS] [train_builtin options...]
#
# VLMOPT: the vlmopt binary; WORK: a --work directory. The first run builds the packs and the decoder
# pre-stage there (untimed; ~11 min with the default recipe), which every later run loads: under
# --ranks 2 the pre-stage is one process's too. Then each run trains 200 vision steps (their cache
# entries are removed before every run) and 150 joint steps. The options after REPEATS go to every
# run (e.g. --item-means segment --vision-patch-keep 1 --decoder-loss-rows; --seed 1).
# Prints one line per run: ranks, wall seconds, the vision and joint stages' seconds (as their logs
# give them: the vision stage at its step 199, the joint stage's "done" line), and the sha256 of
# model.safetensors (its first 16 hex digits; the two settings draw other rows, so they differ).
set -euo pipefail
VLMOPT=${1:?usage: train_ranks.sh VLMOPT WORK [REPEATS] [options...]}
WORK=${2:?usage: train_ranks.sh VLMOPT WORK [REPEATS] [options...]}
REPEATS=${3:-1}
shift $(($# < 3 ? $# : 3))
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
SHORT=(--vision-steps 200 --vision-check-every 1000 --steps 150 --eval-every 1000)

run() {  # run RANKS [options...]
  local ranks=$1 log="$OUT/ranks$1.log" start end
  shift
  rm -f "$WORK"/vision-pooled-200-*
  start=$(date +%s.%N)
  python3 "$ROOT/scripts/train_builtin.py" --vlmopt "$VLMOPT" --out "$OUT/model" --work "$WORK" \
    --threads 2 --ranks "$ranks" "${SHORT[@]}" "$@" >"$log" 2>&1
  end=$(date +%s.%N)
  python3 "$ROOT/scripts/bench/train_log_summary.py" "--ranks $ranks" "$start" "$end" "$log" "$OUT/model/model.safetensors"
}

mkdir -p "$WORK"
echo "warm-up (packs and pre-stage into $WORK if absent; untimed)" >&2
run 1 "$@" >/dev/null
for ((i = 0; i < REPEATS; i++)); do
  run 2 "$@"
  run 1 "$@"
done
