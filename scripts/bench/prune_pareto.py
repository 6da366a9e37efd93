#!/usr/bin/env python3
"""Visual-token pruning Pareto benchmark: vlmopt prune-fit vs FastV vs random.

For each budget (fraction of the visual tokens kept after the cut, FastV's R):

  * vlmopt   `vlmopt prune-fit --target-keep B --out OUT/fit_B` on the calibration
             split, then `vlmopt eval --prune-config OUT/fit_B/prune.json`. Each
             --vlmopt-variants entry is one curve: `auto` (prune-fit picks the layer) or
             `L<n>` (`--layers n`), then optional suffixes: `:input` fits an input cut
             (`--cut input`: the scoring layer itself sees only the kept tokens) and
             `:batch_mean` evaluates and times the fit with `--prune-batch-keep
             batch_mean` (no padding in a batch). E.g. auto,L0,L0:input:batch_mean.
  * fastv    `vlmopt eval --prune-rule fastv --prune-layer K-1 --prune-keep B` (K=2)
  * random   `vlmopt eval --prune-rule random --prune-layer K-1 --prune-keep B --prune-seed S`,
             mean over --seeds
  * budget 1.0 is the unpruned model (one eval shared by all methods).

Accuracy and equivalent visual tokens (`visual_tokens_kept`: per sample, mean over
the decoder layers) come from `vlmopt --json eval`; prefill latency from
`vlmopt --json bench prefill` at each batch size in --batch-sizes.

    scripts/bench/prune_pareto.py --vlmopt build/apps/vlmopt/vlmopt --model builtin \\
        [--data builtin:eval --limit 0] [--calib builtin:calib --calib-limit 128] \\
        [--budgets 1.0,0.75,0.5,0.25] [--seeds 0,1,2] [--batch-sizes 1,8] \\
        [--device cpu] [--out scripts/bench/results/prune_pareto]

Writes OUT/prune_pareto.json (every point and the commands) and OUT/prune_pareto.png
(accuracy vs equivalent visual tokens, and vs prefill latency).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def run_json(cmd):
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vlmopt", default="build/apps/vlmopt/vlmopt")
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--data", default="builtin:eval")
    ap.add_argument("--limit", type=int, default=0, help="eval samples (0 = all)")
    ap.add_argument("--calib", default="builtin:calib")
    ap.add_argument("--calib-limit", type=int, default=128)
    ap.add_argument("--budgets", default="1.0,0.75,0.5,0.25")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--fastv-k", type=int, default=2, help="FastV K: prune after layer K-1")
    ap.add_argument("--vlmopt-variants", default="auto",
                    help="comma list of auto | L<n>, each optionally with :batch_mean (e.g. auto,L0,L0:batch_mean)")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--bench-samples", type=int, default=32)
    ap.add_argument("--eval-batch-size", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default="scripts/bench/results/prune_pareto")
    ap.add_argument("--no-latency", action="store_true")
    ap.add_argument("--replot", action="store_true", help="only redraw OUT/prune_pareto.png from OUT/prune_pareto.json")
    args = ap.parse_args()
    if args.replot:
        with open(os.path.join(args.out, "prune_pareto.json")) as f:
            plot(json.load(f), args.out)
        return

    os.makedirs(args.out, exist_ok=True)
    budgets = [float(b) for b in args.budgets.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    base = [args.vlmopt, "--json", "--device", args.device]
    common = ["--model", args.model, "--dtype", args.dtype]
    eval_args = common + ["--data", args.data, "--limit", str(args.limit), "--batch-size", str(args.eval_batch_size)]
    layer = str(args.fastv_k - 1)
    started = time.time()

    def evaluate(prune_args):
        r = run_json(base + ["eval"] + eval_args + prune_args)
        return {"accuracy": r["accuracy"], "ci95": r["ci95"], "n": r["n"], "visual_tokens": r["visual_tokens"],
                "visual_tokens_kept": r["visual_tokens_kept"], "prune": r["prune"]}

    def latency(prune_args):
        if args.no_latency:
            return {}
        out = {}
        for bs in batch_sizes:
            r = run_json(base + ["bench", "prefill"] + common +
                         ["--data", args.data, "--samples", str(max(bs, args.bench_samples)), "--batch-size", str(bs)] +
                         prune_args)
            out[str(bs)] = {"ms_per_batch": r["prefill_ms_per_batch"], "ms_per_sample": r["prefill_ms_per_sample"]}
        return out

    points = []
    unpruned = evaluate([])
    unpruned_latency = latency([])
    variants = []  # (method name, prune-fit args, fit dir suffix, eval/bench batch-keep args)
    for v in args.vlmopt_variants.split(","):
        layers, *suffixes = v.split(":")
        if layers != "auto" and not (layers.startswith("L") and layers[1:].isdigit()):
            raise SystemExit(f"--vlmopt-variants: expected auto or L<n>, got '{layers}'")
        unknown = [x for x in suffixes if x not in ("input", "batch_mean")]
        if unknown or len(set(suffixes)) != len(suffixes):
            raise SystemExit(f"--vlmopt-variants: expected the suffixes :input and/or :batch_mean, got '{v}'")
        fit_args = ([] if layers == "auto" else ["--layers", layers[1:]]) + (["--cut", "input"] if "input" in suffixes else [])
        dir_suffix = ("" if layers == "auto" else "_" + layers[1:]) + ("_input" if "input" in suffixes else "")
        name = "-".join(["vlmopt"] + ([] if layers == "auto" else [layers]) + [x for x in ("input", "batch_mean") if x in suffixes])
        variants.append((name, fit_args, dir_suffix,
                         ["--prune-batch-keep", "batch_mean"] if "batch_mean" in suffixes else []))
    for method in [v[0] for v in variants] + ["fastv", "random"]:
        points.append({"method": method, "budget": 1.0, **unpruned, "prefill": unpruned_latency})
    for budget in budgets:
        if budget >= 1.0:
            continue
        fits = {}
        for name, fit_args, dir_suffix, keep_args in variants:
            if dir_suffix not in fits:  # one fit per layer and cut choice; batch_mean reuses it
                fit_dir = os.path.join(args.out, f"fit_{budget:g}{dir_suffix}")
                fits[dir_suffix] = (fit_dir, run_json(base + ["prune-fit"] + common +
                                                      ["--data", args.calib, "--limit", str(args.calib_limit),
                                                       "--target-keep", str(budget), "--out", fit_dir] + fit_args))
            fit_dir, fit = fits[dir_suffix]
            cfg = ["--prune-config", os.path.join(fit_dir, "prune.json")] + keep_args
            points.append({"method": name, "budget": budget, **evaluate(cfg), "prefill": latency(cfg),
                           "fit": fit["chosen"]})
        fastv = ["--prune-rule", "fastv", "--prune-layer", layer, "--prune-keep", str(budget)]
        points.append({"method": "fastv", "budget": budget, **evaluate(fastv), "prefill": latency(fastv)})
        runs = [evaluate(["--prune-rule", "random", "--prune-layer", layer, "--prune-keep", str(budget),
                          "--prune-seed", str(s)]) for s in seeds]
        rnd = dict(runs[0])
        rnd["accuracy"] = statistics.mean(r["accuracy"] for r in runs)
        rnd["accuracy_per_seed"] = [r["accuracy"] for r in runs]
        rnd["visual_tokens_kept"] = statistics.mean(r["visual_tokens_kept"] for r in runs)
        rnd["ci95"] = None
        points.append({"method": "random", "budget": budget, **rnd,
                       "prefill": latency(["--prune-rule", "random", "--prune-layer", layer, "--prune-keep",
                                           str(budget)])})

    result = {"model": args.model, "data": args.data, "limit": args.limit, "calib": args.calib,
              "calib_limit": args.calib_limit, "fastv_k": args.fastv_k, "seeds": seeds, "device": args.device,
              "dtype": args.dtype, "seconds": time.time() - started, "command": sys.argv, "points": points}
    path = os.path.join(args.out, "prune_pareto.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}", file=sys.stderr)
    print(f"{'method':20} {'budget':>6} {'acc':>7} {'vis.kept':>8} " +
          " ".join(f"{'ms@b' + str(b):>9}" for b in batch_sizes))
    for p in points:
        lat = " ".join(f"{p['prefill'].get(str(b), {}).get('ms_per_batch', float('nan')):9.2f}" for b in batch_sizes)
        print(f"{p['method']:20} {p['budget']:6.2f} {p['accuracy']:7.4f} {p['visual_tokens_kept']:8.1f} {lat}")

    plot(result, args.out)


def plot(result, out_dir):
    """accuracy vs equivalent visual tokens kept, and vs prefill latency at the largest batch size."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG", file=sys.stderr)
        return
    points = result["points"]
    sizes = sorted({int(b) for p in points for b in p.get("prefill", {})})
    panels = 2 if sizes else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False)
    methods = list(dict.fromkeys(p["method"] for p in points))
    markers = {"fastv": "s", "random": "^"}
    for method in methods:
        marker = markers.get(method, "o")
        pts = sorted((p for p in points if p["method"] == method), key=lambda p: p["visual_tokens_kept"])
        axes[0][0].plot([p["visual_tokens_kept"] / p["visual_tokens"] for p in pts], [p["accuracy"] for p in pts],
                        marker=marker, label=method)
        if panels == 2:
            b = str(max(sizes))
            axes[0][1].plot([p["prefill"][b]["ms_per_batch"] for p in pts], [p["accuracy"] for p in pts],
                            marker=marker, label=method)
    axes[0][0].set_xlabel("equivalent visual tokens kept (fraction, mean over decoder layers)")
    axes[0][0].set_ylabel(f"accuracy ({result['data']}, n={points[0]['n']})")
    axes[0][0].legend()
    axes[0][0].grid(alpha=0.3)
    if panels == 2:
        axes[0][1].set_xlabel(f"prefill latency, ms per batch of {max(sizes)} ({result['device']})")
        axes[0][1].set_ylabel("accuracy")
        axes[0][1].legend()
        axes[0][1].grid(alpha=0.3)
    fig.suptitle(f"visual-token pruning on {result['model']}")
    fig.tight_layout()
    png = os.path.join(out_dir, "prune_pareto.png")
    fig.savefig(png, dpi=120)
    print(f"wrote {png}", file=sys.stderr)


if __name__ == "__main__":
    main()
