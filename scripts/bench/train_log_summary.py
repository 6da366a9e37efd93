#!/usr/bin/env python3
"""One line on a scripts/train_builtin.py run, for the training benchmarks (train_allocator.sh, train_ranks.sh).

    train_log_summary.py LABEL START END LOG WEIGHTS

START, END: the run's wall clock (seconds since the epoch); LOG: its stderr; WEIGHTS: its model.safetensors.
Prints the label, the wall seconds, the vision stage's seconds at its last logged step, the joint stage's
seconds from its "done" line, and the first 16 hex digits of the weights' sha256."""
import hashlib
import json
import re
import sys

label, start, end, log, weights = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
text = open(log).read()
vision = [json.loads(m) for m in re.findall(r"^\[train\] (\{\"vision_step\".*)$", text, re.M)]
joint = re.search(r"done: \d+ steps, (\d+) s", text)
sha = hashlib.sha256(open(weights, "rb").read()).hexdigest()[:16]
print(f"{label:9s} wall {end - start:6.1f} s  vision {vision[-1]['s']:6.1f} s  joint {joint.group(1):>4s} s  sha256 {sha}",
      flush=True)
