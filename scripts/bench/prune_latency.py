#!/usr/bin/env python3
"""Prefill latency of pruning operating points vs unpruned, robust to a noisy machine.

Runs `vlmopt --json bench prefill` for every configuration in turn, --rounds times
(interleaved, so slow phases of a shared machine hit every configuration, in a
seeded random order per round, so no configuration always follows another), and
reports per configuration and batch size the median ms per batch and the median
over rounds of its ratio to the same round's unpruned run.

    scripts/bench/prune_latency.py --vlmopt VLMOPT --fits PARETO_OUT [--rounds 5]
        [--samples 64] [--repeats 3] [--batch-sizes 1,8] [--out latency.json]

PARETO_OUT is a prune_pareto.py --out directory with fit_0.5/, fit_0.5_0/,
fit_0.25_0/, fit_0.5_0_input/ and fit_0.25_0_input/ (--budgets ...,0.5,0.25
--vlmopt-variants auto,L0,L0:input). --configs picks some by name (comma list).
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys


def configs(fits):
    return {
        "none": [],
        "vlmopt auto 0.5": ["--prune-config", os.path.join(fits, "fit_0.5", "prune.json")],
        "vlmopt L0 0.5": ["--prune-config", os.path.join(fits, "fit_0.5_0", "prune.json")],
        "vlmopt L0 0.5 batch_mean": ["--prune-config", os.path.join(fits, "fit_0.5_0", "prune.json"),
                                     "--prune-batch-keep", "batch_mean"],
        "fastv K2 0.5": ["--prune-rule", "fastv", "--prune-layer", "1", "--prune-keep", "0.5"],
        "vlmopt L0 input 0.5": ["--prune-config", os.path.join(fits, "fit_0.5_0_input", "prune.json")],
        "vlmopt L0 input 0.5 batch_mean": ["--prune-config", os.path.join(fits, "fit_0.5_0_input", "prune.json"),
                                           "--prune-batch-keep", "batch_mean"],
        "vlmopt L0 0.25 batch_mean": ["--prune-config", os.path.join(fits, "fit_0.25_0", "prune.json"),
                                      "--prune-batch-keep", "batch_mean"],
        "vlmopt L0 input 0.25 batch_mean": ["--prune-config", os.path.join(fits, "fit_0.25_0_input", "prune.json"),
                                            "--prune-batch-keep", "batch_mean"],
        "fastv K2 0.25": ["--prune-rule", "fastv", "--prune-layer", "1", "--prune-keep", "0.25"],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vlmopt", default="build/apps/vlmopt/vlmopt")
    ap.add_argument("--fits", required=True)
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--out", default=None)
    ap.add_argument("--configs", default=None, help="comma list of configuration names (default: all)")
    args = ap.parse_args()
    cfgs = configs(args.fits)
    if args.configs:
        wanted = args.configs.split(",")
        missing = [n for n in wanted if n not in cfgs]
        if missing or "none" not in wanted:
            raise SystemExit(f"--configs: expected names among {list(cfgs)} including 'none', got {wanted}")
        cfgs = {n: cfgs[n] for n in wanted}
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    ms = {(name, bs): [] for name in cfgs for bs in sizes}
    vision = {(name, bs): [] for name in cfgs for bs in sizes}  # vision tower + projector alone
    kept = {}
    order_rng = random.Random(0)
    for r in range(args.rounds):
        for bs in sizes:
            # A fresh order each round: a configuration's place in the round must not bias it
            # (the same plan run right after another measured up to 2 ms slower at batch 1).
            names = list(cfgs)
            order_rng.shuffle(names)
            for name in names:
                extra = cfgs[name]
                cmd = [args.vlmopt, "-q", "--json", "bench", "prefill", "--model", args.model, "--samples",
                       str(max(args.samples, bs)), "--batch-size", str(bs), "--repeats", str(args.repeats), *extra]
                out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
                ms[(name, bs)].append(out["prefill_ms_per_batch"])
                vision[(name, bs)].append(out["image_features_ms_per_batch"])
                kept[name] = out["visual_tokens_kept"]
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    rows = []
    for name in cfgs:
        row = {"config": name, "args": cfgs[name], "visual_tokens_kept": kept[name]}
        for bs in sizes:
            ratios = [a / b for a, b in zip(ms[(name, bs)], ms[("none", bs)])]
            row[f"b{bs}"] = {"ms_median": statistics.median(ms[(name, bs)]), "ms_all": ms[(name, bs)],
                             "ratio_median": statistics.median(ratios), "ratios": ratios,
                             "image_features_ms_median": statistics.median(vision[(name, bs)])}
        rows.append(row)
    header = f"{'config':28} {'eq.tok':>6} " + " ".join(f"{'b' + str(b) + ' ms':>9} {'vs none':>8}" for b in sizes)
    print(header)
    for row in rows:
        cells = " ".join(f"{row[f'b{b}']['ms_median']:9.1f} {100 * (row[f'b{b}']['ratio_median'] - 1):+7.0f}%"
                         for b in sizes)
        print(f"{row['config']:28} {row['visual_tokens_kept']:6.1f} {cells}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": sys.argv, "rounds": args.rounds, "samples": args.samples, "repeats": args.repeats,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
