#!/usr/bin/env python3
"""Peak memory of `vlmopt calibrate --layerwise` against model depth.

Writes two random LLaVA-shaped checkpoints of equal width that differ only in
decoder depth (make_random_llava.py), calibrates each with and without
--layerwise on the same samples, and reports the peak RSS (getrusage, as
vlmopt's report gives it) of every run and the deep/shallow ratios. Issue 4's
target: with --layerwise the ratio stays below 1.15.

    scripts/bench/layerwise_rss.py --vlmopt build/apps/vlmopt/vlmopt --like models/builtin \
        [--layers 4,16] [--hidden 1024] [--samples 16] [--work /tmp/vlmopt-rss] [--out rss.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(cmd: list[str]) -> str:
    print("+ " + " ".join(cmd), file=sys.stderr)
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vlmopt", required=True)
    ap.add_argument("--like", required=True, help="checkpoint whose vision tower, tokenizer and processor are reused")
    ap.add_argument("--layers", default="4,16")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--work", default="/tmp/vlmopt-rss")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    depths = [int(x) for x in args.layers.split(",")]
    results = {"command": " ".join([sys.executable] + sys.argv), "machine": {"cpus": os.cpu_count(),
               "platform": platform.platform()}, "runs": []}
    for depth in depths:
        model = work / f"llava-{depth}x{args.hidden}"
        if not (model / "config.json").exists():
            run([sys.executable, str(HERE / "make_random_llava.py"), "--like", args.like, "--layers", str(depth),
                 "--hidden", str(args.hidden), "--intermediate", str(args.intermediate), "--heads", str(args.heads),
                 "--kv-heads", str(args.kv_heads), "--out", str(model)])
        weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        for layerwise in (False, True):
            cmd = [args.vlmopt, "-q", "--json", "calibrate", "--model", str(model), "--data", "builtin:calib",
                   "--samples", str(args.samples), "--batch-size", str(args.batch_size),
                   "--out", str(work / f"bundle-{depth}-{int(layerwise)}")]
            if layerwise:
                cmd.append("--layerwise")
            summary = json.loads(run(cmd).strip().splitlines()[-1])
            results["runs"].append({"layers": depth, "layerwise": layerwise, "checkpoint_mib": weights / 2**20,
                                    "peak_rss_mib": summary["peak_rss_mib"], "collect_seconds": summary["collect_seconds"]})
    by = {(r["layers"], r["layerwise"]): r["peak_rss_mib"] for r in results["runs"]}
    shallow, deep = min(depths), max(depths)
    results["ratio_layerwise"] = by[(deep, True)] / by[(shallow, True)]
    results["ratio_whole_model"] = by[(deep, False)] / by[(shallow, False)]
    print(f"{'layers':>6} {'layerwise':>9} {'checkpoint MiB':>14} {'peak RSS MiB':>12}")
    for r in results["runs"]:
        print(f"{r['layers']:>6} {str(r['layerwise']):>9} {r['checkpoint_mib']:>14.0f} {r['peak_rss_mib']:>12.0f}")
    print(f"deep/shallow peak RSS: layerwise {results['ratio_layerwise']:.3f}, whole model {results['ratio_whole_model']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
