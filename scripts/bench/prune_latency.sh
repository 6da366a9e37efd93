#!/bin/bash
# Prefill latency of the pruning operating points of a prune_pareto.py run, batch 1
# and 8, unpruned measured first and last (run on a quiet machine).
#   scripts/bench/prune_latency.sh VLMOPT PARETO_OUT [SAMPLES] [REPEATS]
# PARETO_OUT holds fit_0.5/, fit_0.5_0/ and fit_0.25_0/ (prune_pareto.py
# --budgets ...,0.5,0.25 --vlmopt-variants auto,L0). Prints "label | bB | ms_per_batch eq_tokens".
set -euo pipefail
vlmopt=${1:?usage: prune_latency.sh VLMOPT PARETO_OUT [SAMPLES] [REPEATS]}
fits=${2:?usage: prune_latency.sh VLMOPT PARETO_OUT [SAMPLES] [REPEATS]}
samples=${3:-64}
repeats=${4:-5}
run() {
  local label="$1"; shift
  for bs in 1 8; do
    "$vlmopt" -q --json bench prefill --model builtin --samples "$samples" --batch-size "$bs" --repeats "$repeats" "$@" |
      python3 -c 'import json, sys; d = json.load(sys.stdin); print("%.1f %.1f" % (d["prefill_ms_per_batch"], d["visual_tokens_kept"]))' |
      sed "s/^/$label | b$bs | /"
  done
}
uptime
run "none"
run "vlmopt auto 0.5" --prune-config "$fits/fit_0.5/prune.json"
run "vlmopt L0 0.5" --prune-config "$fits/fit_0.5_0/prune.json"
run "vlmopt L0 0.5 batch_mean" --prune-config "$fits/fit_0.5_0/prune.json" --prune-batch-keep batch_mean
run "fastv K2 0.5" --prune-rule fastv --prune-layer 1 --prune-keep 0.5
run "vlmopt L0 0.25 batch_mean" --prune-config "$fits/fit_0.25_0/prune.json" --prune-batch-keep batch_mean
run "fastv K2 0.25" --prune-rule fastv --prune-layer 1 --prune-keep 0.25
run "none (again)"
uptime
