#!/usr/bin/env python3
"""Where are the builtin model's count answers lost: in the vision tower's count tags or in the decoder? (issue 3)

Since session 25 every object's symbolic token carries count tags (decoder_prestage.TAGS: the number
of objects of its colour and of its shape) and the vision stage aligns the projector to them, so
that "how many red objects ?" becomes a lookup of any red object's count_color tag. This script
reads those tags back out of a trained checkpoint on the count questions of an evaluation pack --
each object's projected feature at its centre patch (the vision stage's --align-object-centres
target) against the tag's ten number words under the tag's fixed rotation, through the
checkpoint's own word embeddings (decoder_prestage.readout_loss's read) -- and sets them beside the
model's answers (`vlmopt eval --predictions`):

  - tag right: the read of the questioned objects' tag (majority over the objects the question
    counts) equals the true count;
  - answer = tag read: the model's answer equals that read, right or wrong;
  - with --by-size, the reads split by how many of the counted objects are large (does the tower
    count objects or patches?).

    scripts/experiments/count_tag_readout.py --vlmopt build/apps/vlmopt/vlmopt --model M \\
        --pack EVAL.h5 --predictions P.jsonl [--by-size]

EVAL.h5: `vlmopt datasets pack builtin:eval EVAL.h5`; P.jsonl: `vlmopt eval --model M --data
builtin:eval --predictions P.jsonl` (the same samples, in the pack's order).
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import decoder_prestage as dp  # noqa: E402
import train_builtin as tb  # noqa: E402
from transformers import LlavaForConditionalGeneration  # noqa: E402

COUNT_TAGS = ("count_color", "count_shape")


def counted(question: str, shapes: list[str], colors: list[str]) -> tuple[str, str]:
    """("count_color", colour) or ("count_shape", shape) for "how many red objects ?" / "how many circles ?"."""
    words = question.split()
    for c in colors:
        if c in words:
            return "count_color", c
    singular = {p: s for s, p in tb.SHAPE_PLURALS.items()}
    for w in words:
        if w in singular:
            return "count_shape", singular[w]
    raise ValueError(f"count question names no colour or shape: {question!r}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vlmopt", required=True)
    ap.add_argument("--model", required=True, help="checkpoint directory (train_builtin.py --out)")
    ap.add_argument("--pack", required=True, help="the evaluation pack (.h5)")
    ap.add_argument("--predictions", default=None,
                    help="vlmopt eval --predictions output for the same samples (without: the tags alone)")
    ap.add_argument("--limit", type=int, default=0, help="the first N count questions only (0 = all)")
    ap.add_argument("--by-size", action="store_true",
                    help="also the reads split by how many of the counted objects are large: a tower that counted "
                         "patches rather than objects would read higher with more large ones")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    vocab = json.loads(tb.run_vlmopt(args.vlmopt, "--json", "datasets", "vocab"))
    shapes, colors = vocab["answers"]["shape"], vocab["answers"]["color"]
    model = LlavaForConditionalGeneration.from_pretrained(args.model, torch_dtype=torch.float32).eval()
    word_id = json.loads((Path(args.model) / "tokenizer.json").read_text())["model"]["vocab"]
    embed = model.model.language_model.embed_tokens.weight.detach()
    positions = dp.PositionTable(embed.size(1), None, {t: [word_id[w] for w in dp.TAG_WORDS[t]] for t in COUNT_TAGS})
    tables = {t: positions.tag_word_table(embed, t) for t in COUNT_TAGS}  # [10, hidden] each

    predictions = {}
    for line in open(args.predictions) if args.predictions else []:
        r = json.loads(line)
        predictions[int(r["id"].rsplit("/", 1)[1])] = r
    pack = tb.Pack(Path(args.pack))
    types = [tb.Pack.text(t) for t in pack.types[:]]
    idx = np.array([i for i, t in enumerate(types) if t == "count"])
    if args.limit:
        idx = idx[:args.limit]

    rows = []  # per question: true count, tag read (None: no object counted), answer, kind
    by_value = collections.defaultdict(collections.Counter)  # (tag, true value) -> reads
    by_size = collections.defaultdict(collections.Counter)  # (tag, objects counted, of them large) -> reads
    for start in range(0, len(idx), args.batch):
        part = idx[start:start + args.batch]
        imgs, questions, answers, _ = pack.batch(part)
        scenes = pack.scenes(part)
        with torch.no_grad():
            out = model.model.vision_tower(tb.to_pixels(imgs), output_hidden_states=True)
            feats = out.hidden_states[model.config.vision_feature_layer][:, 1:]  # [B, 144, hidden], no CLS
            projected = model.model.multi_modal_projector(feats)
        for b, (i, sc, q, a) in enumerate(zip(part, scenes, questions, answers)):
            tag, word = counted(q, shapes, colors)
            key = "color" if tag == "count_color" else "shape"
            reads = []
            obj_tags, _ = dp.item_tags(dp.scene_from_meta(sc))
            same = [(j, o) for j, o in enumerate(sc["objects"]) if o[key] == word]
            size_key = (tag, len(same), sum(o["size"] != "small" for _, o in same))
            for j, o in same:
                feat = projected[b, dp.patch_index(o["cx"], o["cy"])]
                read = int((feat @ tables[tag].T).argmax())
                reads.append(read)
                by_value[(tag, obj_tags[j][dp.TAGS.index(tag)])][read] += 1
                by_size[size_key][read] += 1
            read = collections.Counter(reads).most_common(1)[0][0] if reads else None
            rows.append((dp.NUMBERS.index(a), read, predictions[int(i)]["prediction"] if predictions else None, tag))

    per_tag = {t: [(reads[v], sum(reads.values())) for (tt, v), reads in by_value.items() if tt == t] for t in COUNT_TAGS}
    print(f"{len(rows)} count questions; per object, tag read right: "
          + ", ".join(f"{t} {sum(r for r, _ in per_tag[t])}/{sum(n for _, n in per_tag[t])}" for t in COUNT_TAGS))
    for t in COUNT_TAGS:
        print(f"{t} per object, true value: reads")
        for v in sorted(n for tt, n in by_value if tt == t):
            reads = by_value[(t, v)]
            print(f"  {dp.NUMBERS[v]:>5}: right {reads[v]}/{sum(reads.values())}; reads "
                  + ", ".join(f"{dp.NUMBERS[r]} {c}" for r, c in sorted(reads.items())))
    if args.by_size:
        print("tag | objects counted | of them large | objects | read right | mean read")
        for (t, n, large), reads in sorted(by_size.items()):
            total = sum(reads.values())
            print(f"{t} | {n} | {large} | {total} | {reads[n]} | {sum(r * c for r, c in reads.items()) / total:.2f}")
    if not predictions:
        return 0
    print("true | n | answer right | tag read right | answer = tag read | answer right, tag wrong | tag right, answer wrong")
    for n in sorted({r[0] for r in rows}):
        sel = [r for r in rows if r[0] == n]
        right = sum(dp.NUMBERS[r[0]] == r[2] for r in sel)
        with_obj = [r for r in sel if r[1] is not None]
        tag_right = sum(r[1] == r[0] for r in with_obj)
        follows = sum(dp.NUMBERS[r[1]] == r[2] for r in with_obj)
        ans_not_tag = sum(dp.NUMBERS[r[0]] == r[2] and r[1] != r[0] for r in with_obj)
        tag_not_ans = sum(r[1] == r[0] and dp.NUMBERS[r[0]] != r[2] for r in with_obj)
        print(f"{dp.NUMBERS[n]:>5} | {len(sel)} | {right} | {tag_right}/{len(with_obj)} | {follows}/{len(with_obj)} "
              f"| {ans_not_tag} | {tag_not_ans}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
