#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: builds vlmopt against that machine's own torch with the CUDA
# kernels for its architecture, runs every C++ test suite (the `gpu` ones included, which skip
# themselves elsewhere), then the GPU measurements, CUDA next to the same machine's CPU.
#
#   scripts/gpu_check.sh OUT_DIR [DEPS_PREFIX]
#
# OUT_DIR receives env.txt, build.log, ctest.log, bench.log and bench.jsonl (one JSON object per
# step: {"step", "device", "rc", "seconds", "result": vlmopt's --json output}). DEPS_PREFIX is an
# install prefix searched first for libraries that machine lacks (an OpenCV and a static ICU:
# scripts/gpu_deps.sh makes one, with OpenCV's digits sheet in share/vlmopt/digits.png, used
# unless VLMOPT_DIGITS_PNG is set). Each step has its own time limit, and GPU_DEADLINE_S caps
# them all, so a slow step costs its figures, not the rest. Nothing here installs packages.
# Figures of one run on an H200: docs/BENCHMARKS.md, "GPU".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:?usage: scripts/gpu_check.sh OUT_DIR [DEPS_PREFIX]}")
DEPS=${2:-}
if [ -n "$DEPS" ] && [ -z "${VLMOPT_DIGITS_PNG:-}" ] && [ -f "$DEPS/share/vlmopt/digits.png" ]; then
  export VLMOPT_DIGITS_PNG=$DEPS/share/vlmopt/digits.png
fi
BUILD=${GPU_BUILD_DIR:-build-gpu}
WORK=${GPU_WORK_DIR:-/tmp/vlmopt-gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$WORK"
# GPU_DEADLINE_S (seconds after the start) caps every step's limit, so that a slow run ends on
# its own with what it measured (device time is metered).
t0=$(date +%s)
budget() {  # budget LIMIT_S: prints min(LIMIT_S, time left); fails when under 10 s are left
  local left=$((t0 + ${GPU_DEADLINE_S:-100000} - $(date +%s)))
  [ "$left" -ge 10 ] || return 1
  echo $((left < $1 ? left : $1))
}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())'
  nvcc --version | tail -1
  g++ --version | head -1
  echo "cpus $(nproc)"
  git log -1 --format='commit %H %s' 2>/dev/null || true
} >"$OUT/env.txt" 2>&1

# --- build ---------------------------------------------------------------------------------
prefix_path=$("$PY" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
[ -n "$DEPS" ] && prefix_path="$DEPS;$prefix_path"
build_start=$(date +%s)
# -k 0: one file that does not compile costs its own target, not the whole run.
{ cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DVLMOPT_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_PREFIX_PATH="$prefix_path" \
    ${DEPS:+-DICU_ROOT="$DEPS"} -DPython3_EXECUTABLE="$(command -v "$PY")" &&
  cmake --build "$BUILD" -j "$(nproc)" -- -k 0; } >"$OUT/build.log" 2>&1
echo "build rc $? seconds $(($(date +%s) - build_start))" >>"$OUT/env.txt"
grep -E "error:" "$OUT/build.log" | head -20 >&2
if [ ! -x "$BUILD/apps/vlmopt/vlmopt" ]; then
  echo "build failed: see $OUT/build.log" >&2
  tail -30 "$OUT/build.log" >&2
  exit 1
fi
VLMOPT=$BUILD/apps/vlmopt/vlmopt

# --- tests: the suites with CUDA code paths first; every other C++ suite after the measurements.
ctest --test-dir "$BUILD" -V -j4 -R 'test_quant_cuda|test_model_parity|test_runtime|test_eval' --timeout 240 \
  >"$OUT/ctest.log" 2>&1
grep -E "tests passed|tests failed|SKIPPED|Failed|on CUDA" "$OUT/ctest.log" | tail -12 >&2

# --- measurements ------------------------------------------------------------------------------
# step NAME DEVICE LIMIT_S ARGS...: one `vlmopt --device DEVICE --json ARGS` run, appended to bench.jsonl.
step() {
  local name=$1 device=$2 limit=$3
  shift 3
  local start end rc
  limit=$(budget "$limit") || { echo "[gpu_check] $name: skipped, past the deadline" >&2; return; }
  start=$(date +%s.%N)
  timeout "$limit" "$VLMOPT" --device "$device" --json "$@" >"$WORK/$name.json" 2>>"$OUT/bench.log"
  rc=$?
  end=$(date +%s.%N)
  "$PY" - "$name" "$device" "$rc" "$start" "$end" "$WORK/$name.json" >>"$OUT/bench.jsonl" <<'EOF'
import json, sys
name, device, rc, start, end, path = sys.argv[1:]
try:
    result = json.load(open(path))
except (OSError, ValueError):
    result = None
print(json.dumps({"step": name, "device": device, "rc": int(rc),
                  "seconds": round(float(end) - float(start), 2), "result": result}))
EOF
  echo "[gpu_check] $name ($device): rc $rc, $(awk -v s="$start" -v e="$end" 'BEGIN {printf "%.1f", e - s}') s" >&2
}

# Accuracy and time of the builtin model on all 2000 eval samples; the CPU's answers to the first
# 500 (enough to see a difference, and the CPU is slow) next to CUDA's.
step eval_cuda_fp32 cuda 180 eval --model builtin --data builtin:eval --predictions "$WORK/pred_cuda.jsonl"
step eval_cpu_fp32_500 cpu 240 eval --model builtin --data builtin:eval --limit 500 --predictions "$WORK/pred_cpu.jsonl"
"$PY" - "$WORK/pred_cuda.jsonl" "$WORK/pred_cpu.jsonl" >>"$OUT/bench.jsonl" <<'EOF'
import json, sys
def answers(path):
    try:
        return [json.loads(line).get("prediction") for line in open(path)]
    except OSError:
        return []
cuda, cpu = answers(sys.argv[1]), answers(sys.argv[2])
same = sum(a == b for a, b in zip(cuda, cpu))
print(json.dumps({"step": "answers_cuda_vs_cpu", "samples": min(len(cuda), len(cpu)), "identical": same}))
EOF

# Calibration on each device from the same 128 samples; the W8A8 bundle then runs on the GPU
# with fake-quant and with int8 GEMMs (torch._int_mm).
step calibrate_cuda cuda 120 calibrate --model builtin --out "$WORK/bundle_cuda"
step calibrate_cpu cpu 120 calibrate --model builtin --out "$WORK/bundle_cpu"
"$PY" - "$WORK/bundle_cuda" "$WORK/bundle_cpu" >>"$OUT/bench.jsonl" <<'EOF'
import json, sys, glob, os
from safetensors.torch import load_file
def tensors(d):
    out = {}
    for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        out.update(load_file(f))
    return out
a, b = tensors(sys.argv[1]), tensors(sys.argv[2])
worst, name = 0.0, None
for k in sorted(set(a) & set(b)):
    if "scale" not in k:
        continue
    x, y = a[k].double(), b[k].double()
    d = ((x - y).abs() / y.abs().clamp_min(1e-30)).max().item()
    if d > worst:
        worst, name = d, k
q = [k for k in set(a) & set(b) if k.endswith("weight") and a[k].dtype == b[k].dtype and not a[k].is_floating_point()]
diff_q = sum(int((a[k].int() - b[k].int()).abs().max().item() > 0) for k in q)
print(json.dumps({"step": "bundle_cuda_vs_cpu", "scale_tensors": len([k for k in a if "scale" in k]),
                  "max_rel_scale_diff": worst, "worst": name, "int_weights": len(q), "int_weights_differing": diff_q}))
EOF
step eval_bundle_cuda_fake cuda 180 eval --bundle "$WORK/bundle_cuda" --data builtin:eval
step eval_bundle_cuda_int8 cuda 180 eval --bundle "$WORK/bundle_cuda" --data builtin:eval --kernels int8
step eval_cuda_bf16_b32 cuda 180 eval --model builtin --data builtin:eval --dtype bfloat16 --batch-size 32

# Prefill latency: unpruned vs half the visual tokens with FastV (layer 1's output).
for bs in 1 32; do
  step "prefill_none_b$bs" cuda 90 bench prefill --model builtin --samples 64 --batch-size $bs
  step "prefill_fastv_b$bs" cuda 90 bench prefill --model builtin --samples 64 --batch-size $bs \
    --prune-rule fastv --prune-keep 0.5
  step "prefill_none_bf16_b$bs" cuda 90 bench prefill --model builtin --samples 64 --batch-size $bs --dtype bfloat16
done
# The whole pipeline (calibrate, compensate, prune-fit, diagnose-align, eval) on the GPU; its
# evaluations on the first 1000 samples.
step pipeline_cuda cuda 200 pipeline --model builtin --out "$WORK/pipeline_cuda" --eval-limit 1000

# ... and with the prune plan the pipeline fitted (vlmopt's rule at layer 0's input), against
# the same bundle unpruned.
# (Only with a fitted plan: without one the bundle runs unpruned, and the rows would say nothing.)
[ -f "$WORK/pipeline_cuda/vlmopt/prune.json" ] && for bs in 1 32; do
  step "prefill_vlmopt_fit_b$bs" cuda 90 bench prefill --bundle "$WORK/pipeline_cuda" --samples 64 --batch-size $bs
  step "prefill_bundle_noprune_b$bs" cuda 90 bench prefill --bundle "$WORK/pipeline_cuda" --no-prune --samples 64 \
    --batch-size $bs
done
step prefill_none_cpu_b32 cpu 120 bench prefill --model builtin --samples 64 --batch-size 32

if limit=$(budget 300); then
  timeout "$limit" ctest --test-dir "$BUILD" -LE interop -E 'test_quant_cuda|test_model_parity|test_runtime|test_eval' \
    -j "$(nproc)" --timeout 300 --output-on-failure >>"$OUT/ctest.log" 2>&1
  tail -4 "$OUT/ctest.log" >&2
fi
echo "[gpu_check] done: $OUT" >&2
