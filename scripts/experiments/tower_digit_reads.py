#!/usr/bin/env python3
"""Where are the builtin model's digit answers lost: in the vision tower's reading or in the routing? (issue 3)

Reads every digit box of an evaluation pack's digit questions with a vision stage's pooled digit head
(train_builtin.py's vision-stage cache in --work: the tower and its heads as the stage left them) and
sets the read of the box the question asks about (the box whose digit is the answer) beside the
model's answer (`vlmopt eval --predictions`), per digit form (single box, left/right, next to):

  - "tower ok, model wrong" is lost after the tower (projector, routing, decoder);
  - "tower wrong" bounds what any decoder could answer from these features.

With --model, the same head also reads that checkpoint's tower (the joint stage trains the tower on;
its heads are not saved, so this is the vision stage's head on the final tower, an approximation).
The eval pack holds 389 digit boxes against the vision stage's 54 held-out ones, so the tower's
reading is measured with a ~2 % standard error instead of ~4 %.

    scripts/experiments/tower_digit_reads.py --vlmopt build/apps/vlmopt/vlmopt \\
        --stage WORK/vision-pooled-...safetensors --pack EVAL.h5 --predictions P.jsonl [--model M]

EVAL.h5: `vlmopt datasets pack builtin:eval EVAL.h5`; P.jsonl: `vlmopt eval --model M --data
builtin:eval --predictions P.jsonl` (the same samples, in the pack's order). Prints one JSON line.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import decoder_prestage as dp  # noqa: E402
import train_builtin as tb  # noqa: E402
from transformers import LlavaConfig, LlavaForConditionalGeneration  # noqa: E402

def digit_form(question: str) -> str:
    return "single" if "in the box" in question else ("next_to" if "next to" in question else "left_right")


def box_reads(model: LlavaForConditionalGeneration, head: torch.nn.Linear, imgs: np.ndarray,
              items: list) -> list[int]:
    """The head's digit per item (sample index, patch mask, "digit", label), batches of 64 images."""
    tap = tb.VisionTap(model)
    reads = []
    with torch.no_grad():
        for start in range(0, len(imgs), 64):
            model.model.vision_tower(pixel_values=tb.to_pixels(imgs[start:start + 64]))
            rows = [(b - start, m, y) for b, m, _, y in items if start <= b < start + 64]
            if rows:
                reads += head(dp.item_means(tap.value[:, 1:, :], rows)).argmax(-1).tolist()
    tap.restore()
    return reads


def crosstab(items: list, reads: list[int], predictions: list[dict]) -> dict:
    """Per digit form: counts of (tower reads the asked box right?, model answers right?)."""
    by_sample = collections.defaultdict(list)
    for (b, _, _, label), read in zip(items, reads):
        by_sample[b].append((label, read))
    table = collections.defaultdict(collections.Counter)
    for b, pred in enumerate(predictions):
        answer = dp.NUMBERS.index(pred["answer"])
        asked = [read == label for label, read in by_sample[b] if label == answer]
        tower = "tower_ok" if asked and asked[0] else "tower_wrong"
        table[digit_form(pred["question"])][f"{tower}/{'model_ok' if pred['correct'] else 'model_wrong'}"] += 1
    return {form: dict(sorted(c.items())) for form, c in sorted(table.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vlmopt", required=True, help="the vlmopt binary (its generator's vocabulary)")
    ap.add_argument("--stage", required=True, type=Path, help="a vision-stage cache (.safetensors) from --work")
    ap.add_argument("--pack", required=True, type=Path, help="vlmopt datasets pack builtin:eval EVAL.h5")
    ap.add_argument("--predictions", required=True, type=Path, help="vlmopt eval --predictions P.jsonl")
    ap.add_argument("--model", type=Path, help="also read this checkpoint's tower with the stage's head")
    args = ap.parse_args()
    torch.set_num_threads(1)

    stage = load_file(args.stage)
    if "heads.digit.weight" not in stage:
        raise SystemExit(f"{args.stage}: no heads.digit.weight (not a pooled vision-stage cache)")
    weight = stage["heads.digit.weight"]
    head = torch.nn.Linear(weight.shape[1], weight.shape[0])
    head.load_state_dict({"weight": weight, "bias": stage["heads.digit.bias"]})
    stage_tower = {k.removeprefix("tower."): v for k, v in stage.items() if k.startswith("tower.")}

    predictions = [json.loads(line) for line in args.predictions.read_text().splitlines() if line.strip()]
    pack = tb.Pack(args.pack)
    if len(pack) != len(predictions):
        raise SystemExit(f"{args.predictions}: {len(predictions)} predictions, {args.pack} holds {len(pack)} samples")
    idx = np.array([i for i, p in enumerate(predictions) if p["question_type"] == "digit"])
    digit_preds = [predictions[i] for i in idx]
    imgs, *_ = pack.batch(idx)
    answers = json.loads(tb.run_vlmopt(args.vlmopt, "--json", "datasets", "vocab"))["answers"]
    items = [it for it in tb.pooled_targets(pack.scenes(idx), answers["shape"], answers["color"]) if it[2] == "digit"]

    towers = {}
    if args.model:
        final = LlavaForConditionalGeneration.from_pretrained(args.model, attn_implementation="eager").eval()
        towers["final_tower"] = final
    config = (towers["final_tower"].config if towers else
              LlavaConfig.from_pretrained(Path(__file__).resolve().parents[2] / "models" / "builtin"))
    staged = LlavaForConditionalGeneration(config).eval()
    staged.model.vision_tower.load_state_dict(stage_tower, strict=True)
    towers = {"stage_tower": staged, **towers}

    out = {"boxes": len(items)}
    for name, model in towers.items():
        reads = box_reads(model, head, imgs, items)
        out[name] = {"boxes_read": sum(r == it[3] for r, it in zip(reads, items)),
                     "by_form": crosstab(items, reads, digit_preds)}
    out["model_right"] = {form: sum(p["correct"] for p in digit_preds if digit_form(p["question"]) == form)
                          for form in ("single", "left_right", "next_to")}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
