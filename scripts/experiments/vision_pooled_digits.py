#!/usr/bin/env python3
"""How fast can the builtin model's vision tower learn to read the digits? (issue 3)

Trains a fresh CLIP vision tower with the builtin model's shape (4 x 128, patch 8,
96 px) alone, on the scenes of a training pack that contain a digit box, with a
box-pooled objective: the mean of the feature-layer (-2) patch features over the
patches the box covers -> a linear 10-way head -> cross-entropy. This is what the
decoder's attention reads, where train_builtin.py's auxiliary loss asks every
patch for the label. --patch-weight W adds that per-patch balanced loss.
Prints held-out box accuracy (digit scenes of the calibration pack) every 50 steps.

    scripts/experiments/vision_pooled_digits.py --vlmopt build/apps/vlmopt/vlmopt \\
        --train WORK/train-28800.h5 --held WORK/calib.h5 [--steps 500 --batch 64 --lr 3e-3]

The packs are the ones train_builtin.py writes into its --work directory
(`vlmopt datasets pack builtin:train|builtin:calib`).
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_builtin as tb  # noqa: E402
from transformers import CLIPVisionConfig, CLIPVisionModel  # noqa: E402


def digit_scenes(pack) -> np.ndarray:
    return np.array([i for i, m in enumerate(pack.meta[:]) if json.loads(m)["digits"]])


def box_masks(scenes):
    """(sample index, [144] float patch mask) and the label of every digit box."""
    centers = np.mgrid[0:tb.GRID, 0:tb.GRID] * tb.PATCH + tb.PATCH / 2
    py, px = centers[0], centers[1]
    rows, labels = [], []
    for b, sc in enumerate(scenes):
        for dg in sc["digits"]:
            x0, y0, side = dg["x"], dg["y"], dg["side"]
            inside = (px >= x0) & (px <= x0 + side) & (py >= y0) & (py <= y0 + side)
            rows.append((b, torch.from_numpy(inside.reshape(-1).astype(np.float32))))
            labels.append(int(dg["label"]))
    return rows, torch.tensor(labels)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vlmopt", required=True)
    ap.add_argument("--train", required=True, help="training pack (.h5)")
    ap.add_argument("--held", required=True, help="held-out pack (.h5), e.g. builtin:calib")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--patch-weight", type=float, default=0.0, help="add the per-patch balanced loss with this weight")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)

    cfg = CLIPVisionConfig(image_size=96, patch_size=8, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=4, hidden_act="quick_gelu", projection_dim=128)
    tower = CLIPVisionModel(cfg)
    pooled_head = torch.nn.Linear(cfg.hidden_size, 10)
    heads = torch.nn.ModuleDict({k: torch.nn.Linear(cfg.hidden_size, c) for k, c in tb.AUX_HEADS.items()})
    params = list(tower.parameters()) + list(pooled_head.parameters()) + list(heads.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    train, held = tb.Pack(args.train), tb.Pack(args.held)
    vocab = json.loads(subprocess.run([args.vlmopt, "--json", "datasets", "vocab"], check=True, capture_output=True,
                                      text=True).stdout)
    shapes, colors = vocab["answers"]["shape"], vocab["answers"]["color"]
    train_idx, held_idx = digit_scenes(train), digit_scenes(held)[:256]
    print(f"digit scenes: {len(train_idx)} train, {len(held_idx)} held out", flush=True)

    def features(imgs):  # [B,144,128] at vision_feature_layer -2, CLS dropped
        return tower(pixel_values=tb.to_pixels(imgs), output_hidden_states=True).hidden_states[-2][:, 1:, :]

    def pooled_logits(feats, rows):
        pooled = torch.stack([(feats[b] * m[:, None]).sum(0) / m.sum().clamp_min(1.0) for b, m in rows])
        return pooled_head(pooled)

    def held_accuracy():
        tower.eval()
        correct = total = 0
        with torch.no_grad():
            for s in range(0, len(held_idx), 64):
                idx = held_idx[s:s + 64]
                imgs, *_ = held.batch(idx)
                rows, labels = box_masks(held.scenes(idx))
                correct += int((pooled_logits(features(imgs), rows).argmax(-1) == labels).sum())
                total += len(labels)
        tower.train()
        return correct / max(1, total), total

    rng = np.random.default_rng(args.seed)
    t0 = time.time()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, (step + 1) / 30)
        idx = np.sort(rng.choice(train_idx, size=args.batch, replace=False))
        imgs, *_ = train.batch(idx)
        scenes = train.scenes(idx)
        feats = features(imgs)
        rows, labels = box_masks(scenes)
        loss = torch.nn.functional.cross_entropy(pooled_logits(feats, rows), labels)
        if args.patch_weight > 0:
            t = tb.patch_targets(scenes, shapes, colors)
            patch = sum(tb.balanced_patch_loss(h(feats).flatten(0, 1), t[k].flatten()) for k, h in heads.items())
            loss = loss + args.patch_weight * patch / len(heads)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            acc, n = held_accuracy()
            print(json.dumps({"step": step, "s": round(time.time() - t0, 1), "loss": round(float(loss.detach()), 3),
                              "heldout_box_digit_acc": round(acc, 3), "heldout_boxes": n}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
