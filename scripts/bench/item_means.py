#!/usr/bin/env python3
"""Times decoder_prestage.item_means' two kernels (train_builtin.py --item-means gather|segment),
forward and backward, on the vision stage's item sets, and says how far apart their results are.

    scripts/bench/item_means.py --vlmopt build/apps/vlmopt/vlmopt --pack WORK/train-50000.h5
        [--batches 20] [--threads 2]

WORK/train-50000.h5: the training pack train_builtin.py writes into its --work. Each batch: 64 scenes,
half of them with digit boxes (as the stage draws them), their items as pooled_targets gives them with
the count tags, split by head as pooled_losses and readout_loss split them; random features at the
tower's width (128: the pooled heads) and the decoder's (256: the readout of the projected features).
Prints one JSON line: seconds per batch for each kernel and width, and the largest difference of the
means and of the features' gradients between the kernels.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import decoder_prestage as dp  # noqa: E402
import train_builtin as tb  # noqa: E402

COUNT_TAGS = ("count_color", "count_shape")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vlmopt", required=True, help="the vlmopt binary (its generator's vocabulary)")
    ap.add_argument("--pack", required=True, type=Path)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    vocab = json.loads(tb.run_vlmopt(args.vlmopt, "--json", "datasets", "vocab"))
    colors, shapes = vocab["answers"]["color"], vocab["answers"]["shape"]
    pack = tb.Pack(args.pack)
    digit_idx = tb.digit_scene_indices(pack)
    rng = np.random.default_rng(1)
    gen = torch.Generator().manual_seed(0)
    seconds = {f"{k}_{h}": 0.0 for k in dp.ITEM_MEANS_KERNELS for h in (128, 256)}
    diff = {"means": 0.0, "grad": 0.0}
    rows_per_batch = 0
    for _ in range(args.batches):
        idx = np.unique(np.concatenate([rng.choice(len(pack), 32, replace=False), rng.choice(digit_idx, 32, replace=False)]))
        items = tb.pooled_targets(pack.scenes(idx), shapes, colors, tags=COUNT_TAGS)
        heads = sorted({h for _, _, h, _ in items})
        by_head = [[(b, m, y) for b, m, h, y in items if h == head] for head in heads]
        rows_per_batch += len(items)
        for hidden in (128, 256):
            feats = torch.randn(len(idx), dp.GRID * dp.GRID, hidden, generator=gen)
            weight = torch.randn(hidden, generator=gen)
            results = {}
            for kernel in dp.ITEM_MEANS_KERNELS:
                dp.item_means_kernel = kernel
                x = feats.clone().requires_grad_(True)
                start = time.perf_counter()
                means = [dp.item_means(x, rows) for rows in by_head]
                loss = sum((m @ weight).square().sum() for m in means)
                loss.backward()
                seconds[f"{kernel}_{hidden}"] += time.perf_counter() - start
                results[kernel] = (torch.cat(means).detach(), x.grad)
            (m0, g0), (m1, g1) = results.values()
            diff["means"] = max(diff["means"], float((m0 - m1).abs().max()))
            diff["grad"] = max(diff["grad"], float((g0 - g1).abs().max()))
    print(json.dumps({"batches": args.batches, "threads": args.threads, "rows_per_batch": rows_per_batch / args.batches,
                      "s_per_batch": {k: round(v / args.batches, 4) for k, v in seconds.items()},
                      "max_abs_diff": {k: float(f"{v:.3g}") for k, v in diff.items()}}))


if __name__ == "__main__":
    main()
