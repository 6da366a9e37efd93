"""Language pre-stage of the builtin model's decoder: symbolic scenes, one token per object.

A real LLaVA starts from a pretrained language model; the builtin model's decoder
starts from random weights, and on the CPU budget it does not learn to route a
question to the image patches it names (docs/BENCHMARKS.md, issue 3, sessions
7-9). This stage teaches it that routing on cheap, short sequences before it
ever sees an image:

- scenes are sampled here (the generator's shapes, colours, sizes, 96 px canvas,
  digit boxes, and its eight question kinds with their templates),
- each object is ONE image token: the sum of the decoder's own input embeddings
  of its words (colour + shape + size; "box" + digit word for a digit box) plus
  learned row and column embeddings of its centre patch, placed at that patch's
  RoPE position inside the 144-token image span, so the question follows at the
  positions it has in the real prompt,
- the output head is tied to the input embeddings (answering copies a component
  of an image token).

A step costs ~0.18 s at batch 64 on 2 cores (sequences of ~25 tokens instead of
~180). What the stage leaves behind is a decoder that answers from image tokens
in this word-embedding space and the per-patch position table; the vision tower
and projector are then trained to produce that space (train_builtin.py
--align-weight), the LLaVA recipe with the roles of the stages swapped.

Used by scripts/train_builtin.py (--decoder-prestage-steps; SymbolicScenes.questions over a
real scene's layout, scene_from_meta, also gives its joint stage's extra turns; aligned_targets
and readout_loss tie the projector to this stage's input space) and
scripts/experiments/decoder_symbolic_scenes.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass

import numpy as np
import torch

import decoder_rows

CANVAS, PATCH = 96, 8
GRID = CANVAS // PATCH
KINDS = ["color", "shape", "count", "exist", "position", "relation", "size", "digit"]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
CLEAR_MARGIN = 14  # px from the centre line, as the generator's position questions
RELATION_WORDS = ("left of", "right of", "above", "below")
HORIZONTAL_WORDS, VERTICAL_WORDS = RELATION_WORDS[:2], RELATION_WORDS[2:]


def pick(rng: np.random.Generator, pool: list[str], exclude: str | None = None) -> str:
    """One of pool (but exclude), uniformly."""
    choices = [x for x in pool if x != exclude]
    return choices[rng.integers(len(choices))]


def free_centre(rng: np.random.Generator, objs: list[dict], gap: float = 12) -> tuple[int, int]:
    """A centre on the canvas >= gap px from every object's in objs: distinct patches, so one
    symbolic token per object (the count and binding layouts)."""
    while True:
        cx, cy = int(rng.integers(8, 88)), int(rng.integers(8, 88))
        if all(np.hypot(cx - o["cx"], cy - o["cy"]) >= gap for o in objs):
            return cx, cy


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


@dataclass
class SymbolicScenes:
    """Scene and question sampler over the generator's vocabulary (shapes/colours in its order)."""
    shapes: list[str]
    colors: list[str]
    plurals: dict[str, str]
    # Also the "which digit is next to the X ?" layout (next_to_scene). Off in the shipped recipe:
    # 3000 steps did not learn the two-hop lookup and the rest formed later (session 11).
    next_to: bool = False
    # px between centres for a relation question. The generator asks at >= 16 (what the joint
    # stage's derived turns use); the pre-stage samples at >= 12, as unambiguous, because those
    # are the draws its shipped weights came from: with 16 (and single-object sized colour
    # questions) the draws change, and in that run colour routing had not formed by step 3000
    # (0.41 vs 0.95; docs/BENCHMARKS.md, session 11).
    relation_margin: int = 12
    # "what color is the large X ?" also when there is a single X (the generator asks it; the
    # pre-stage's draws have it only for two X of different sizes, see relation_margin).
    sized_color_singles: bool = False
    # Count questions on the generator's count layouts (count_sample) instead of random scenes.
    count_layouts: bool = False
    # Colour and exist questions on the generator's binding layouts (binding_sample): "what color is
    # the large X ?" with an X of the other size beside it, "is there a red X ?" with lures that share
    # one attribute. Random scenes hardly hold either, and every model through session 25 answered the
    # sized pair at chance on builtin:eval (23-29 of 60 right) and 23 of 59 lured "no" wrong.
    binding_layouts: bool = False
    # The relation words asked. With "left of" alone the pre-staged decoder learns relation in
    # 100 steps; with all four it stays at chance without comparator_targets' probe (session 17).
    relation_words: tuple[str, ...] = RELATION_WORDS
    # When set, each draw asks the horizontal words with this probability and the vertical ones
    # otherwise (relation_words is then ignored). With the four words drawn evenly one axis's
    # comparison forms first and the other may not form at all within the phase (session 18).
    horizontal_share: float | None = None
    # The "which digit is in the left box ?" layout as the generator draws it (compose_digit: boxes of
    # 26-32 px side, 6 px apart, the left one placed first within what leaves room for the right one,
    # each at its own height), which puts the left box's centre in the image's left half and the right
    # one's in the right half: the question is then a lookup by side, as position questions are. The
    # default layout puts both anywhere >= 16 px apart on one row, so the decoder has to compare the
    # two boxes' columns -- a comparison that formed on symbolic scenes in some runs only (0.37-0.94 at
    # the pre-stage's end) and on images stayed at chance (t5: 32 right, 34 the other box's digit).
    generator_boxes: bool = False

    def scene(self, rng: np.random.Generator) -> dict:
        objs = [{"shape": self.shapes[rng.integers(len(self.shapes))], "color": self.colors[rng.integers(len(self.colors))],
                 "size": "large" if rng.random() < 0.4 else "small",
                 "cx": int(rng.integers(8, 88)), "cy": int(rng.integers(8, 88))}
                for _ in range(int(rng.integers(1, 7)))]
        boxes = []
        r = rng.random()
        if r < 0.3:
            boxes.append({"label": int(rng.integers(10)), "cx": int(rng.integers(10, 86)), "cy": int(rng.integers(10, 86))})
        elif r < 0.45 and self.generator_boxes:
            boxes += self.side_by_side_boxes(rng)
        elif r < 0.45:  # two boxes side by side, different digits
            a, b = sorted(int(x) for x in rng.choice(np.arange(10, 86), 2, replace=False))
            b = max(b, min(85, a + 16))
            la = int(rng.integers(10))
            y = int(rng.integers(10, 86))
            boxes += [{"label": la, "cx": a, "cy": y}, {"label": (la + 1 + int(rng.integers(9))) % 10, "cx": b, "cy": y}]
        elif r < 0.6 and self.next_to:
            return self.next_to_scene(rng)
        return {"objects": objs, "boxes": boxes}

    @staticmethod
    def side_by_side_boxes(rng: np.random.Generator) -> list[dict]:
        """Two digit boxes of different digits as datasets/scenes.cpp compose_digit places them
        (generator_boxes): sides 26-32 px, the left box's corner in [2, 96 - 2 - both sides - 6], the
        right one's >= 6 px past the left box, each row uniform; centres as the box's middle."""
        edge, gap = 2, 6
        left_side, right_side = (int(rng.integers(24, 31)) + 2 for _ in range(2))
        left_x = int(rng.integers(edge, CANVAS - edge - right_side - gap - left_side + 1))
        right_x = int(rng.integers(left_x + left_side + gap, CANVAS - edge - right_side + 1))
        label = int(rng.integers(10))
        return [{"label": label, "cx": left_x + left_side // 2,
                 "cy": int(rng.integers(edge, CANVAS - edge - left_side + 1)) + left_side // 2},
                {"label": (label + 1 + int(rng.integers(9))) % 10, "cx": right_x + right_side // 2,
                 "cy": int(rng.integers(edge, CANVAS - edge - right_side + 1)) + right_side // 2}]

    def next_to_scene(self, rng: np.random.Generator) -> dict:
        """The generator's "which digit is next to the X ?" layout: two small objects far apart,
        each with a digit box beside it (box centre ~24 px away along one axis, the box's side
        drawn at random), and nothing else."""
        while True:
            objs = [{"shape": self.shapes[rng.integers(len(self.shapes))], "color": self.colors[rng.integers(len(self.colors))],
                     "size": "small", "cx": int(rng.integers(10, 86)), "cy": int(rng.integers(10, 86))} for _ in range(2)]
            if (objs[0]["shape"], objs[0]["color"]) == (objs[1]["shape"], objs[1]["color"]):
                continue
            boxes = []
            for o in objs:
                dx, dy = [(24, 0), (-24, 0), (0, 24), (0, -24)][rng.integers(4)]
                slide = int(rng.integers(-4, 5))
                boxes.append({"label": int(rng.integers(10)), "anchor": len(boxes),
                              "cx": o["cx"] + dx + (slide if dy else 0), "cy": o["cy"] + dy + (slide if dx else 0)})
            centres = [(o["cx"], o["cy"]) for o in objs] + [(b["cx"], b["cy"]) for b in boxes]
            dist = lambda a, b: float(np.hypot(a[0] - b[0], a[1] - b[1]))
            if (all(15 <= c <= 81 for xy in centres[2:] for c in xy) and dist(centres[0], centres[1]) >= 56
                    and dist(centres[3], centres[0]) >= 36 and dist(centres[2], centres[1]) >= 36
                    and boxes[0]["label"] != boxes[1]["label"]):
                return {"objects": objs, "boxes": boxes}

    def questions(self, scene: dict) -> dict[str, list[tuple[str, str]]]:
        """Every (question, answer) the scene answers unambiguously, by kind."""
        objs, out = scene["objects"], {k: [] for k in KINDS}
        desc = lambda o: f"{o['color']} {o['shape']}"
        for s in self.shapes:
            same = [o for o in objs if o["shape"] == s]
            if len(same) < len(NUMBERS):
                out["count"].append((f"how many {self.plurals[s]} are there ?", NUMBERS[len(same)]))
            out["exist"].append((f"is there {article(s)} {s} ?", "yes" if same else "no"))
            if len(same) == 1:
                out["color"].append((f"what color is the {s} ?", same[0]["color"]))
            sized_pair = len(same) == 2 and same[0]["size"] != same[1]["size"]
            if sized_pair or (len(same) == 1 and self.sized_color_singles):
                out["color"] += [(f"what color is the {o['size']} {s} ?", o["color"]) for o in same]
        for c in self.colors:
            same = [o for o in objs if o["color"] == c]
            out["count"].append((f"how many {c} objects are there ?", NUMBERS[len(same)]))
            out["exist"].append((f"is there {article(c)} {c} object ?", "yes" if same else "no"))
            if len(same) == 1:
                out["shape"].append((f"what shape is the {c} object ?", same[0]["shape"]))
        unique = [o for o in objs if sum(desc(x) == desc(o) for x in objs) == 1]
        for o in unique:
            out["exist"].append((f"is there {article(desc(o))} {desc(o)} ?", "yes"))
            out["size"].append((f"is the {desc(o)} small or large ?", o["size"]))
            if abs(o["cx"] - CANVAS // 2) >= CLEAR_MARGIN:
                out["position"].append((f"is the {desc(o)} on the left or the right ?",
                                        "left" if o["cx"] < CANVAS // 2 else "right"))
            if abs(o["cy"] - CANVAS // 2) >= CLEAR_MARGIN:
                out["position"].append((f"is the {desc(o)} at the top or the bottom ?",
                                        "top" if o["cy"] < CANVAS // 2 else "bottom"))
            for p in unique:
                if p is o:
                    continue
                for rel, d in (("left of", p["cx"] - o["cx"]), ("right of", o["cx"] - p["cx"]),
                               ("above", p["cy"] - o["cy"]), ("below", o["cy"] - p["cy"])):
                    if abs(d) >= self.relation_margin and rel in self.relation_words:
                        out["relation"].append((f"is the {desc(o)} {rel} the {desc(p)} ?", "yes" if d > 0 else "no"))
        # Lures for "no": colour + shape pairs that are absent (the generator's lures share one attribute).
        absent = [(c, s) for c in self.colors for s in self.shapes
                  if not any(o["color"] == c and o["shape"] == s for o in objs)]
        out["exist"] += [(f"is there {article(c)} {c} {s} ?", "no") for c, s in absent[:3]]
        boxes = scene["boxes"]
        if len(boxes) == 1:
            out["digit"].append(("which digit is in the box ?", NUMBERS[boxes[0]["label"]]))
        if len(boxes) == 2 and "anchor" in boxes[0]:
            out["digit"] += [(f"which digit is next to the {desc(objs[b['anchor']])} ?", NUMBERS[b["label"]])
                             for b in boxes]
        elif len(boxes) == 2:
            left, right = sorted(boxes, key=lambda b: b["cx"])
            out["digit"] += [("which digit is in the left box ?", NUMBERS[left["label"]]),
                             ("which digit is in the right box ?", NUMBERS[right["label"]])]
        return out

    def count_sample(self, rng: np.random.Generator) -> tuple[dict, str, str, str]:
        """A count question on the generator's count layout (datasets/scenes.cpp compose_count):
        n = 0..5 targets of one shape (any colour) or one colour (any shape), 0..min(3, 6 - n)
        distractors without that attribute (at least one when n = 0), mostly small objects when
        crowded, centres >= 12 px apart (so distinct patches: one token per object). Random scenes
        (scene) almost never hold an attribute three times, while builtin:eval asks zero..five
        uniformly (session 13)."""
        n = int(rng.integers(0, 6))
        by_shape = bool(rng.random() < 0.5)
        distractors = int(rng.integers(1 if n == 0 else 0, min(3, 6 - n) + 1))
        large_p = 0.15 if n + distractors >= 5 else 0.35
        shape, color = pick(rng, self.shapes), pick(rng, self.colors)
        specs = [(shape if by_shape else pick(rng, self.shapes), pick(rng, self.colors) if by_shape else color)
                 for _ in range(n)]
        specs += [(pick(rng, self.shapes, shape), pick(rng, self.colors)) if by_shape
                  else (pick(rng, self.shapes), pick(rng, self.colors, color)) for _ in range(distractors)]
        objs = []
        for sh, co in specs:
            cx, cy = free_centre(rng, objs)
            objs.append({"shape": sh, "color": co, "size": "large" if rng.random() < large_p else "small",
                         "cx": cx, "cy": cy})
        q = f"how many {self.plurals[shape]} are there ?" if by_shape else f"how many {color} objects are there ?"
        return {"objects": objs, "boxes": []}, "count", q, NUMBERS[n]

    def binding_sample(self, rng: np.random.Generator, kind: str) -> tuple[dict, str, str, str] | None:
        """A colour or exist question on the generator's layouts (datasets/scenes.cpp compose_color,
        compose_exist) where only binding two attributes of one object answers it, more often than
        the generator asks them: colour, half the time a same-shape pair of different sizes and
        colours ("what color is the large X ?"), else one X, its size named 30 % of the time;
        exist, half the time the colour + shape form with lures that share the shape or the colour
        (answer yes or no evenly), else None (a random scene: the shape-only and colour-only forms).
        0-3 distractors that do not match, centres >= 12 px apart (one token per object)."""
        shape, color = pick(rng, self.shapes), pick(rng, self.colors)
        specs: list[tuple[str, str, str]] = []  # (shape, colour, size)
        if kind == "color":
            size = "large" if rng.random() < 0.5 else "small"
            specs.append((shape, color, size))
            pair = bool(rng.random() < 0.5)
            if pair:
                specs.append((shape, pick(rng, self.colors, color), "small" if size == "large" else "large"))
            sized = pair or bool(rng.random() < 0.3)
            q = f"what color is the {size} {shape} ?" if sized else f"what color is the {shape} ?"
            a = color
            keep = lambda sh, co: sh != shape
            distractors = int(rng.integers(0, 5 - len(specs)))
        else:
            if rng.random() < 0.5:
                return None
            yes = bool(rng.random() < 0.5)
            large = lambda p: "large" if rng.random() < p else "small"
            if yes:
                specs.append((shape, color, large(0.5)))
            if rng.random() < 0.6:
                specs.append((pick(rng, self.shapes, shape), color, large(0.35)))
            if rng.random() < 0.6:
                specs.append((shape, pick(rng, self.colors, color), large(0.35)))
            desc = f"{color} {shape}"
            q, a = f"is there {article(desc)} {desc} ?", "yes" if yes else "no"
            keep = lambda sh, co: (sh, co) != (shape, color)
            distractors = int(rng.integers(0 if specs else 1, 3))
        while distractors > 0:
            sh, co = pick(rng, self.shapes), pick(rng, self.colors)
            if keep(sh, co):
                specs.append((sh, co, "large" if rng.random() < 0.35 else "small"))
                distractors -= 1
        objs = []
        for sh, co, size in specs:
            cx, cy = free_centre(rng, objs)
            objs.append({"shape": sh, "color": co, "size": size, "cx": cx, "cy": cy})
        return {"objects": objs, "boxes": []}, kind, q, a

    def sample(self, rng: np.random.Generator, kinds: list[str]) -> tuple[dict, str, str, str]:
        """A kind drawn uniformly, then a scene that has a question of that kind."""
        if self.horizontal_share is not None:
            words = HORIZONTAL_WORDS if rng.random() < self.horizontal_share else VERTICAL_WORDS
            return dataclasses.replace(self, relation_words=words, horizontal_share=None).sample(rng, kinds)
        kind = kinds[rng.integers(len(kinds))]
        if kind == "count" and self.count_layouts:
            return self.count_sample(rng)
        if kind in ("color", "exist") and self.binding_layouts:
            drawn = self.binding_sample(rng, kind)
            if drawn is not None:
                return drawn
        while True:
            scene = self.scene(rng)
            cands = self.questions(scene)[kind]
            if kind == "count":  # the generator balances counts; most attributes are absent otherwise
                nonzero = [c for c in cands if c[1] != "zero"]
                cands = nonzero if nonzero and rng.random() < 0.8 else cands
            if cands:
                q, a = cands[rng.integers(len(cands))]
                return scene, kind, q, a


def scene_from_meta(meta: dict) -> dict:
    """A generator scene (an HDF5 pack's meta: objects with centres, digit boxes by corner and
    side) as a symbolic scene. Two boxes that each touch a different object (gap <= 8 px: the
    generator leaves 1-3 px to the object's rotated outline, and >= 12 px to the other one) are the
    "next to" layout and get their object as anchor; any other two boxes are the left/right layout."""
    objs = [{k: o[k] for k in ("shape", "color", "size", "cx", "cy")} for o in meta.get("objects", [])]
    boxes = [{"label": int(d["label"]), "cx": d["x"] + d["side"] / 2, "cy": d["y"] + d["side"] / 2}
             for d in meta.get("digits", [])]
    if len(boxes) == 2 and meta.get("objects"):
        def touching(d) -> int | None:
            gaps = [max(d["x"] - o["cx"] - o["radius"], o["cx"] - o["radius"] - d["x"] - d["side"],
                        d["y"] - o["cy"] - o["radius"], o["cy"] - o["radius"] - d["y"] - d["side"])
                    for o in meta["objects"]]
            j = int(np.argmin(gaps))
            return j if gaps[j] <= 8 else None
        anchors = [touching(d) for d in meta["digits"]]
        if None not in anchors and anchors[0] != anchors[1]:
            for b, a in zip(boxes, anchors):
                b["anchor"] = a
    return {"objects": objs, "boxes": boxes}


def patch_index(x: float, y: float) -> int:
    """Raster index of the patch holding pixel (x, y) of the canvas."""
    return min(int(y) // PATCH, GRID - 1) * GRID + min(int(x) // PATCH, GRID - 1)


# Item tags (PositionTable(tag_words=...)): words a symbolic token carries beyond its own, each
# under its own fixed rotation of the word-embedding space, that turn a question which needs
# counting or a second hop into a lookup on one token:
# - count_color / count_shape, on an object: the number of objects of its colour / of its shape
#   in the scene, itself included ("how many red objects" -> any red object's count_color);
# - next_digit, on an object with a digit box beside it (the "next to" layout): that box's digit;
# - box_side, on each of two digit boxes side by side: "left" or "right".
TAGS = ("count_color", "count_shape", "next_digit", "box_side")
TAG_WORDS = {"count_color": NUMBERS, "count_shape": NUMBERS, "next_digit": NUMBERS, "box_side": ["left", "right"]}
NO_TAG = -1


def item_tags(scene: dict) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Per object and per digit box (the scene's orders), its tags: one index into TAG_WORDS[tag]
    per TAGS entry, NO_TAG where it has none. Boxes with an "anchor" (next_to_scene,
    scene_from_meta) are the next-to layout; two boxes without are the left/right one."""
    objs, boxes = scene["objects"], scene["boxes"]
    beside = {b["anchor"]: b["label"] for b in boxes if "anchor" in b}
    obj_tags = [(sum(x["color"] == o["color"] for x in objs), sum(x["shape"] == o["shape"] for x in objs),
                 beside.get(j, NO_TAG), NO_TAG) for j, o in enumerate(objs)]
    box_tags = [(NO_TAG,) * 4 for _ in boxes]
    if len(boxes) == 2 and not beside:
        left = 0 if boxes[0]["cx"] <= boxes[1]["cx"] else 1
        box_tags = [(NO_TAG, NO_TAG, NO_TAG, 0 if i == left else 1) for i in range(2)]
    return obj_tags, box_tags


def scene_items(scene: dict) -> list[tuple[int, list[str], tuple[int, ...]]]:
    """(centre patch index, words, tags) per object and digit box, raster order of the patches."""
    obj_tags, box_tags = item_tags(scene)
    items = [(patch_index(o["cx"], o["cy"]), [o["color"], o["shape"], o["size"]], t)
             for o, t in zip(scene["objects"], obj_tags)]
    items += [(patch_index(b["cx"], b["cy"]), ["box", NUMBERS[b["label"]]], t) for b, t in zip(scene["boxes"], box_tags)]
    seen, out = set(), []
    for p, w, tags in sorted(items, key=lambda t: t[0]):
        if p not in seen:  # two items on one patch: the first keeps it (one token per position)
            seen.add(p)
            out.append((p, w, tags))
    return out


def item_words(scene: dict) -> list[tuple[int, list[str]]]:
    """(centre patch index, words) per object and digit box, raster order of the patches."""
    return [(p, w) for p, w, _ in scene_items(scene)]


def collate(samples, word_id: dict[str, int]) -> dict:
    """<s> USER: [item tokens at their patch positions] question ASSISTANT: answer </s>, right-padded."""
    rows = []
    image_start = 2
    for scene, kind, q, a in samples:
        items = scene_items(scene)
        q_ids = [word_id[w] for w in q.split()] + [word_id["ASSISTANT:"]]
        a_ids = [word_id[w] for w in a.split()] + [word_id["</s>"]]
        text_start = image_start + GRID * GRID
        pos = [0, 1] + [image_start + p for p, _, _ in items] + list(range(text_start, text_start + len(q_ids) + len(a_ids)))
        ids = [word_id["<s>"], word_id["USER:"]] + [word_id["<pad>"]] * len(items) + q_ids + a_ids
        prefix = image_start + len(items) + len(q_ids)
        rows.append((ids, pos, [-100] * prefix + a_ids, items, prefix - 1, kind, a_ids[0]))
    T, B = max(len(r[0]) for r in rows), len(rows)
    batch = {"ids": torch.full((B, T), word_id["<pad>"], dtype=torch.long), "pos": torch.zeros(B, T, dtype=torch.long),
             "labels": torch.full((B, T), -100, dtype=torch.long), "attn": torch.zeros(B, T, dtype=torch.long)}
    img_b, img_t, img_words, img_patch, img_tags = [], [], [], [], []
    for b, (ids, pos, lab, items, _, _, _) in enumerate(rows):
        n = len(ids)
        batch["ids"][b, :n] = torch.tensor(ids)
        batch["pos"][b, :n] = torch.tensor(pos)
        batch["pos"][b, n:] = pos[-1] + 1 + torch.arange(T - n)  # masked out; any value works
        batch["labels"][b, :n] = torch.tensor(lab)
        batch["attn"][b, :n] = 1
        for j, (p, words, tags) in enumerate(items):
            img_b.append(b)
            img_t.append(image_start + j)
            img_words.append([word_id[w] for w in words])
            img_patch.append(p)
            img_tags.append(list(tags))
    words = torch.full((len(img_words), 3), -1, dtype=torch.long)
    for j, w in enumerate(img_words):
        words[j, :len(w)] = torch.tensor(w)
    batch.update(img_b=torch.tensor(img_b), img_t=torch.tensor(img_t), img_words=words,
                 img_patch=torch.tensor(img_patch), img_tags=torch.tensor(img_tags, dtype=torch.long).view(-1, len(TAGS)),
                 answer_pos=torch.tensor([r[4] for r in rows]),
                 kinds=[r[5] for r in rows], answer=torch.tensor([r[6] for r in rows]))
    return batch


TAG_SEED = 20261204  # the item tags' rotations (PositionTable(tag_words=...))
SIDE_SCALE = 12.0  # px: the side component saturates this far from the centre line (questions need >= 14)


def side_coefficients(patch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Horizontal and vertical side of a patch's centre, each in [-1, 1] (negative = left / top).

    Half a saturating sign (position questions: left or right of the centre line) and half a
    linear ramp (relation questions compare two objects' ramps)."""
    centre = lambda i: (i.float() * PATCH + (PATCH - 1) / 2.0 - CANVAS / 2)
    x, y = centre(patch % GRID), centre(patch // GRID)
    coef = lambda d: 0.5 * (d / SIDE_SCALE).clamp(-1, 1) + 0.5 * d / (CANVAS / 2)
    return coef(x), coef(y)


class PositionTable(torch.nn.Module):
    """Per-patch position vectors [GRID*GRID, hidden] (table()) for the symbolic image tokens.

    Learned row + column embeddings; with side_words (token ids of "left", "right", "top",
    "bottom"), also the patch's side in the word-embedding space: h * (e_right - e_left) +
    v * (e_bottom - e_top) (side_coefficients). A position question then reads the side the way a
    colour question reads the colour word: copied out of the token through the tied head.
    On in the shipped recipe since session 12, after a first phase of size and position questions
    only (train_builtin.py --prestage-position-first): from the full mix alone it slowed the routing
    (0.585 vs 0.785 held-out at step 3000, with --next-to) and position stayed at 0.65, and switched
    on after the routing had formed it was never picked up (docs/BENCHMARKS.md, sessions 11, 12)."""

    def __init__(self, hidden: int, side_words: tuple[int, int, int, int] | None = None,
                 tag_words: dict[str, list[int]] | None = None):
        super().__init__()
        self.row = torch.nn.Embedding(GRID, hidden)
        self.col = torch.nn.Embedding(GRID, hidden)
        torch.nn.init.normal_(self.row.weight, std=0.02)
        torch.nn.init.normal_(self.col.weight, std=0.02)
        self.side_words = side_words
        # The item tags in use (some of TAGS) -> the token ids of their TAG_WORDS.
        self.tag_words = {t: tag_words[t] for t in TAGS if t in tag_words} if tag_words else {}
        # Whether logits() adds the tags to the symbolic tokens (train_builtin.py turns them on in
        # the pre-stage's last phases only); the vision stage's targets have them either way.
        self.tags_active = bool(self.tag_words)
        if self.tag_words:
            # One fixed random rotation per tag (their own generator: the torch RNG, and so every
            # other initialisation, stays as without them; not saved, rebuilt here).
            g = torch.Generator().manual_seed(TAG_SEED)
            rotations = [torch.linalg.qr(torch.randn(hidden, hidden, generator=g))[0] for _ in TAGS]
            self.register_buffer("tag_rotations", torch.stack(rotations), persistent=False)

    def tag_word_table(self, embed_weight: torch.Tensor, tag: str) -> torch.Tensor:
        """[len(TAG_WORDS[tag]), hidden]: the tag's words' embeddings under its rotation."""
        # A one-hot matmul, not indexing: the backward of an index sums into the embedding rows in an
        # order that varies between runs on 2 threads (session 25: the same seed gave other weights).
        pick = torch.nn.functional.one_hot(torch.tensor(self.tag_words[tag]), embed_weight.size(0)).to(embed_weight.dtype)
        return (pick @ embed_weight) @ self.tag_rotations[TAGS.index(tag)].T

    def item_tag(self, embed_weight: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        """[N, hidden] per item: the sum of its tags in use, each its word under the tag's rotation;
        tags [N, len(TAGS)] (collate's img_tags), NO_TAG where an item has none.

        Counting on the decoder's side stays near chance from two on whatever the pre-stage tried
        (0.43-0.58 on symbolic scenes; docs/BENCHMARKS.md, sessions 13-24), while it looks up an
        object's attributes reliably. With the tags such questions become lookups, and the counting
        (and the box beside an object, the box left of another) moves to the vision tower, whose
        bidirectional attention sees the whole image and whose stage supervises every item densely."""
        out = embed_weight.new_zeros(tags.size(0), embed_weight.size(1))
        for tag in self.tag_words:
            n = tags[:, TAGS.index(tag)]
            table = self.tag_word_table(embed_weight, tag)
            pick = torch.nn.functional.one_hot(n.clamp(min=0), table.size(0)).to(table.dtype) * (n >= 0).unsqueeze(-1)
            out = out + pick @ table
        return out

    def forward(self, patch: torch.Tensor, embed_weight: torch.Tensor | None = None) -> torch.Tensor:
        out = self.row(patch // GRID) + self.col(patch % GRID)
        if self.side_words is not None:
            if embed_weight is None:
                raise ValueError("PositionTable with side_words needs the decoder's embedding weight")
            left, right, top, bottom = (embed_weight[i] for i in self.side_words)
            h, v = side_coefficients(patch)
            out = out + h.unsqueeze(-1) * (right - left) + v.unsqueeze(-1) * (bottom - top)
        return out

    def table(self, embed_weight: torch.Tensor | None = None) -> torch.Tensor:
        return self(torch.arange(GRID * GRID), embed_weight)


def logits(lm, positions: PositionTable, batch: dict, hidden_layer: int | None = None,
           attention_layer: int | None = None):
    """lm: a LlamaModel; the head is tied to its input embeddings. [B, T, vocab]; with hidden_layer,
    also that layer's output (hidden_states[hidden_layer]) at each row's answer position, [B, hidden];
    with attention_layer (lm in eager attention), also that layer's attention probabilities from each
    row's answer position, [B, heads, T]."""
    embed = lm.get_input_embeddings()
    x = embed(batch["ids"])
    if batch["img_words"].numel():
        w = batch["img_words"]
        feats = (embed(w.clamp(min=0)) * (w >= 0).unsqueeze(-1)).sum(1) + positions(batch["img_patch"], embed.weight)
        if positions.tag_words and positions.tags_active:
            feats = feats + positions.item_tag(embed.weight, batch["img_tags"])
        x = x.index_put((batch["img_b"], batch["img_t"]), feats)
    out = lm(inputs_embeds=x, position_ids=batch["pos"], attention_mask=batch["attn"],
             output_hidden_states=hidden_layer is not None, output_attentions=attention_layer is not None)
    head = out.last_hidden_state @ embed.weight.T
    rows = torch.arange(x.size(0))
    extra = []
    if hidden_layer is not None:
        extra.append(out.hidden_states[hidden_layer][rows, batch["answer_pos"]])
    if attention_layer is not None:
        extra.append(out.attentions[attention_layer][rows, :, batch["answer_pos"]])
    return (head, *extra) if extra else head


def comparator_targets(samples) -> torch.Tensor:
    """[N, 2] per sample: is the second-named object of a relation question right of / below the
    first (1.0 / 0.0), or -1 where not asked (other kinds, or centres < 6 px apart on that axis).

    A relation answer is the XOR of this comparison and the relation word's polarity ("left of"
    vs "right of"): neither alone correlates with the answer, so from the answer loss alone the
    decoder stays at chance on relation questions however long it trains (docs/BENCHMARKS.md,
    session 17). A probe on the comparison gives the routing to both objects a gradient of its own."""
    out = torch.full((len(samples), 2), -1.0)
    for i, (scene, kind, q, _) in enumerate(samples):
        if kind != "relation":
            continue
        words = q.split()  # "is the C S <relation> the C2 S2 ?"
        find = lambda c, s: next(o for o in scene["objects"] if o["color"] == c and o["shape"] == s)
        first, second = find(words[2], words[3]), find(words[-3], words[-2])
        for j, axis in enumerate(("cx", "cy")):
            d = second[axis] - first[axis]
            if abs(d) >= 6:
                out[i, j] = float(d > 0)
    return out


def route_targets(samples) -> torch.Tensor:
    """[N] per sample: the sequence index (collate's layout) of the digit box a two-box digit question
    asks about ("in the left box", "next to the X"), or -1 (other questions, or the box lost its
    patch to another item).

    The two-box form selects one of two box tokens by their columns (or by the object beside them);
    from the answer loss alone it forms in some runs and not others (0.38-0.43 on symbolic scenes at
    the pre-stage's end, session 19). A loss on the attention from the answer position to that box
    gives the selection a gradient of its own -- which did not help: at weight 0.5 in the remix (with
    count_route_targets' loss) the form ended at 0.29 against 0.38 without (session 21); off in the recipe.
    Also a sized colour question ("what color is the large X ?"): the slot of the object it names, which
    the answer loss alone never selects by its size (session 26)."""
    out = torch.full((len(samples),), -1, dtype=torch.long)
    for i, (scene, kind, q, answer) in enumerate(samples):
        words = q.split()
        if kind == "color" and len(words) == 7:  # "what color is the <size> <shape> ?": the object named
            named = [answer, words[5], words[4]]
            j = next((j for j, (_, w) in enumerate(item_words(scene)) if w == named), None)
            if j is not None:
                out[i] = 2 + j
            continue
        if kind != "digit" or len(scene["boxes"]) != 2:
            continue
        items = item_words(scene)
        j = next((j for j, (_, w) in enumerate(items) if w == ["box", answer]), None)
        if j is not None:
            out[i] = 2 + j  # <s> USER: then the item tokens (collate's image_start)
    return out


def count_route_targets(samples, plurals: dict[str, str]) -> list[list[int]]:
    """Per sample: for a count question, the sequence slots (collate's layout) of <s> and of every
    object it counts ("how many circles", "how many red objects"); [] otherwise, and where a counted
    object lost its patch to another item (random scenes; the count layouts keep objects apart).

    Attention spread evenly over those slots puts 1 / (n + 1) on <s>: a head whose output falls
    with the number of matches, the way a decoder counts. From the answer loss alone the pre-stage
    counts three to five near chance (0.50-0.55 on count layouts, session 20). With this loss and
    route_targets' in the remix (0.5 each) count ended lower (0.43 vs 0.50, session 21); off in the recipe."""
    singular = {p: s for s, p in plurals.items()}
    out: list[list[int]] = []
    for scene, kind, q, _ in samples:
        if kind != "count":
            out.append([])
            continue
        word = q.split()[2]  # "how many <plural> are there ?" / "how many <colour> objects are there ?"
        match = ((lambda w: w[1] == singular[word]) if word in singular else (lambda w: w[0] == word))
        slots = [2 + j for j, (_, w) in enumerate(item_words(scene)) if w[0] != "box" and match(w)]
        counted = sum(match([o["color"], o["shape"]]) for o in scene["objects"])
        out.append([0] + slots if len(slots) == counted else [])  # [] when two objects share a patch
    return out


COUNT_THRESHOLDS = 5  # "more than k" for k = 0..4: the generator's counts are zero..five


def count_targets(samples) -> torch.Tensor:
    """[N, COUNT_THRESHOLDS] per sample: is the count a count question asks more than k (1.0 / 0.0),
    or -1 for the other kinds. An ordinal target: the answer loss treats "four" and "five" as
    unrelated classes, this one asks for a feature that grows with the number of matches."""
    out = torch.full((len(samples), COUNT_THRESHOLDS), -1.0)
    for i, (_, kind, _, answer) in enumerate(samples):
        if kind == "count":
            n = NUMBERS.index(answer)
            out[i] = (torch.arange(COUNT_THRESHOLDS) < n).float()
    return out


def accuracy_by_kind(out: torch.Tensor, batch: dict) -> dict[str, list[int]]:
    pred = out[torch.arange(out.size(0)), batch["answer_pos"]].argmax(-1)
    acc: dict[str, list[int]] = {}
    for kind, ok in zip(batch["kinds"], (pred == batch["answer"]).tolist()):
        acc.setdefault(kind, []).append(int(ok))
    return acc


def row_length(sample) -> int:
    """The tokens of a sample's collated row (collate): <s> USER:, its items, question, ASSISTANT:, answer, </s>."""
    scene, _, q, a = sample
    return 2 + len(scene_items(scene)) + len(q.split()) + 1 + len(a.split()) + 1


def by_length(samples, groups: int) -> list[list]:
    """samples sorted by row_length and cut into `groups` runs of near-equal size (none empty)."""
    ordered = sorted(samples, key=row_length)
    bounds = np.linspace(0, len(ordered), groups + 1).round().astype(int)
    return [ordered[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]


def step_counts(samples, plurals: dict[str, str], comparator_axis_weights: tuple[float, float], comparing: bool,
                counting: bool, routing: bool, count_routing: bool) -> dict[str, float]:
    """Each loss term's count over a whole batch (pretrain's length groups divide their sums by these):
    answer tokens, the comparator probe's target weight, count-probe targets, routed rows, count-routed rows;
    0 for a term that is off (its flag False), whose targets are then not drawn up."""
    counts = {"answer": float(sum(len(a.split()) + 1 for _, _, _, a in samples)), "comparator": 0.0, "count": 0.0,
              "route": 0.0, "count_route": 0.0}
    if comparing:
        comparator = comparator_targets(samples)
        counts["comparator"] = float(torch.tensor(comparator_axis_weights).expand_as(comparator)[comparator >= 0].sum())
    if counting:
        count = count_targets(samples)
        counts["count"] = float((count >= 0).all(-1).sum() * count.size(-1))
    if routing:
        counts["route"] = float((route_targets(samples) >= 0).sum())
    if count_routing:
        counts["count_route"] = float(sum(bool(c) for c in count_route_targets(samples, plurals)))
    return counts


def step_loss(lm, positions: PositionTable, samples, word_id: dict[str, int], counts: dict[str, float] | None,
              last_rows, probe, count_probe, comparator_weight: float, comparator_layer: int,
              comparator_axis_weights: tuple[float, float], count_weight: float, route_weight: float,
              route_layer: int, route_head: int, count_route_weight: float, count_route_head: int,
              plurals: dict[str, str]) -> torch.Tensor:
    """pretrain's loss on samples: the answer's cross-entropy plus the probes' and routes' terms. counts None:
    each term is its mean over these samples; else (a length group of a batch) its sum divided by
    counts[term], the term's count over the whole batch (step_counts), so that the groups' losses sum to
    the batch's."""
    b = collate(samples, word_id)
    route = route_targets(samples) if route_weight > 0 else None
    counted = count_route_targets(samples, plurals) if count_route_weight > 0 else None
    routed = route is not None and bool((route >= 0).any())
    count_routed = counted is not None and any(counted)
    guide = routed or count_routed
    probing = probe is not None or count_probe is not None
    with last_rows.only(b["labels"]) if last_rows is not None else contextlib.nullcontext():
        res = logits(lm, positions, b, comparator_layer if probing else None, route_layer if guide else None)
    res = res if isinstance(res, tuple) else (res,)
    out, hidden, attention = res[0], res[1] if probing else None, res[-1] if guide else None
    if counts is None:
        loss = torch.nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), b["labels"][:, 1:].flatten(),
                                                 ignore_index=-100)
    else:
        loss = torch.nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), b["labels"][:, 1:].flatten(),
                                                 ignore_index=-100, reduction="sum") / counts["answer"]
    if probe is not None:
        target = comparator_targets(samples)
        asked = target >= 0
        if asked.any():
            weight = torch.tensor(comparator_axis_weights).expand_as(target)[asked]
            bce = torch.nn.functional.binary_cross_entropy_with_logits(probe(hidden)[asked], target[asked],
                                                                       reduction="none")
            loss = loss + comparator_weight * (weight * bce).sum() / (
                weight.sum() if counts is None else counts["comparator"])
    if count_probe is not None:
        target = count_targets(samples)
        asked = (target >= 0).all(-1)
        if asked.any():
            if counts is None:
                loss = loss + count_weight * torch.nn.functional.binary_cross_entropy_with_logits(
                    count_probe(hidden)[asked], target[asked])
            else:
                loss = loss + count_weight * torch.nn.functional.binary_cross_entropy_with_logits(
                    count_probe(hidden)[asked], target[asked], reduction="sum") / counts["count"]
    if routed:
        asked = route >= 0
        mass = attention[asked, route_head, route[asked]]
        if counts is None:
            loss = loss + route_weight * -(mass + 1e-6).log().mean()
        else:
            loss = loss + route_weight * -(mass + 1e-6).log().sum() / counts["route"]
    if count_routed:
        rows = [i for i, slots in enumerate(counted) if slots]
        terms = [-(attention[i, count_route_head, counted[i]] + 1e-6).log().mean() for i in rows]
        if counts is None:
            loss = loss + count_route_weight * torch.stack(terms).mean()
        else:
            loss = loss + count_route_weight * torch.stack(terms).sum() / counts["count_route"]
    return loss


def pretrain(lm, positions: PositionTable, sampler: SymbolicScenes, word_id: dict[str, int], *, steps: int,
             batch: int = 64, lr: float = 1e-3, warmup: int = 50, seed: int = 0, kinds: list[str] | None = None,
             eval_every: int = 250, held: int = 1024, cooldown: int = 0, comparator_weight: float = 0.0,
             comparator_layer: int = 2, comparator_axis_weights: tuple[float, float] = (1.0, 1.0),
             count_weight: float = 0.0, route_weight: float = 0.0, route_layer: int = 2, route_head: int = 0,
             count_route_weight: float = 0.0, count_route_head: int = 2, train_positions: bool = True,
             loss_rows: bool = False, length_groups: int = 1, log=print) -> list[dict]:
    """Trains lm (LlamaModel, tied head) and positions on symbolic scenes; returns the log entries.

    Constant learning rate after the warmup: the routing forms abruptly (a phase transition) and a
    decaying rate would slow the later kinds; `cooldown` > 0 lowers it linearly to 10 % over the
    last `cooldown` steps. Held-out: first-answer-token accuracy per kind on
    `held` fixed samples (their own seed, disjoint stream).

    comparator_weight > 0: a linear probe on layer `comparator_layer`'s output at the answer
    position learns comparator_targets of the relation questions (BCE, this weight); the probe is a
    training aid and is dropped. comparator_axis_weights weigh its horizontal and vertical targets
    (a weighted mean over the asked ones): the axis weighted up forms first (session 18).

    count_weight > 0: a second probe on the same layer and position learns count_targets of the
    count questions (ordinal: one BCE per threshold "more than k", k = 0..4; this weight).

    route_weight > 0: head `route_head` of layer `route_layer` learns to attend from the answer
    position to the box a two-box digit question asks about (route_targets; -log of that attention,
    this weight). Needs lm in eager attention (the probabilities are not materialised otherwise).
    count_route_weight > 0: the same for head `count_route_head` of that layer on count questions,
    towards an even spread over <s> and the objects counted (count_route_targets; cross-entropy).

    train_positions False: positions' learned tables stay as they are (no gradient, not in the
    optimizer) -- for a phase whose questions never ask where an object is.

    loss_rows: the last layer runs on the rows the answer loss reads only (decoder_rows.LossRows:
    the same loss and gradients up to summation order, ~20 % less a step); the probes and route
    losses must then read an earlier layer.

    length_groups > 1: each step's samples, sorted by length, run as that many groups, each collated to its
    own longest row (two groups: ~13 % fewer token slots a batch of the main mix), every loss term divided
    by its count over the whole batch and the groups' gradients summed: the same loss and gradients up to
    summation order (step_loss)."""
    kinds = kinds or KINDS
    last = len(lm.layers) - 1
    if loss_rows and ((comparator_weight > 0 or count_weight > 0) and comparator_layer > last
                      or (route_weight > 0 or count_route_weight > 0) and route_layer >= last):
        raise ValueError(f"decoder pre-stage: with loss_rows the probes and routes read layers before the last "
                         f"(hidden states <= {last}, attentions < {last}); got comparator_layer {comparator_layer}, "
                         f"route_layer {route_layer}")
    last_rows = decoder_rows.LossRows(lm) if loss_rows else None
    positions.requires_grad_(train_positions)
    params = list(lm.parameters()) + (list(positions.parameters()) if train_positions else [])
    probe = count_probe = None
    if comparator_weight > 0:
        probe = torch.nn.Linear(lm.config.hidden_size, 2)
        params += list(probe.parameters())
    if count_weight > 0:
        count_probe = torch.nn.Linear(lm.config.hidden_size, COUNT_THRESHOLDS)
        params += list(count_probe.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    held_rng, rng = np.random.default_rng(10_000 + seed), np.random.default_rng(seed)
    held_set = [sampler.sample(held_rng, kinds) for _ in range(held)]
    entries, t0 = [], time.time()

    def evaluate() -> dict:
        lm.eval()
        acc: dict[str, list[int]] = {}
        with torch.no_grad():
            for i in range(0, len(held_set), 256):
                chunk = held_set[i:i + 256]
                b = collate(chunk, word_id)
                for k, v in accuracy_by_kind(logits(lm, positions, b), b).items():
                    if k == "digit":  # the two-box forms apart as well (not in held_overall)
                        two = [len(sc["boxes"]) == 2 for sc, kind, _, _ in chunk if kind == "digit"]
                        acc.setdefault("digit_two_box", []).extend(x for x, t in zip(v, two) if t)
                    acc.setdefault(k, []).extend(v)
        lm.train()
        flat = [x for k, v in acc.items() if k != "digit_two_box" for x in v]
        return {"held_overall": round(float(np.mean(flat)), 3) if flat else None,
                "by_kind": {k: round(float(np.mean(v)), 2) for k, v in sorted(acc.items())}}

    lm.train()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / warmup)
            if step >= steps - cooldown:
                g["lr"] *= 1.0 - 0.9 * (step - (steps - cooldown) + 1) / cooldown
        samples = [sampler.sample(rng, kinds) for _ in range(batch)]
        groups = by_length(samples, length_groups) if length_groups > 1 else [samples]
        counts = step_counts(samples, sampler.plurals, comparator_axis_weights, probe is not None,
                             count_probe is not None, route_weight > 0, count_route_weight > 0) \
            if length_groups > 1 else None
        opt.zero_grad(set_to_none=True)
        loss = torch.zeros(())
        for group in groups:  # the groups' gradients add up
            part = step_loss(lm, positions, group, word_id, counts, last_rows, probe, count_probe, comparator_weight,
                             comparator_layer, comparator_axis_weights, count_weight, route_weight, route_layer,
                             route_head, count_route_weight, count_route_head, sampler.plurals)
            if not torch.isfinite(part):
                raise RuntimeError(f"decoder pre-stage: non-finite loss at step {step}")
            part.backward()
            loss = loss + part.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if (step % eval_every == 0 and step > 0) or step == steps - 1:
            entry = {"prestage_step": step, "loss": round(float(loss.detach()), 4), "s": round(time.time() - t0, 1),
                     **evaluate()}
            entries.append(entry)
            log(json.dumps(entry))
    opt.zero_grad(set_to_none=True)
    positions.requires_grad_(True)
    if last_rows is not None:
        last_rows.restore()
    return entries


def aligned_targets(scenes: list[dict], items, embed_weight: torch.Tensor, position_table: torch.Tensor,
                    word_id: dict[str, int], shapes: list[str], colors: list[str],
                    positions: PositionTable | None = None) -> torch.Tensor:
    """[B, GRID*GRID, hidden] features the pre-trained decoder reads: every patch its position
    vector, plus on an object's patches the embeddings of its colour, shape and size words and on a
    digit box's patches those of "box" and its digit word (as the symbolic image tokens).

    items: train_builtin.pooled_targets(scenes, ...) -- (sample, patch mask, head, label); its
    items whose head is one of TAGS add that tag's rotated word where positions uses the tag."""
    out = position_table.detach().unsqueeze(0).repeat(len(scenes), 1, 1)
    words = {"shape": shapes, "color": colors, "size": ["small", "large"], "digit": NUMBERS}
    e = embed_weight.detach()
    tags = {t: positions.tag_word_table(e, t) for t in positions.tag_words} if positions is not None else {}
    # Every vector an item can add, as rows of one table: the word embeddings, then each tag's rotated words.
    offsets, table = {}, [e]
    for t, words_of_tag in tags.items():
        offsets[t] = sum(x.size(0) for x in table)
        table.append(words_of_tag)
    table = torch.cat(table).to(out.dtype)
    # (flat patch index, table row) per addition, in the items' order. One index_add_ then adds them
    # patch by patch in that order, the same float sums as one masked add per item and word, bit for bit
    # (session 37: 0.014 -> 0.004 s a batch of 64 on one thread, ~2 % of a vision-stage step).
    flat, rows = [], []
    patches = out.size(1)
    for b, mask, head, label in items:
        if head in TAGS:
            adds = [offsets[head] + label] if head in tags else []
        else:
            adds = [word_id[words[head][label]]] + ([word_id["box"]] if head == "digit" else [])
        where = np.flatnonzero(mask) + b * patches
        for row in adds:
            flat.append(where)
            rows.append(np.full(where.size, row))
    if flat:
        source = table[torch.from_numpy(np.concatenate(rows))]
        out.view(-1, out.size(-1)).index_add_(0, torch.from_numpy(np.concatenate(flat)), source)
    return out


def alignment_loss(features: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error relative to the targets' mean squared norm (scale-free). weights [B, P], if
    given: both means weighted per patch (train_builtin.kept_patches: the kept patches standing in for all)."""
    if weights is None:
        return ((features - target) ** 2).sum(-1).mean() / (target ** 2).sum(-1).mean().clamp_min(1e-8)
    weights = weights.to(features.dtype)
    return (((features - target) ** 2).sum(-1) * weights).sum() / ((target ** 2).sum(-1) * weights).sum().clamp_min(1e-8)


# How item_means sums (train_builtin.py --item-means): "gather" copies each row's sample out of the
# features, [R, GRID*GRID, hidden], and reduces it -- how the models up to session 45's were trained;
# "segment" lays the rows' weights out per sample, [B, rows of the busiest sample, GRID*GRID], and
# multiplies them into the features in one batched matmul. The same means, summed in another order
# (they differ in the last bits); ~10x less time with the backward (scripts/bench/item_means.py, 680
# rows of a batch of 64: 0.053 -> 0.006 s at hidden 128, 0.107 -> 0.010 s at 256): the gather's copy
# and its scatter-add backward were a fifth of a vision-stage step. train_builtin.py keeps "gather" as
# its default: on the default seed "segment" missed the digit target (session 46; seed 1 met it).
ITEM_MEANS_KERNELS = ("gather", "segment")
item_means_kernel = "gather"


def item_means(feats: torch.Tensor, rows) -> torch.Tensor:
    """[R, hidden]: per row (sample index, [GRID*GRID] bool patch mask, label) the mean of that
    sample's feats [B, GRID*GRID, hidden] over the mask's patches (item_means_kernel says how)."""
    masks = np.stack([m for _, m, _ in rows]).astype(np.float32)  # [R, P]
    masks /= np.maximum(masks.sum(1, keepdims=True), 1.0)
    sample = np.fromiter((b for b, _, _ in rows), dtype=np.int64, count=len(rows))
    if item_means_kernel == "gather":
        return torch.einsum("rp,rph->rh", torch.from_numpy(masks), feats[torch.from_numpy(sample)])
    if item_means_kernel != "segment":
        raise ValueError(f"item_means_kernel: expected one of {ITEM_MEANS_KERNELS}, got {item_means_kernel!r}")
    # Row r's weights go to slot[r] of its sample: the how-many-th row of that sample it is.
    slot = np.empty(len(rows), dtype=np.int64)
    seen = np.zeros(feats.size(0), dtype=np.int64)
    for r, b in enumerate(sample):
        slot[r] = seen[b]
        seen[b] += 1
    weights = np.zeros((feats.size(0), max(int(seen.max(initial=0)), 1), feats.size(1)), dtype=np.float32)
    weights[sample, slot] = masks
    means = torch.bmm(torch.from_numpy(weights).to(feats.dtype), feats)  # [B, slots, hidden]
    return means[torch.from_numpy(sample), torch.from_numpy(slot)]


# Logit scale of the readout: word embeddings have norm ~1 after the pre-stage, so plain dot
# products differ by ~0.1-1 between words and the loss could only fall by growing the features
# away from the aligned targets (session 11: digit logits spread 0.12, loss stuck at chance).
READOUT_SCALE = 10.0


def readout_loss(projected: torch.Tensor, items, embed_weight: torch.Tensor, word_id: dict[str, int],
                 shapes: list[str], colors: list[str], positions: PositionTable | None = None) -> torch.Tensor:
    """Cross-entropy of reading each object's colour, shape and size word and each box's digit word
    out of the mean of its projected patch features [B, GRID*GRID, hidden] through the decoder's
    (tied, frozen here) embeddings, among the words of that attribute: the read the pre-staged
    decoder does with attention on the item and its tied head.

    The alignment loss is a mean over all patches, ~90 % background, and measures the whole vector;
    this one weighs every item equally and only the component that tells its words apart.
    With positions' item tags, also each item's tags among their rotated words."""
    words = {"shape": shapes, "color": colors, "size": ["small", "large"], "digit": NUMBERS}
    e = embed_weight.detach()
    tables = {head: e[torch.tensor([word_id[w] for w in vocab])] for head, vocab in words.items()}
    if positions is not None:
        tables.update({t: positions.tag_word_table(e, t) for t in positions.tag_words})
    terms = []
    for head, table in tables.items():
        rows = [(b, m, y) for b, m, h, y in items if h == head]
        if not rows:
            continue
        logits = READOUT_SCALE * item_means(projected, rows) @ table.T
        terms.append(torch.nn.functional.cross_entropy(logits, torch.tensor([y for _, _, y in rows])))
    return torch.stack(terms).mean() if terms else projected.new_zeros(())
