#!/usr/bin/env bash
# Wall time of a short scripts/train_builtin.py run under each memory allocator, and whether the
# weights come out the same (they must: an allocator moves tensors, it does not round them).
#
#   scripts/bench/train_allocator.sh VLMOPT WORK [REPEATS]
#
# VLMOPT: the vlmopt binary; WORK: a --work directory. Each run trains the default recipe's pre-stage
# (cached in WORK after the first run: build it once, ~11 min, untimed), then a short schedule:
# 150 vision steps (their cache is removed before every run, so each run trains them) and 26 joint
# steps. Allocators: glibc's malloc (--allocator system), tcmalloc (--allocator tcmalloc, the default)
# and, where Debian's libjemalloc2 is installed, jemalloc (LD_PRELOAD with --allocator system).
# Prints one line per run: allocator, wall seconds, the vision stage's and joint stage's seconds,
# and the sha256 of model.safetensors (its first 16 hex digits).
set -euo pipefail
VLMOPT=${1:?usage: train_allocator.sh VLMOPT WORK [REPEATS]}
WORK=${2:?usage: train_allocator.sh VLMOPT WORK [REPEATS]}
REPEATS=${3:-2}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
SHORT=(--vision-steps 150 --vision-check-every 1000 --steps 26)

run() {  # run NAME PRELOAD ALLOCATOR
  local name=$1 preload=$2 allocator=$3 log="$OUT/$1.log" start end
  rm -f "$WORK"/vision-pooled-150-*
  start=$(date +%s.%N)
  LD_PRELOAD=$preload python3 "$ROOT/scripts/train_builtin.py" --vlmopt "$VLMOPT" --out "$OUT/model" \
    --work "$WORK" --allocator "$allocator" "${SHORT[@]}" >"$log" 2>&1
  end=$(date +%s.%N)
  python3 "$ROOT/scripts/bench/train_log_summary.py" "$name" "$start" "$end" "$log" "$OUT/model/model.safetensors"
}

mkdir -p "$WORK"
echo "warm-up (packs and pre-stage into $WORK if absent; untimed)" >&2
run warmup "" tcmalloc >/dev/null
JEMALLOC=$(python3 -c "import ctypes.util; print(ctypes.util.find_library('jemalloc') or '')")
for ((i = 0; i < REPEATS; i++)); do
  run system "" system
  run tcmalloc "" tcmalloc
  [[ -n $JEMALLOC ]] && run jemalloc "$JEMALLOC" system
done
