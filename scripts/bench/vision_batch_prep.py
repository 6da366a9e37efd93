#!/usr/bin/env python3
"""Times the vision stage's batch preparation in train_builtin.py -- pasting the extra digit boxes
(paste_extra_digit_boxes) and redrawing every box's ink (augment_digit_boxes) -- against the same
functions at another git revision, and checks that both give the same images and scenes bit for bit.

    scripts/bench/vision_batch_prep.py --pack WORK/train-50000.h5 [--reference-rev d896868]
        [--batches 20] [--threads 2]

WORK/train-50000.h5: the training pack train_builtin.py writes into its --work. Each batch: 64 scenes,
half with digit boxes, two extra boxes per scene from 128 donor scenes, augmentation strength 0.5 (the
fp32 defaults). Both versions draw from generators with the same seeds. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import train_builtin as tb  # noqa: E402
from git_revision import module_at  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", required=True, type=Path)
    ap.add_argument("--reference-rev", default="d896868", help="git revision to compare with (default: the last one "
                                                               "that warped box by box)")
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pack = tb.Pack(args.pack)
    digit_idx = tb.digit_scene_indices(pack)
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        impls = {"current": tb, args.reference_rev: module_at(args.reference_rev, "scripts/train_builtin.py", Path(tmp))}
        seconds = {f"{name}_{part}": 0.0 for name in impls for part in ("paste", "augment")}
        equal = True
        for batch in range(args.batches):
            idx = np.unique(np.concatenate([rng.choice(len(pack), 32, replace=False),
                                            rng.choice(digit_idx, 32, replace=False)]))
            imgs, *_ = pack.batch(idx)
            scenes = pack.scenes(idx)
            donor_idx = rng.choice(digit_idx, 2 * len(idx), replace=False)
            donor_scenes = pack.scenes(donor_idx)
            donor_imgs = tb.Pack.rows(pack.images, donor_idx)  # ascending: pair them with sorted scenes
            donor_scenes = [donor_scenes[i] for i in np.argsort(donor_idx)]
            donors = [(img, sc["digits"][0]) for img, sc in zip(donor_imgs, donor_scenes)]
            outs = []
            for name, module in impls.items():
                paste_rng, augment_rng = np.random.default_rng(batch), np.random.default_rng(1000 + batch)
                start = time.perf_counter()
                pasted, new_scenes = module.paste_extra_digit_boxes(imgs, scenes, donors, paste_rng, 2)
                middle = time.perf_counter()
                augmented = module.augment_digit_boxes(pasted, new_scenes, augment_rng, 0.5)
                seconds[f"{name}_paste"] += middle - start
                seconds[f"{name}_augment"] += time.perf_counter() - middle
                outs.append((augmented, new_scenes))
            equal &= np.array_equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1]
    print(json.dumps({"batches": args.batches, "threads": args.threads, "bitwise_equal": bool(equal),
                      "s_per_batch": {k: round(v / args.batches, 4) for k, v in seconds.items()}}))
    if not equal:
        sys.exit(1)


if __name__ == "__main__":
    main()
