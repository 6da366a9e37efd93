#!/usr/bin/env python3
"""Times a vision-stage tower step with all 144 patches against train_builtin.py --vision-patch-keep
(the tower on the patches its items draw on plus random background ones, in --vision-patch-groups
groups), and counts the patches each way keeps.

    scripts/bench/vision_patch_keep.py --vlmopt build/apps/vlmopt/vlmopt --pack WORK/train-50000.h5
        [--model models/builtin] [--batches 10] [--groups 1,2,3] [--threads 2]

WORK/train-50000.h5: the training pack train_builtin.py writes into its --work. Each batch is drawn as
the stage draws it: 64 scenes, half with digit boxes, two more boxes pasted into each
(--vision-extra-boxes 2), items with the count tags. A step here: the tower's forward (its last layer
skipped, as VisionTap does while training), the pooled heads' cross-entropy on the items' means
(segment kernel) and the backward; the projector's alignment is left out (it scales with the kept
patches the same way). fp32. Prints one JSON line: seconds per step and kept patches per image
(mean of K over the batch's samples, as the tower sees them) for each setting.
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
from transformers import LlavaForConditionalGeneration  # noqa: E402

COUNT_TAGS = ("count_color", "count_shape")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vlmopt", required=True, help="the vlmopt binary (its generator's vocabulary)")
    ap.add_argument("--pack", required=True, type=Path)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "builtin")
    ap.add_argument("--batches", type=int, default=10)
    ap.add_argument("--groups", default="1,2,3", help="--vision-patch-groups values to time")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dp.item_means_kernel = "segment"

    vocab = json.loads(tb.run_vlmopt(args.vlmopt, "--json", "datasets", "vocab"))
    colors, shapes = vocab["answers"]["color"], vocab["answers"]["shape"]
    pack = tb.Pack(args.pack)
    digit_idx = tb.digit_scene_indices(pack)
    model = LlavaForConditionalGeneration.from_pretrained(args.model)
    model.set_attn_implementation("eager")
    tower = model.model.vision_tower.train()
    tap = tb.VisionTap(model)
    hidden = model.config.vision_config.hidden_size
    heads = torch.nn.ModuleDict({k: torch.nn.Linear(hidden, c) for k, c in tb.POOLED_HEADS.items()})
    heads.update({t: torch.nn.Linear(hidden, len(dp.TAG_WORDS[t])) for t in COUNT_TAGS})

    rng = np.random.default_rng(1)
    batches = []
    for _ in range(args.batches):
        idx = np.unique(np.concatenate([rng.choice(len(pack), 32, replace=False),
                                        rng.choice(digit_idx, 32, replace=False)]))
        imgs, *_ = pack.batch(idx)
        scenes = pack.scenes(idx)
        donor_idx = np.sort(rng.choice(digit_idx, size=2 * len(idx)))
        donors = [(img, sc["digits"][0]) for img, sc in zip(pack.batch(donor_idx)[0], pack.scenes(donor_idx))]
        imgs, scenes = tb.paste_extra_digit_boxes(imgs, scenes, donors, rng, 2)
        batches.append((tb.to_pixels(imgs), scenes, tb.pooled_targets(scenes, shapes, colors, tags=COUNT_TAGS)))

    def step(pixels, items, kept) -> None:
        if kept is None:
            tower(pixel_values=pixels)
            value, on_kept = tap.value, items
        else:
            value, _ = tb.tower_on_kept(tower, tap, pixels, kept)
            on_kept = tb.items_on_kept(items, kept[0])
        losses, _ = tb.pooled_losses(value[:, 1:, :], on_kept, heads)
        sum(losses.values()).backward()

    settings = {"all": None, **{f"keep_groups{g}": int(g) for g in args.groups.split(",")}}
    result = {}
    for name, groups in settings.items():
        keep_rng = np.random.default_rng(27)
        step(*batches[0][::2], None if groups is None else tb.kept_patches(batches[0][2], batches[0][1], 1, keep_rng,
                                                                            groups))  # warm-up
        seconds, patches = 0.0, []
        for pixels, scenes, items in batches:
            kept = None if groups is None else tb.kept_patches(items, scenes, 1, keep_rng, groups)
            patches.append(tb.GRID * tb.GRID if kept is None else float((kept[0] >= 0).sum(1).mean()))
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            step(pixels, items, kept)
            seconds += time.perf_counter() - start
        result[name] = {"s_per_step": round(seconds / len(batches), 4), "patches_per_image": round(float(np.mean(patches)), 1)}
    print(json.dumps({"batches": args.batches, "threads": args.threads, "batch": 64, **result}))


if __name__ == "__main__":
    main()
