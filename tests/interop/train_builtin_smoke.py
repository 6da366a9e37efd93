#!/usr/bin/env python3
"""scripts/train_builtin.py end to end at toy size: what it writes loads everywhere.

    VLMOPT_BIN=build/apps/vlmopt/vlmopt python tests/interop/train_builtin_smoke.py

The real run takes about half an hour, so nothing else exercises the script. This
trains 2 steps at batch 4 (after a 2-step decoder pre-stage on symbolic scenes and
a 2-step pooled vision stage, on a pack of its own, with the projector alignment and
readout losses) and checks that
  - the checkpoint lands in an --out whose parent does not exist yet, with the
    files the C++ loader and transformers need and a training log that says
    how many steps ran,
  - `vlmopt eval` answers with it and transformers' LlavaForConditionalGeneration
    and AutoProcessor load it,
  - the run is reproducible from the seed: a second run writes byte-identical
    weights, and takes both first stages from the cache the first one wrote in --work;
    so does a third that takes only the pre-stage from the cache (its probes draw from
    torch's RNG, and the vision stage's heads are initialised after it) and reads each
    batch's rows from HDF5 (--no-pack-in-memory) under glibc's malloc,
  - the packs held in RAM give the rows HDF5 gives, as copies,
  - the questions the script derives from a scene's layout (the pre-stage's and the
    joint stage's extra turns) answer the generator's own question of every calibration
    scene they cover the same way, and cover nearly all of them (exist: 3 in 4),
  - the pre-stage's count and binding layouts answer as its question list does, one token per object,
  - the pre-stage's comparator targets agree with every relation question's answer, and its
    count targets are the ordinal code of every count question's answer,
  - the checkpoint holds float32 weights whatever --precision the stages trained under,
  - --align-object-centres puts each object on its centre patch alone (--align-box-centres: each
    digit box on the patch of its pre-stage token),
  - the pre-stage's route targets point at the box a two-box digit question asks about, and
    its count route targets at <s> and the objects a count question counts,
  - --joint-question-scenes draws each type's scenes from exactly the pack's questions of that type,
  - --prestage-generator-boxes draws the left/right box layout where the generator puts it: every
    such calibration scene's box centres lie within the sampler's range, the sampler's left box is
    always left of its right box, and its questions answer "left box" / "right box" accordingly,
  - --vision-early-shape-layer trains and reports its early shape head in the first stage's log,
  - a pre-stage phase gate (--prestage-first-until) met on the first try changes nothing, and one
    never met starts the phase over from its starting weights --prestage-retries times;
    --prestage-relation-until gates each relation phase,
  - --prestage-digit-kinds reaches the digit phase (one phase draws exactly the kinds it lists), and
    --prestage-next-to-steps adds a phase,
  - --digit-augment redraws the ink inside the digit boxes only (the box borders, the objects and
    the background stay byte for byte), keeps most of it inside the box, and strength 0 changes nothing,
  - --vision-extra-boxes pastes donor boxes pixel for pixel into free spots (clear of objects and
    boxes, inside the canvas), lists them in the scene, and changes nothing else,
  - the item tags (--count-tags, --digit-tags) answer the count and two-box digit questions they
    stand for, on calibration scenes and on the pre-stage's symbolic ones, and the tagged pre-stage
    steps are deterministic on 2 threads at the builtin decoder's size.
Exits 1 with one line per failure.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS, BATCH = 2, 4
VISION_PACK = 16  # the first 16 scenes of builtin:train: a digit question (sample 6), a count question (sample 15)
# The generator's attribute words in its order (`vlmopt datasets vocab`).
SHAPES = ["circle", "square", "triangle", "star", "cross"]
COLORS = ["red", "green", "blue", "yellow", "orange", "purple"]


def train(vlmopt: str, out: Path, work: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "train_builtin.py"), "--vlmopt", vlmopt, "--out", str(out),
           "--work", str(work), "--steps", str(STEPS), "--batch", str(BATCH), "--threads", "1",
           "--vision-steps", "2", "--vision-batch", "4", "--vision-objective", "pooled", "--eval-every", "1000",
           "--decoder-prestage-steps", "2", "--decoder-prestage-batch", "4", "--align-weight", "1",
           "--readout-weight", "1", "--vision-pack", str(VISION_PACK), "--prestage-position-first", "2",
           "--joint-digit-scenes", "1", "--joint-digit-turns-first", "--joint-question-scenes", "count=1",
           "--align-object-centres", "--align-box-centres", "--prestage-route-weight", "0.5",
           "--prestage-count-route-weight", "0.5", "--prestage-binding-route-weight", "0.5",
           "--prestage-binding-early", "--prestage-binding-kinds", "color,color,exist,relation",
           "--prestage-binding-freeze-positions",
           "--prestage-relation-schedule", "h1,v1,all1", "--prestage-digit-steps", "1", "--prestage-binding-steps", "1",
           "--prestage-remix-steps", "1", "--prestage-relation-until", "relation=1.0", "--prestage-retries", "1",
           "--prestage-relation-lr", "5e-4",
           "--count-tags", "--digit-tags", "--count-tag-steps", "1", "--count-tag-remix-steps", "1",
           "--prestage-next-to-steps", "1",
           "--vision-count-scenes", "1", "--digit-augment", "1.0", "--prestage-generator-boxes",
           "--prestage-digit-kinds", "digit,relation", "--vision-count-weight", "2",
           "--vision-early-shape-layer", "1", "--vision-ema", "0.9", "--vision-extra-boxes", "1",
           "--joint-tower-lr-scale", "0.5", "--item-means", "segment", "--vision-patch-keep", "1",
           "--vision-patch-groups", "2", "--decoder-loss-rows", *extra]
    return subprocess.run(cmd, capture_output=True, text=True)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def derived_question_parity(calib_h5: Path) -> list[str]:
    """decoder_prestage's question list over each pack scene vs the generator's own question."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import numpy as np
    import decoder_prestage as dp
    import train_builtin as tb
    pack = tb.Pack(calib_h5)
    idx = np.arange(len(pack))
    _, questions, answers, types = pack.batch(idx)
    sampler = dp.SymbolicScenes(SHAPES, COLORS, tb.SHAPE_PLURALS, relation_margin=16, sized_color_singles=True)
    covered: dict[str, list[int]] = {}
    out = []
    for meta, q, a, kind in zip(pack.scenes(idx), questions, answers, types):
        derived = {dq: da for qas in sampler.questions(dp.scene_from_meta(meta)).values() for dq, da in qas}
        covered.setdefault(kind, []).append(int(q in derived))
        if q in derived and derived[q] != a:
            out.append(f"derived question {q!r}: answer {derived[q]!r}, the generator's {a!r}")
    # Not derived: most absent-attribute lures of "exist" (~0.8 of that kind is covered).
    for kind, hits in sorted(covered.items()):
        if sum(hits) < (0.75 if kind == "exist" else 0.95) * len(hits):
            out.append(f"derived questions cover {sum(hits)} of {len(hits)} {kind} questions")
    return out[:5]


def count_layout_parity(draws: int = 600) -> list[str]:
    """decoder_prestage.SymbolicScenes.count_sample (--prestage-count-layouts): its answer is the
    one the sampler's own question list gives for that scene, every object is its own symbolic
    token (distinct patches), and the answers cover zero..five about uniformly."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import numpy as np
    import decoder_prestage as dp
    import train_builtin as tb
    sampler = dp.SymbolicScenes(SHAPES, COLORS, tb.SHAPE_PLURALS, count_layouts=True)
    rng = np.random.default_rng(7)
    out, answers = [], []
    for _ in range(draws):
        scene, kind, q, a = sampler.sample(rng, ["count"])
        listed = dict(sampler.questions(scene)["count"])
        if kind != "count" or listed.get(q) != a:
            out.append(f"count layout {q!r}: answer {a!r}, the question list's {listed.get(q)!r}")
        if len(dp.item_words(scene)) != len(scene["objects"]):
            out.append(f"count layout {q!r}: {len(scene['objects'])} objects on {len(dp.item_words(scene))} patches")
        answers.append(a)
    for n in dp.NUMBERS[:6]:
        if not 0.5 / 6 * draws <= answers.count(n) <= 1.5 / 6 * draws:
            out.append(f"count layouts answer {n!r} {answers.count(n)} times in {draws}")
    return out[:5]


def binding_layout_parity(draws: int = 600) -> list[str]:
    """decoder_prestage.SymbolicScenes.binding_sample (--prestage-binding-steps): every colour answer
    is the colour of the one object the question names (by shape, or by size and shape), every
    exist answer says whether an object of that colour and shape is there, every object is its own
    symbolic token, half the colour draws name the size of a same-shape pair of different sizes, the
    lured "no" shares an attribute with an object, and sample() draws these layouts when asked to."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import numpy as np
    import decoder_prestage as dp
    import train_builtin as tb
    sampler = dp.SymbolicScenes(SHAPES, COLORS, tb.SHAPE_PLURALS, count_layouts=True, binding_layouts=True)
    rng = np.random.default_rng(11)
    out, pairs, colour, lured, no = [], 0, 0, 0, 0
    for i in range(draws):
        drawn = sampler.binding_sample(rng, ["color", "exist"][i % 2])
        if drawn is None:
            continue
        scene, kind, q, a = drawn
        objs, words = scene["objects"], q.split()
        if kind == "color":
            colour += 1
            named = [o for o in objs if o["shape"] == words[-2] and (len(words) == 6 or o["size"] == words[4])]
            same = [o for o in objs if o["shape"] == words[-2]]
            pairs += len(same) == 2 and same[0]["size"] != same[1]["size"]
            truth = named[0]["color"] if len(named) == 1 else None
        else:
            truth = "yes" if any((o["color"], o["shape"]) == (words[3], words[4]) for o in objs) else "no"
            if truth == "no":
                no += 1
                lured += any(o["color"] == words[3] or o["shape"] == words[4] for o in objs)
        if truth != a:
            out.append(f"binding layout {q!r}: answer {a!r}, the scene's {truth!r}")
        if len(dp.item_words(scene)) != len(objs):
            out.append(f"binding layout {q!r}: {len(objs)} objects on {len(dp.item_words(scene))} patches")
    if not 0.4 * colour <= pairs <= 0.6 * colour:
        out.append(f"binding layouts: {pairs} sized pairs in {colour} colour draws, expected about half")
    if lured < 0.6 * no:
        out.append(f"binding layouts: {lured} of {no} 'no' exist draws lured")
    sized = [sampler.sample(rng, ["color"])[2].split() for _ in range(200)]
    if sum(len(w) == 7 for w in sized) < 0.5 * len(sized):
        out.append(f"sample() with binding_layouts: {sum(len(w) == 7 for w in sized)} of 200 colour questions sized")
    return out[:5]


def comparator_parity(draws: int = 400) -> list[str]:
    """decoder_prestage.comparator_targets (the pre-stage's probe on relation questions): on the axis
    a relation question asks, the comparison XOR the word's polarity is the answer, for each of the
    four words; other kinds get no target."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import numpy as np
    import decoder_prestage as dp
    import train_builtin as tb
    sampler = dp.SymbolicScenes(SHAPES, COLORS, tb.SHAPE_PLURALS)
    rng = np.random.default_rng(11)
    samples = [sampler.sample(rng, ["relation"]) for _ in range(draws)] + [sampler.sample(rng, ["position"])]
    targets = dp.comparator_targets(samples)
    # word -> (axis, the target value that means "yes")
    words = {"left of": (0, 1.0), "right of": (0, 0.0), "above": (1, 1.0), "below": (1, 0.0)}
    out, seen = [], set()
    for (_, kind, q, a), t in zip(samples, targets.tolist()):
        if kind != "relation":
            if t != [-1.0, -1.0]:
                out.append(f"comparator target {t} for a {kind} question")
            continue
        word = next(w for w in words if f" {w} the " in q)
        axis, yes = words[word]
        seen.add(word)
        if t[axis] < 0 or (t[axis] == yes) != (a == "yes"):
            out.append(f"comparator target {t} for {q!r} (answer {a!r})")
    if seen != set(words):
        out.append(f"relation words drawn: {sorted(seen)}")
    return out[:5]


def route_parity(draws: int = 300) -> list[str]:
    """decoder_prestage.route_targets (--prestage-route-weight): a two-box digit question ("in the
    left / right box", "next to the X") points at the sequence slot of the box it asks about -- the
    left or right one of the two, the one beside the named object --, a sized colour question ("the
    large X") at the object it names, and every other question at none; count_route_targets
    (--prestage-count-route-weight) point a count question at <s> and exactly the objects it counts;
    logits(attention_layer=) gives one attention row per head from the answer position."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import numpy as np
    import torch
    import decoder_prestage as dp
    import train_builtin as tb
    from transformers import LlamaConfig, LlamaModel
    sampler = dp.SymbolicScenes(SHAPES, COLORS, tb.SHAPE_PLURALS, next_to=True)
    rng = np.random.default_rng(19)
    samples = [sampler.sample(rng, ["digit"]) for _ in range(draws)] + [sampler.sample(rng, ["color"])]
    binding = dp.SymbolicScenes(SHAPES, COLORS, tb.SHAPE_PLURALS, binding_layouts=True)
    samples += [binding.sample(rng, ["color"]) for _ in range(40)]
    counts = [sampler.sample(rng, ["count"]) for _ in range(200)]
    sampler_layouts = dp.SymbolicScenes(SHAPES, COLORS, tb.SHAPE_PLURALS, count_layouts=True)
    counts += [sampler_layouts.sample(rng, ["count"]) for _ in range(200)]
    words = ["<s>", "USER:", "ASSISTANT:", "</s>", "<pad>", "box", "left", "right", "top", "bottom"] + dp.NUMBERS
    words += ["small", "large"] + SHAPES + COLORS
    words += sorted({w for _, _, q, a in samples + counts for w in (q + " " + a).split()} - set(words))
    word_id = {w: i for i, w in enumerate(words)}
    batch = dp.collate(samples, word_id)
    slots = {(int(b), int(t)): [words[i] for i in w.tolist() if i >= 0]
             for b, t, w in zip(batch["img_b"], batch["img_t"], batch["img_words"])}
    out, forms = [], set()
    for i, ((scene, kind, q, a), t) in enumerate(zip(samples, dp.route_targets(samples).tolist())):
        two = kind == "digit" and len(scene["boxes"]) == 2
        if kind == "color" and len(q.split()) == 7:  # "what color is the <size> <shape> ?"
            forms.add("sized colour")
            named = [a, q.split()[5], q.split()[4]]
            if slots.get((i, t)) != named:
                out.append(f"route target of {q!r} holds {slots.get((i, t))}, expected {named}")
            continue
        if not two:
            if t != -1:
                out.append(f"route target {t} for {q!r} (one box or not a digit question)")
            continue
        if t < 0:
            continue  # the box shares its patch with an earlier item: no slot of its own
        if slots.get((i, t)) != ["box", a]:
            out.append(f"route target of {q!r} holds {slots.get((i, t))}, expected ['box', {a!r}]")
        boxes = sorted(scene["boxes"], key=lambda bx: bx["cx"])
        box = next(bx for bx in scene["boxes"] if dp.NUMBERS[bx["label"]] == a)
        if "left box" in q or "right box" in q:
            forms.add("left/right")
            if box is not boxes[0 if "left box" in q else 1]:
                out.append(f"route target of {q!r} is not the {'left' if 'left box' in q else 'right'} box")
        elif "next to" in q:
            forms.add("next to")
            anchor = scene["objects"][box["anchor"]]
            if f"the {anchor['color']} {anchor['shape']} ?" not in q:
                out.append(f"route target of {q!r} is beside the {anchor['color']} {anchor['shape']}")
    if forms != {"left/right", "next to", "sized colour"}:
        out.append(f"routed question forms drawn: {sorted(forms)}")
    # count_route_targets (--prestage-count-route-weight): <s> and exactly the objects counted.
    count_batch = dp.collate(counts, word_id)
    count_slots = {(int(b), int(t)): [words[i] for i in w.tolist() if i >= 0]
                   for b, t, w in zip(count_batch["img_b"], count_batch["img_t"], count_batch["img_words"])}
    singular = {p: s for s, p in tb.SHAPE_PLURALS.items()}
    for i, ((_, _, q, a), slots) in enumerate(zip(counts, dp.count_route_targets(counts, tb.SHAPE_PLURALS))):
        word = q.split()[2]
        scene = counts[i][0]
        if not slots and i < 200 and len(dp.item_words(scene)) < len(scene["objects"]) + len(scene["boxes"]):
            continue  # a random scene with two items on one patch: no target
        if not slots or slots[0] != 0 or len(slots) - 1 != dp.NUMBERS.index(a):
            out.append(f"count route of {q!r} (answer {a!r}): slots {slots}")
        elif any((singular.get(word) or word) not in count_slots.get((i, t), []) for t in slots[1:]):
            out.append(f"count route of {q!r}: a slot without {word!r}")
    if any(dp.count_route_targets(samples, tb.SHAPE_PLURALS)):
        out.append("count route targets for digit or colour questions")
    lm = LlamaModel(LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2))
    lm.set_attn_implementation("eager")
    _, attention = dp.logits(lm, dp.PositionTable(32), batch, attention_layer=1)
    if attention.shape != (len(samples), 4, batch["ids"].shape[1]):
        out.append(f"route attention shape {tuple(attention.shape)}")
    elif not torch.allclose(attention.sum(-1), torch.ones(len(samples), 4), atol=1e-5):
        out.append("route attention rows do not sum to 1")
    return out[:5]


def count_target_parity(draws: int = 300) -> list[str]:
    """decoder_prestage.count_targets (the pre-stage's ordinal count probe): a count question's
    targets say "more than k" exactly for k below its answer; other kinds get none."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import numpy as np
    import decoder_prestage as dp
    import train_builtin as tb
    sampler = dp.SymbolicScenes(SHAPES, COLORS, tb.SHAPE_PLURALS, count_layouts=True)
    rng = np.random.default_rng(17)
    samples = [sampler.sample(rng, ["count"]) for _ in range(draws)] + [sampler.sample(rng, ["color"])]
    out = []
    for (_, kind, q, a), t in zip(samples, dp.count_targets(samples).tolist()):
        if kind != "count":
            if any(x != -1.0 for x in t):
                out.append(f"count target {t} for a {kind} question")
            continue
        n = dp.NUMBERS.index(a)
        if t != [1.0] * n + [0.0] * (dp.COUNT_THRESHOLDS - n):
            out.append(f"count target {t} for {q!r} (answer {a!r})")
    return out[:5]


def item_tag_parity(calib_h5: Path, draws: int = 400) -> list[str]:
    """The item tags (--count-tags, --digit-tags) answer the questions they stand for: on the
    generator's own calibration scenes (train_builtin.pooled_targets, the vision stage's targets) and
    on the pre-stage's symbolic scenes (decoder_prestage.scene_items, what its tokens carry), every
    object a count question counts has that count as its tag, the object a "next to" question names
    has the asked box's digit, and the box a "left / right box" question names has that side. Every
    tag is drawn on both, and none is given with the tags off."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import numpy as np
    import decoder_prestage as dp
    import train_builtin as tb
    singular = {p: s for s, p in tb.SHAPE_PLURALS.items()}
    out, seen = [], set()

    def check(q: str, a: str, objects: list[tuple[dict, dict]], boxes: list[tuple[int, dict]], where: str) -> None:
        """objects: (object, {tag: word index}); boxes: (label, {tag: word index})."""
        words = q.split()
        if q.startswith("how many "):
            word = words[2]
            counted = [t for o, t in objects if (o["shape"] == singular[word] if word in singular else o["color"] == word)]
            tag = "count_shape" if word in singular else "count_color"
            seen.add(tag) if counted else None
            if any(t.get(tag) != dp.NUMBERS.index(a) for t in counted):
                out.append(f"{where}: {q!r} (answer {a!r}): {tag} tags {[t.get(tag) for t in counted]}")
        elif " next to the " in q:
            named = [t for o, t in objects if f"{o['color']} {o['shape']}" == " ".join(words[-3:-1])]
            seen.add("next_digit")
            if len(named) != 1 or named[0].get("next_digit") != dp.NUMBERS.index(a):
                out.append(f"{where}: {q!r} (answer {a!r}): next_digit tags {[t.get('next_digit') for t in named]}")
        elif q.endswith(" box ?") and words[-3] in ("left", "right"):
            side = 0 if words[-3] == "left" else 1
            named = [label for label, t in boxes if t.get("box_side") == side]
            seen.add("box_side")
            if named != [dp.NUMBERS.index(a)]:
                out.append(f"{where}: {q!r} (answer {a!r}): boxes tagged {words[-3]} hold {named}")

    pack = tb.Pack(calib_h5)
    idx = np.arange(len(pack))
    _, questions, answers, _ = pack.batch(idx)
    scenes = pack.scenes(idx)
    items = tb.pooled_targets(scenes, SHAPES, COLORS, tags=dp.TAGS)
    for b, (sc, q, a) in enumerate(zip(scenes, questions, answers)):
        mine = [it for it in items if it[0] == b]
        # pooled_targets lists an object's items (shape, colour, size, its tags), then a box's (digit, its tags).
        objects, boxes, k = [], [], 0
        for o in sc.get("objects", []):
            k += 3
            tags = {}
            while k < len(mine) and mine[k][2] in dp.TAGS:
                tags[mine[k][2]] = mine[k][3]
                k += 1
            objects.append((o, tags))
        while k < len(mine):
            label, k, tags = mine[k][3], k + 1, {}
            while k < len(mine) and mine[k][2] in dp.TAGS:
                tags[mine[k][2]] = mine[k][3]
                k += 1
            boxes.append((label, tags))
        check(q, a, objects, boxes, f"calibration scene {b}")
    if any(h in dp.TAGS for _, _, h, _ in tb.pooled_targets(scenes, SHAPES, COLORS)):
        out.append("pooled_targets gives item tags with the tags off")
    missing = set(dp.TAGS) - seen
    seen.clear()
    sampler = dp.SymbolicScenes(SHAPES, COLORS, tb.SHAPE_PLURALS, next_to=True, count_layouts=True)
    rng = np.random.default_rng(23)
    for i in range(draws):
        scene, _, q, a = sampler.sample(rng, ["count", "digit"])
        if len(dp.scene_items(scene)) < len(scene["objects"]) + len(scene["boxes"]):
            continue  # two items on one patch: one token lost
        by_patch = {p: tags for p, _, tags in dp.scene_items(scene)}
        patch = lambda x: dp.patch_index(x["cx"], x["cy"])
        as_dict = lambda tags: {t: v for t, v in zip(dp.TAGS, tags) if v != dp.NO_TAG}
        check(q, a, [(o, as_dict(by_patch[patch(o)])) for o in scene["objects"]],
              [(bx["label"], as_dict(by_patch[patch(bx)])) for bx in scene["boxes"]], f"symbolic draw {i}")
    missing |= set(dp.TAGS) - seen
    if missing:
        out.append(f"item tags never checked: {sorted(missing)}")
    return out[:5]


def tag_phase_determinism(steps: int = 10) -> list[str]:
    """The pre-stage's tagged phases (--count-tags) give the same weights twice from one seed on 2
    threads, at the builtin decoder's size. Gathering the tag words by indexing made the backward sum
    into the embedding rows in a varying order (session 25: weights 1e-7 apart after 10 steps, which
    the last full-mix phase amplified into a 0.2 swing of relation); the smoke runs above use 1 thread
    and small sizes, where that does not show."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import torch
    import decoder_prestage as dp
    import train_builtin as tb
    from transformers import LlamaConfig, LlamaModel
    sampler = dp.SymbolicScenes(SHAPES, COLORS, tb.SHAPE_PLURALS, count_layouts=True)
    words = ["<pad>", "<s>", "</s>", "USER:", "ASSISTANT:", "how", "many", "objects", "are", "there", "?"]
    words += dp.NUMBERS + SHAPES + COLORS + list(tb.SHAPE_PLURALS.values()) + ["small", "large", "left", "right"]
    word_id = {w: i for i, w in enumerate(words)}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)

    def run() -> torch.Tensor:
        torch.manual_seed(0)
        lm = LlamaModel(LlamaConfig(vocab_size=len(words), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                    num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True))
        lm.set_attn_implementation("eager")
        positions = dp.PositionTable(256, None, {t: [word_id[w] for w in dp.TAG_WORDS[t]]
                                                 for t in ("count_color", "count_shape")})
        dp.pretrain(lm, positions, sampler, word_id, steps=steps, kinds=["count"], held=64, eval_every=10**6,
                    log=lambda *_: None)
        return torch.cat([p.detach().flatten() for p in list(lm.parameters()) + list(positions.parameters())])

    try:
        first, second = run(), run()
    finally:
        torch.set_num_threads(threads)
    if not torch.equal(first, second):
        return [f"tagged pre-stage steps on 2 threads: same seed, weights up to {float((first - second).abs().max()):.3g} apart"]
    return []


def frozen_positions(steps: int = 3) -> list[str]:
    """pretrain(train_positions=False) (--prestage-binding-freeze-positions): the binding phase's
    draws and losses (colour, exist and relation on the binding layouts, the route loss and the
    comparator probe) move the decoder and leave the position table's row and column embeddings
    exactly as they were; afterwards the table trains again."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import numpy as np
    import torch
    import decoder_prestage as dp
    import train_builtin as tb
    from transformers import LlamaConfig, LlamaModel
    sampler = dp.SymbolicScenes(SHAPES, COLORS, tb.SHAPE_PLURALS, binding_layouts=True)
    rng, kinds = np.random.default_rng(0), ["color", "exist", "relation"]
    drawn = set()
    for _ in range(2000):
        scene, _, q, a = sampler.sample(rng, kinds)
        drawn.update((q + " " + a).split(), *(w for _, w in dp.item_words(scene)))
    words = ["<pad>", "<s>", "</s>", "USER:", "ASSISTANT:", "left", "right", "top", "bottom"] + sorted(drawn)
    word_id = {w: i for i, w in enumerate(dict.fromkeys(words))}
    torch.manual_seed(0)
    lm = LlamaModel(LlamaConfig(vocab_size=len(word_id), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    lm.set_attn_implementation("eager")  # the route loss reads attention probabilities
    positions = dp.PositionTable(64)
    table, decoder = positions.table().detach().clone(), lm.layers[0].mlp.up_proj.weight.detach().clone()
    dp.pretrain(lm, positions, sampler, word_id, steps=steps, batch=8, kinds=kinds, held=8,
                eval_every=10**6, route_weight=1.0, comparator_weight=0.2, train_positions=False,
                log=lambda *_: None)
    out = []
    if not torch.equal(table, positions.table().detach()):
        out.append("train_positions=False: the position table moved")
    if torch.equal(decoder, lm.layers[0].mlp.up_proj.weight.detach()):
        out.append("train_positions=False: the decoder did not train either")
    if not all(p.requires_grad for p in positions.parameters()):
        out.append("train_positions=False: the position table stayed frozen after the phase")
    dp.pretrain(lm, positions, sampler, word_id, steps=steps, batch=8, kinds=["color", "relation"], held=8,
                eval_every=10**6, log=lambda *_: None)
    if torch.equal(table, positions.table().detach()):
        out.append("after a frozen phase, a phase with train_positions=True left the position table as it was")
    return out


def phase_gate(steps: int = 3) -> list[str]:
    """train_builtin.gated_phase (--prestage-first-until): a gate met on the
    first try computes exactly as no gate; one never met starts the phase over `retries` times from
    the weights it started from, and the last try ends with the weights of that try's draws run
    from that start alone."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import numpy as np
    import torch
    import decoder_prestage as dp
    import train_builtin as tb
    from transformers import LlamaConfig, LlamaModel
    sampler = dp.SymbolicScenes(SHAPES, COLORS, tb.SHAPE_PLURALS)
    rng, drawn = np.random.default_rng(0), set()
    for _ in range(2000):
        scene, _, q, a = sampler.sample(rng, ["size"])
        drawn.update((q + " " + a).split(), *(w for _, w in dp.item_words(scene)))
    word_id = {w: i for i, w in enumerate(dict.fromkeys(["<pad>", "<s>", "</s>", "USER:", "ASSISTANT:"]
                                                        + sorted(drawn)))}

    def run(seed: int, until: dict[str, float] | None, retries: int = 2) -> tuple[torch.Tensor, list[dict], list[str]]:
        torch.manual_seed(0)
        lm = LlamaModel(LlamaConfig(vocab_size=len(word_id), hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    tie_word_embeddings=True))
        positions = dp.PositionTable(32)
        stage = torch.nn.ModuleDict({"decoder": lm, "positions": positions})
        lines: list[str] = []
        train_phase = lambda s: dp.pretrain(lm, positions, sampler, word_id, steps=steps, batch=4, kinds=["size"],
                                            held=8, seed=s, log=lambda *_: None)
        entries = tb.gated_phase(train_phase, stage, seed, until, retries, log=lines.append)
        return torch.cat([p.detach().flatten() for p in stage.parameters()]), entries, lines

    out = []
    plain, plain_log, _ = run(5, None)
    met, met_log, met_lines = run(5, {"size": 0.0})
    if not torch.equal(plain, met) or len(met_log) != len(plain_log) or met_lines:
        out.append("gated_phase: a gate met on the first try changed the phase")
    unmet, unmet_log, unmet_lines = run(5, {"size": 1.01})
    last_alone, _, _ = run(2005, None)
    tries = sorted({e["try"] for e in unmet_log})
    if tries != [0, 1, 2] or len(unmet_lines) != 3 or not torch.equal(unmet, last_alone):
        out.append(f"gated_phase: a gate never met ran tries {tries} and logged {len(unmet_lines)} lines (expected "
                   "[0, 1, 2] and 3), and its weights are "
                   + ("those" if torch.equal(unmet, last_alone) else "not those") + " of the last try's draws alone")
    if torch.equal(unmet, plain):
        out.append("gated_phase: the tries after the first drew as the first")
    return out


def vision_gate(steps: int = 4) -> list[str]:
    """train_builtin.vision_stage_gated (--vision-until): a first try that passes computes exactly as no
    gate; a short try starts the stage over from the weights and torch RNG state it started from, on the
    next attempt's draws, and the last try runs ungated to its end and stands."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import numpy as np
    import torch
    import train_builtin as tb

    def run(short_tries: int, retries: int, only_attempt: int | None = None):
        torch.manual_seed(0)
        stage = torch.nn.ModuleDict({"tower": torch.nn.Linear(6, 3)})
        opt = torch.optim.SGD(stage.parameters(), lr=0.1)

        def train_stage(attempt: int, gate: bool) -> list[dict]:
            rng = np.random.default_rng(attempt)  # the attempt's draws
            log = []
            for step in range(steps):
                x = torch.from_numpy(rng.standard_normal((5, 6))).float() + torch.randn(5, 6)  # both streams
                loss = stage["tower"](x).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                log.append({"vision_step": step})
                if gate and step == 1 and attempt < short_tries:
                    log[-1]["gate_short"] = ["shape"]
                    return log
            return log

        lines: list[str] = []
        if only_attempt is not None:
            entries = train_stage(only_attempt, False)
        else:
            entries = tb.vision_stage_gated(train_stage, stage, retries, log=lines.append)
        return torch.cat([p.detach().flatten() for p in stage.parameters()]), entries, lines

    out = []
    plain, plain_log, _ = run(0, 0, only_attempt=0)
    passed, passed_log, passed_lines = run(0, 1)
    if not torch.equal(plain, passed) or passed_log != plain_log or passed_lines:
        out.append("vision_stage_gated: a first try that passed changed the stage or its log")
    retried, retried_log, retried_lines = run(1, 1)
    alone, _, _ = run(0, 0, only_attempt=1)
    tries = [e["try"] for e in retried_log]
    if tries != [0, 0, 1, 1, 1, 1] or len(retried_lines) != 1 or not torch.equal(retried, alone):
        out.append(f"vision_stage_gated: one short try gave tries {tries} (expected [0, 0, 1, 1, 1, 1]), "
                   f"{len(retried_lines)} log lines (expected 1), and weights "
                   + ("equal" if torch.equal(retried, alone) else "unequal") + " to attempt 1 run from the start alone")
    kept, kept_log, kept_lines = run(5, 2)
    last_alone, _, _ = run(0, 0, only_attempt=2)
    if ([e["try"] for e in kept_log] != [0, 0, 1, 1, 2, 2, 2, 2] or len(kept_lines) != 2
            or not torch.equal(kept, last_alone)):
        out.append("vision_stage_gated: a gate never met did not run two short tries, then the last one to its end")
    return out


def checkpoint_dtypes(model: Path) -> list[str]:
    """Every tensor in the checkpoint is float32 (--precision bf16 autocasts the forward passes only)."""
    from safetensors import safe_open
    with safe_open(model, framework="np") as f:
        wrong = sorted(k for k in f.keys() if f.get_slice(k).get_dtype() != "F32")
    return [f"{model}: tensors not stored as F32: {wrong[:3]}"] if wrong else []


def relation_schedule_draws(draws: int = 500) -> list[str]:
    """--prestage-relation-schedule: each phase kind draws the horizontal words at its share
    (SymbolicScenes.horizontal_share), and a malformed schedule is refused."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import dataclasses
    import numpy as np
    import decoder_prestage as dp
    import train_builtin as tb
    sampler = dp.SymbolicScenes(SHAPES, COLORS, tb.SHAPE_PLURALS)
    out = []
    phases = tb.parse_relation_schedule("h1,v2,all3")
    if [steps for *_, steps in phases] != [1, 2, 3]:
        out.append(f"schedule h1,v2,all3 parsed as {phases}")
    for (share, _, _), expected in zip(phases, (0.8, 0.2, 0.5)):
        rng = np.random.default_rng(13)
        drawn = [dataclasses.replace(sampler, horizontal_share=share).sample(rng, ["relation"]) for _ in range(draws)]
        horizontal = sum(any(f" {w} the " in q for w in dp.HORIZONTAL_WORDS) for _, _, q, _ in drawn) / draws
        if abs(horizontal - expected) > 0.08:
            out.append(f"horizontal share {share}: {horizontal:.2f} of the relation questions ask left of / right of")
    for bad in ("x5", "h", "h0", "v-3"):
        try:
            tb.parse_relation_schedule(bad)
            out.append(f"schedule {bad!r} accepted")
        except SystemExit:
            pass
    return out[:5]


def question_stream_parity(vision_h5: Path) -> list[str]:
    """train_builtin.question_streams (--joint-question-scenes): each type's stream is exactly the
    pack's questions of that type; parse_question_scenes refuses unknown and repeated types."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import numpy as np
    import train_builtin as tb
    pack = tb.Pack(vision_h5)
    types = pack.batch(np.arange(len(pack)))[3]
    out = []
    spec = tb.parse_question_scenes("count=2,digit=1")
    for (n, stream), (kind, want) in zip(tb.question_streams(pack, spec, seed=9), spec.items()):
        expected = sorted(i for i, t in enumerate(types) if t == kind)
        if n != want or sorted(stream.tolist()) != expected:
            out.append(f"question stream {kind}={want}: {n} per step over {len(stream)} scenes, expected {want} "
                       f"over the pack's {len(expected)} {kind} questions, exactly")
    for bad in ("count=1,count=2", "colour=1", "count"):
        try:
            tb.parse_question_scenes(bad)
            out.append(f"parse_question_scenes accepted {bad!r}")
        except SystemExit:
            pass
    return out


def centre_item_parity(calib_h5: Path) -> list[str]:
    """train_builtin.pooled_targets(object_centres=True) (--align-object-centres): every object's
    three items (shape, colour, size) have the one patch holding its centre as mask, a patch of its
    full mask; digit boxes keep their full masks."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import numpy as np
    import train_builtin as tb
    pack = tb.Pack(calib_h5)
    scenes = pack.scenes(np.arange(len(pack)))
    full = tb.pooled_targets(scenes, SHAPES, COLORS)
    centre = tb.pooled_targets(scenes, SHAPES, COLORS, object_centres=True)
    if [(b, h, y) for b, _, h, y in full] != [(b, h, y) for b, _, h, y in centre]:
        return ["pooled_targets: object_centres changed the items, not only their masks"]
    expected = [(b, min(int(o["cy"]) // tb.PATCH, tb.GRID - 1) * tb.GRID + min(int(o["cx"]) // tb.PATCH, tb.GRID - 1))
                for b, sc in enumerate(scenes) for o in sc.get("objects", []) for _ in range(3)]
    objects = [(b, m, mc) for (b, m, h, _), (_, mc, _, _) in zip(full, centre) if h != "digit"]
    out = []
    if len(objects) != len(expected):
        return [f"pooled_targets: {len(objects)} object items, expected {len(expected)}"]
    for (b, m, mc), (_, patch) in zip(objects, expected):
        if mc.sum() != 1 or not mc[patch] or not m[patch]:
            out.append(f"scene {b}: object mask of {int(mc.sum())} patches with object_centres, expected patch {patch}")
    for (b, m, h, _), (_, mc, _, _) in zip(full, centre):
        if h == "digit" and not np.array_equal(m, mc):
            out.append(f"scene {b}: a digit box's mask changed with object_centres")
    # box_centres (--align-box-centres): a box's one patch is the decoder pre-stage's box token,
    # the patch scene_from_meta + item_words put it on, inside its full mask; objects unchanged.
    import decoder_prestage
    boxes = tb.pooled_targets(scenes, SHAPES, COLORS, box_centres=True)
    expected = {}
    for b, sc in enumerate(scenes):
        sym = decoder_prestage.scene_from_meta(sc)
        patch = lambda x, y: min(int(y) // tb.PATCH, tb.GRID - 1) * tb.GRID + min(int(x) // tb.PATCH, tb.GRID - 1)
        expected[b] = [patch(bx["cx"], bx["cy"]) for bx in sym["boxes"]]
    seen = {}
    for (b, m, h, _), (_, mb, _, _) in zip(full, boxes):
        if h != "digit":
            if not np.array_equal(m, mb):
                out.append(f"scene {b}: an object's mask changed with box_centres")
            continue
        k = seen.get(b, 0)
        seen[b] = k + 1
        p = expected[b][k]
        if mb.sum() != 1 or not mb[p] or not m[p]:
            out.append(f"scene {b}: box mask of {int(mb.sum())} patches with box_centres, expected patch {p}")
    if not seen:
        out.append("box_centres: the calibration pack has no digit box to check")
    return out[:5]


def generator_boxes_parity(calib_h5: Path, draws: int = 4000) -> list[str]:
    """decoder_prestage.SymbolicScenes.side_by_side_boxes against the generator's left/right scenes."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import numpy as np
    import decoder_prestage as dp
    import train_builtin as tb
    rng = np.random.default_rng(5)
    drawn = [dp.SymbolicScenes.side_by_side_boxes(rng) for _ in range(draws)]
    out = []
    left = [a["cx"] for a, _ in drawn]
    right = [b["cx"] for _, b in drawn]
    # compose_digit's bounds: sides 26-32, 2 px edges, 6 px apart -> left centres 15-49, right 47-81.
    if not (15 <= min(left) and max(left) <= 49 and 47 <= min(right) and max(right) <= 81):
        out.append(f"generator boxes: centres [{min(left)}, {max(left)}], [{min(right)}, {max(right)}], "
                   "expected within [15, 49], [47, 81]")
    if any(a["cx"] >= b["cx"] or a["label"] == b["label"] for a, b in drawn):
        out.append("generator boxes: a left box not left of the right one, or two boxes of one digit")
    pack = tb.Pack(calib_h5)
    metas = [m for m in pack.scenes(np.arange(len(pack))) if m.get("variant") == "digit_left_right"]
    if not metas:
        return out + ["generator boxes: the calibration pack has no left/right digit scene"]
    for m in metas:
        a, b = sorted(m["digits"], key=lambda d: d["x"])
        ca, cb = a["x"] + a["side"] / 2, b["x"] + b["side"] / 2
        if not (min(left) - 1 <= ca <= max(left) + 1 and min(right) - 1 <= cb <= max(right) + 1):
            out.append(f"generator scene {m['index']}: box centres {ca}, {cb} outside the sampler's "
                       f"[{min(left)}, {max(left)}], [{min(right)}, {max(right)}]")
    sampler = dp.SymbolicScenes(SHAPES, COLORS, tb.SHAPE_PLURALS, generator_boxes=True)
    for _ in range(300):
        scene, _, q, a = sampler.sample(rng, ["digit"])
        if len(scene["boxes"]) == 2:
            lo, hi = sorted(scene["boxes"], key=lambda d: d["cx"])
            if a != dp.NUMBERS[(lo if "left" in q else hi)["label"]]:
                out.append(f"generator boxes: {q!r} answered {a!r}")
    return out[:5]


def digit_augment_parity(calib_h5: Path) -> list[str]:
    """train_builtin.augment_digit_boxes on the calibration pack's digit scenes."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import numpy as np
    import train_builtin as tb
    pack = tb.Pack(calib_h5)
    idx = tb.digit_scene_indices(pack)[:24]
    imgs, *_ = pack.batch(idx)
    scenes = pack.scenes(idx)
    out = []
    if len(idx) == 0:
        return ["digit augmentation: the calibration pack has no digit scene to check"]
    same = tb.augment_digit_boxes(imgs, scenes, np.random.default_rng(0), 0.0)
    if not np.array_equal(same, imgs):
        out.append("digit augmentation at strength 0 changed the images")
    aug = tb.augment_digit_boxes(imgs, scenes, np.random.default_rng(0), 1.0)
    inside = np.zeros(imgs.shape[:3], dtype=bool)
    changed_boxes = boxes = 0
    for b, sc in enumerate(scenes):
        for d in sc["digits"]:
            x, y, inner = d["x"] + 1, d["y"] + 1, d["side"] - 2
            inside[b, y:y + inner, x:x + inner] = True
            before = 255 - imgs[b, y:y + inner, x:x + inner, 0].astype(float)
            after = 255 - aug[b, y:y + inner, x:x + inner, 0].astype(float)
            boxes += 1
            changed_boxes += not np.array_equal(before, after)
            if not 0.4 * before.sum() <= after.sum() <= 2.2 * before.sum():  # stroke width: up to ~+80 %
                out.append(f"digit augmentation: scene {b}'s box ink {after.sum():.0f} against {before.sum():.0f}")
            if not (aug[b, y:y + inner, x:x + inner, 0] == aug[b, y:y + inner, x:x + inner, 2]).all():
                out.append(f"digit augmentation: scene {b}'s box is no longer grey")
    if not np.array_equal(aug[~inside], imgs[~inside]):
        out.append("digit augmentation changed pixels outside the digit boxes' insides")
    if changed_boxes < 0.9 * boxes:
        out.append(f"digit augmentation changed {changed_boxes} of {boxes} boxes")
    # The boxes are warped a size at a time: scene by scene, with the stream drawn in the same order,
    # each box must come out the same, bit for bit, as within the whole batch.
    rng = np.random.default_rng(0)
    alone = np.concatenate([tb.augment_digit_boxes(imgs[b:b + 1], [sc], rng, 1.0) for b, sc in enumerate(scenes)])
    if not np.array_equal(alone, aug):
        out.append(f"digit augmentation: scene by scene differs from the whole batch on "
                   f"{int((alone != aug).any(-1).any(-1).sum())} of {len(scenes)} scenes")
    return out[:5]


def item_means_parity(draws: int = 3) -> list[str]:
    """decoder_prestage.item_means: the segment kernel against the gather kernel on random rows
    (a sample with many rows, samples with none, an empty mask), values and gradients."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import numpy as np
    import torch
    import decoder_prestage as dp
    rng = np.random.default_rng(7)
    out = []
    saved = dp.item_means_kernel
    try:
        for draw in range(draws):
            feats = torch.randn(6, dp.GRID * dp.GRID, 16)
            rows = [(int(rng.choice([0, 0, 0, 2, 5])), rng.random(dp.GRID * dp.GRID) < 0.1, 0) for _ in range(40)]
            rows.append((3, np.zeros(dp.GRID * dp.GRID, dtype=bool), 0))  # no patch: a zero mean
            means, grads = {}, {}
            for kernel in dp.ITEM_MEANS_KERNELS:
                dp.item_means_kernel = kernel
                x = feats.clone().requires_grad_(True)
                means[kernel] = dp.item_means(x, rows)
                grads[kernel] = torch.autograd.grad((means[kernel] * torch.linspace(-1, 1, 16)).sum(), x)[0]
            expected = torch.stack([feats[b][torch.from_numpy(m)].mean(0) if m.any() else torch.zeros(16)
                                    for b, m, _ in rows])
            for kernel in dp.ITEM_MEANS_KERNELS:
                if not torch.allclose(means[kernel], expected, atol=1e-5):
                    out.append(f"item_means {kernel}: draw {draw} differs from the masks' means by "
                               f"{float((means[kernel] - expected).abs().max()):.2e}")
            if not torch.allclose(grads["segment"], grads["gather"], atol=1e-5):
                out.append(f"item_means: draw {draw}'s gradients differ between the kernels")
        dp.item_means_kernel = "neither"
        try:
            dp.item_means(feats, rows)
            out.append("item_means: an unknown kernel was accepted")
        except ValueError:
            pass
    finally:
        dp.item_means_kernel = saved
    return out


def loss_rows_parity() -> list[str]:
    """decoder_rows.LossRows (--decoder-loss-rows): the answer loss and every gradient as the decoder's own
    forward gives them, under eager attention with the pre-stage's gapped position ids and under sdpa
    with none given, padded rows in both; the layer's own forward outside `only` and after restore()."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import torch
    from transformers import LlamaConfig, LlamaModel
    import decoder_rows
    out = []
    torch.manual_seed(3)
    B, T = 5, 19
    ids = torch.randint(4, 40, (B, T))
    attn = torch.ones(B, T, dtype=torch.long)
    labels = torch.full((B, T), decoder_rows.IGNORE)
    for b in range(B):
        n = T - 3 * b  # right padding: 0, 3, 6, ... tokens
        attn[b, n:] = 0
        labels[b, n - 1 - b % 2:n] = ids[b, n - 1 - b % 2:n]  # one or two answer tokens at the row's end
    labels[0, 4] = ids[0, 4]  # a target early in a row too
    pos = torch.arange(T).expand(B, T).clone()
    pos[:, 3:] += 140  # tokens after the image slots sit 140 positions on (as in the pre-stage)
    for implementation in ("eager", "sdpa"):
        config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        config._attn_implementation = implementation
        lm = LlamaModel(config)
        head = torch.nn.Linear(32, 40)

        def loss_and_grads():
            lm.zero_grad(set_to_none=True)
            # eager: the pre-stage's gapped position ids; sdpa: none given, as LLaVA's forward leaves them
            # (rotary tables of batch 1)
            hidden = lm(input_ids=ids, attention_mask=attn,
                        position_ids=pos if implementation == "eager" else None).last_hidden_state
            loss = torch.nn.functional.cross_entropy(head(hidden)[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                     ignore_index=decoder_rows.IGNORE)
            loss.backward()
            return loss.detach(), [p.grad.clone() for p in lm.parameters()]

        reference = loss_and_grads()
        rows = decoder_rows.LossRows(lm)
        with rows.only(labels):
            selected = loss_and_grads()
        outside = loss_and_grads()
        rows.restore()
        restored = loss_and_grads()
        for name, got in (("only", selected), ("outside only", outside), ("after restore", restored)):
            worst = max(float((a - b).abs().max()) for a, b in zip(reference[1], got[1]))
            if not torch.allclose(reference[0], got[0], atol=1e-6) or worst > 1e-5:
                out.append(f"decoder loss rows ({implementation}, {name}): loss {float(got[0]):.7f} against "
                           f"{float(reference[0]):.7f}, largest gradient difference {worst:.2e}")
        if "forward" in vars(rows.layer):
            out.append(f"decoder loss rows ({implementation}): restore() left the wrapper on the layer")
        no_target = labels.clone()
        no_target[2] = decoder_rows.IGNORE
        try:
            with decoder_rows.LossRows(lm).only(no_target):
                pass
            out.append(f"decoder loss rows ({implementation}): a row without a target was accepted")
        except ValueError:
            pass
    return out


def length_groups_parity() -> list[str]:
    """decoder_prestage.pretrain(length_groups=G) (--prestage-length-groups): a batch run as groups sorted by
    length, every term divided by its count over the whole batch (step_counts), gives the whole batch's
    loss and gradients (the answer loss, both probes and both routes on, eager attention, the last layer
    on the loss's rows) up to summation order; and a phase with groups draws the same samples as without."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import numpy as np
    import torch
    import decoder_prestage as dp
    import decoder_rows
    import train_builtin as tb
    from transformers import LlamaConfig, LlamaModel
    sampler = dp.SymbolicScenes(SHAPES, COLORS, tb.SHAPE_PLURALS, next_to=True, count_layouts=True)
    kinds = ["relation", "count", "digit", "digit", "position", "color"]
    rng, drawn = np.random.default_rng(0), set()
    for _ in range(3000):
        scene, _, q, a = sampler.sample(rng, kinds)
        drawn.update((q + " " + a).split(), *(w for _, w in dp.item_words(scene)))
    word_id = {w: i for i, w in enumerate(dict.fromkeys(["<pad>", "<s>", "</s>", "USER:", "ASSISTANT:"]
                                                        + sorted(drawn)))}
    torch.manual_seed(1)
    lm = LlamaModel(LlamaConfig(vocab_size=len(word_id), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    lm.set_attn_implementation("eager")
    positions = dp.PositionTable(32)
    probe, count_probe = torch.nn.Linear(32, 2), torch.nn.Linear(32, dp.COUNT_THRESHOLDS)
    rows = decoder_rows.LossRows(lm)
    samples = [sampler.sample(np.random.default_rng(7 + i), kinds) for i in range(24)]
    params = list(lm.parameters()) + list(positions.parameters()) + list(probe.parameters()) + \
        list(count_probe.parameters())
    options = dict(comparator_weight=1.0, comparator_layer=1, comparator_axis_weights=(1.0, 0.5), count_weight=0.5,
                   route_weight=0.5, route_layer=1, route_head=0, count_route_weight=0.5, count_route_head=2,
                   plurals=sampler.plurals)

    def run(groups: list, counts) -> tuple[float, list[torch.Tensor]]:
        for q in params:
            q.grad = None
        total = 0.0
        for group in groups:
            loss = dp.step_loss(lm, positions, group, word_id, counts, rows, probe, count_probe, **options)
            loss.backward()
            total += float(loss.detach())
        return total, [q.grad.clone() if q.grad is not None else torch.zeros_like(q) for q in params]

    out = []
    whole = run([samples], None)
    counts = dp.step_counts(samples, sampler.plurals, (1.0, 0.5), True, True, True, True)
    if min(counts["comparator"], counts["count"], counts["route"], counts["count_route"]) <= 0:
        out.append(f"length groups: the test batch does not ask every term: {counts}")
    for n in (2, 3):
        grouped = run(dp.by_length(samples, n), counts)
        worst = max(float((a - b).abs().max() / (a.abs().max() + 1e-12)) for a, b in zip(whole[1], grouped[1]))
        if abs(whole[0] - grouped[0]) > 1e-5 * abs(whole[0]) or worst > 1e-4:
            out.append(f"length groups ({n}): loss {grouped[0]:.7f} against {whole[0]:.7f}, largest relative "
                       f"gradient difference {worst:.2e}")
    lengths = [len(dp.collate([x], word_id)["ids"][0]) for x in samples]
    if [dp.row_length(x) for x in samples] != lengths:
        out.append("decoder_prestage.row_length: not the collated row's length")
    rows.restore()
    return out


def extra_boxes_parity(calib_h5: Path) -> list[str]:
    """train_builtin.paste_extra_digit_boxes on the calibration pack's first scenes, donors from its digit scenes."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import copy
    import numpy as np
    import train_builtin as tb
    pack = tb.Pack(calib_h5)
    idx = np.arange(min(32, len(pack)))
    imgs, *_ = pack.batch(idx)
    scenes = pack.scenes(idx)
    donor_idx = tb.digit_scene_indices(pack)[:48]
    if len(donor_idx) == 0:
        return ["extra boxes: the calibration pack has no digit scene to draw from"]
    donor_imgs, _, _, _ = pack.batch(donor_idx)
    donors = [(donor_imgs[i], sc["digits"][-1]) for i, sc in enumerate(pack.scenes(donor_idx))]
    imgs_before, scenes_before = imgs.copy(), copy.deepcopy(scenes)
    out = []
    same, same_scenes = tb.paste_extra_digit_boxes(imgs, scenes, donors, np.random.default_rng(0), 0)
    if not np.array_equal(same, imgs) or same_scenes != scenes:
        out.append("extra boxes: 0 per scene changed a scene")
    pasted, new_scenes = tb.paste_extra_digit_boxes(imgs, scenes, donors, np.random.default_rng(0), 2)
    if not np.array_equal(imgs, imgs_before) or scenes != scenes_before:
        out.append("extra boxes: the given images or scenes were changed in place")
    covered = np.zeros(imgs.shape[:3], dtype=bool)
    added = 0
    canvas = imgs.shape[1]
    donor_pixels = {(d["sheet_index"], d["x"], d["y"]): img[d["y"]:d["y"] + d["side"], d["x"]:d["x"] + d["side"]]
                    for img, d in donors}
    for b, (old, new) in enumerate(zip(scenes, new_scenes)):
        kept = old.get("digits", [])
        if new["digits"][:len(kept)] != kept or new.get("objects") != old.get("objects"):
            out.append(f"extra boxes: scene {b}'s own boxes or objects changed")
        extra = new["digits"][len(kept):]
        added += len(extra)
        if len(extra) > 2:
            out.append(f"extra boxes: scene {b} got {len(extra)} boxes, expected at most 2")
        for j, d in enumerate(extra):
            x, y, side = d["x"], d["y"], d["side"]
            if x < 0 or y < 0 or x + side > canvas or y + side > canvas:
                out.append(f"extra boxes: scene {b}'s box at ({x}, {y}) side {side} leaves the canvas")
                continue
            covered[b, y:y + side, x:x + side] = True
            match = [px for (si, dx, dy), px in donor_pixels.items() if si == d["sheet_index"]
                     and np.array_equal(px, pasted[b, y:y + side, x:x + side])]
            if not match:
                out.append(f"extra boxes: scene {b}'s box {j} is not a donor box's pixels")
            for o in old.get("objects", []):
                gap = max(x - o["cx"] - o["radius"], o["cx"] - o["radius"] - x - side,
                          y - o["cy"] - o["radius"], o["cy"] - o["radius"] - y - side)
                if gap <= 8:  # scene_from_meta reads a box this close as beside the object ("next to")
                    out.append(f"extra boxes: scene {b}'s box {j} is {gap:.1f} px from an object")
            for k, e in enumerate(new["digits"]):
                if k != len(kept) + j and not (x + side <= e["x"] or e["x"] + e["side"] <= x or
                                                y + side <= e["y"] or e["y"] + e["side"] <= y):
                    out.append(f"extra boxes: scene {b}'s box {j} overlaps box {k}")
    if not np.array_equal(pasted[~covered], imgs[~covered]):
        out.append("extra boxes: pixels outside the pasted boxes changed")
    if added < len(idx) // 2:
        out.append(f"extra boxes: {added} boxes pasted into {len(idx)} scenes, expected at least {len(idx) // 2}")
    return out[:5]


def vision_tap_parity(model_dir: Path) -> list[str]:
    """train_builtin.VisionTap skips the tower's unused last layer while training: the projector's
    input must stay the same tensor, and restore() must bring the layer back."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import torch
    import train_builtin as tb
    from transformers import LlavaForConditionalGeneration
    model = LlavaForConditionalGeneration.from_pretrained(model_dir).eval()
    tower = model.model.vision_tower
    pixels = torch.randn(2, 3, tb.IMAGE_SIZE, tb.IMAGE_SIZE, generator=torch.Generator().manual_seed(0))
    layer = model.config.vision_feature_layer
    with torch.no_grad():
        before = tower(pixel_values=pixels, output_hidden_states=True).hidden_states
        tap = tb.VisionTap(model)
        during = tower(pixel_values=pixels, output_hidden_states=True).hidden_states
        tapped = tap.value
        tap.restore()
        after = tower(pixel_values=pixels, output_hidden_states=True).hidden_states
    out = []
    if not torch.equal(during[layer], before[layer]) or not torch.equal(tapped, before[layer]):
        out.append("VisionTap changed the vision features the projector reads")
    if not torch.equal(during[-1], during[layer]):
        out.append("VisionTap did not skip the layers after the feature layer")
    if not torch.equal(after[-1], before[-1]):
        out.append("VisionTap.restore() did not bring the skipped layers back")
    return out


def pack_in_memory_parity(pack_h5: Path) -> list[str]:
    """Pack(in_memory=True) serves the rows HDF5 gives, as copies: writing into a batch leaves the pack as it was."""
    import numpy as np
    import train_builtin as tb
    failures = []
    streamed, held = tb.Pack(pack_h5), tb.Pack(pack_h5, in_memory=True)
    idx = np.random.default_rng(5).permutation(len(streamed))[:6]
    for name, a, b in zip(("images", "questions", "answers", "types"), streamed.batch(idx), held.batch(idx)):
        if not (np.array_equal(a, b) if name == "images" else a == b):
            failures.append(f"Pack(in_memory=True).batch: {name} differ from the HDF5 rows")
    if streamed.scenes(idx) != held.scenes(idx):
        failures.append("Pack(in_memory=True).scenes: differ from the HDF5 rows")
    before = held.images[idx[0]].copy()
    tb.Pack.rows(held.images, idx)[0][:] = 0
    if not np.array_equal(held.images[idx[0]], before):
        failures.append("Pack(in_memory=True): a row is a view into the pack (writing into it changed the pack)")
    return failures


RANKS_WORKER = r"""
import json, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[3])
import train_ranks
rank, init = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
ranks = train_ranks.Ranks(rank, 2, threads=1)
out = {}
a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (2, 1, 3))
a.grad = torch.tensor([1.0, 2.0]) if rank == 0 else torch.tensor([3.0, 6.0])
if rank == 1:
    b.grad = torch.tensor([4.0])  # only rank 1's loss reached b
ranks.average_gradients([a, b, c])
out["a"], out["b"], out["c"] = a.grad.tolist(), b.grad.tolist(), c.grad
out["json"] = ranks.broadcast_json({"x": (1, 2.5), "rank": rank})
def on_main():
    if rank != 0:
        raise RuntimeError("main_wide ran fn on rank 1")
    return [torch.get_num_threads()]
out["main_wide"] = ranks.main_wide(on_main)
out["threads_after"] = torch.get_num_threads()
m = torch.nn.Linear(2, 2)
with torch.no_grad():
    m.weight.fill_(0.5)
    m.bias.fill_(0.25)
ranks.same_weights(m, "equal stage")
if rank == 1:
    with torch.no_grad():
        m.bias[0] += 1e-7
try:
    ranks.same_weights(m, "perturbed stage")
    out["perturbed"] = "not raised"
except RuntimeError as e:
    out["perturbed"] = str(e)
dist.barrier()  # neither leaves while the other's gloo threads still talk to it
dist.destroy_process_group()
print(json.dumps(out))
"""


def ranks_primitives(tmp: Path) -> list[str]:
    """train_ranks.Ranks between two processes: average_gradients averages, gives zeros where only the other
    rank's loss reached a parameter and keeps None where none did; broadcast_json and main_wide give rank 0's
    value everywhere (main_wide running fn on rank 0 only, with both ranks' threads); same_weights raises on
    every rank when one weight differs in its last bit; share and seed split a batch and its streams."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import train_ranks
    failures = []
    r1 = train_ranks.Ranks(1, 2)
    if r1.share(list(range(5))) != [1, 3] or train_ranks.Ranks(0, 2).share(list(range(5))) != [0, 2, 4]:
        failures.append(f"Ranks(1, 2).share: {r1.share(list(range(5)))} (expected [1, 3])")
    if train_ranks.Ranks(0, 2).seed(7) != 7 or r1.seed(7) != [7, 1]:
        failures.append("Ranks.seed: rank 0 must keep the one-process seed, others a stream of their own")
    init = tmp / "ranks-init"
    procs = [subprocess.Popen([sys.executable, "-c", RANKS_WORKER, str(r), str(init), str(REPO_ROOT / "scripts")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    results = []
    for r, proc in enumerate(procs):
        out, err = proc.communicate(timeout=120)
        if proc.returncode != 0:
            failures.append(f"ranks worker {r} exited {proc.returncode}: {err.strip().splitlines()[-1:]}")
            return failures
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r, got in enumerate(results):
        expected = {"a": [2.0, 4.0], "b": [2.0], "c": None, "json": {"x": [1, 2.5], "rank": 0},
                    "main_wide": [2], "threads_after": 1}
        for k, v in expected.items():
            if got[k] != v:
                failures.append(f"ranks worker {r}: {k} expected {v}, got {got[k]}")
        if "perturbed stage" not in got["perturbed"]:
            failures.append(f"ranks worker {r}: same_weights did not raise on a weight 1e-7 apart: {got['perturbed']}")
    return failures


def ranks_runs(vlmopt: str, tmp: Path) -> list[str]:
    """--ranks 2: the run finishes, its decoder pre-stage (rank 0 alone, every thread) is byte for byte
    a one-process run's, rank 1 loads that entry, and the data-parallel stages reproduce their weights."""
    failures = []
    work, single_work = tmp / "ranks-work", tmp / "single-work"
    two = train(vlmopt, tmp / "ranks" / "model", work, "--threads", "2", "--ranks", "2")
    one = train(vlmopt, tmp / "single" / "model", single_work, "--threads", "2", "--ranks", "1")
    if two.returncode != 0 or one.returncode != 0:
        return [f"--threads 2: --ranks 2 exited {two.returncode} ({two.stderr.strip().splitlines()[-1:]}), "
                f"--ranks 1 exited {one.returncode} ({one.stderr.strip().splitlines()[-1:]})"]
    prestage = sorted(work.glob("decoder-prestage-*.safetensors"))
    single = sorted(single_work.glob("decoder-prestage-*.safetensors"))
    if [p.name for p in prestage] != [p.name for p in single] or len(prestage) != 1:
        failures.append(f"--ranks 2: pre-stage entries {[p.name for p in prestage]}, one process's "
                        f"{[p.name for p in single]} (expected the same single entry)")
    elif sha256(prestage[0]) != sha256(single[0]):
        failures.append("--ranks 2: the decoder pre-stage differs from one process's with as many threads")
    rank_log = (work / "rank-1.log").read_text() if (work / "rank-1.log").is_file() else ""
    if "decoder pre-stage from" not in rank_log:
        failures.append("--ranks 2: rank 1 did not load the pre-stage rank 0 wrote (rank-1.log)")
    if list(work.glob(".ranks-*")):
        failures.append(f"--ranks 2: the ranks' meeting file is left in --work: {list(work.glob('.ranks-*'))}")
    args = json.loads((tmp / "ranks" / "model" / "vlmopt_training.json").read_text())["args"]
    if args.get("ranks") != 2:
        failures.append(f"--ranks 2: vlmopt_training.json args.ranks {args.get('ranks')}")
    for vision_cache in work.glob("vision-pooled-*.safetensors"):
        vision_cache.unlink()
    again = train(vlmopt, tmp / "ranks-again" / "model", work, "--threads", "2", "--ranks", "2")
    if again.returncode != 0:
        failures.append(f"--ranks 2 again: exited {again.returncode}: {again.stderr.strip().splitlines()[-1:]}")
    elif sha256(tmp / "ranks" / "model" / "model.safetensors") != sha256(tmp / "ranks-again" / "model" / "model.safetensors"):
        failures.append("--ranks 2: the vision and joint stages trained again gave other weights")
    bad = train(vlmopt, tmp / "bad-ranks" / "model", tmp / "bad-ranks-work", "--threads", "1", "--ranks", "2")
    last = (bad.stderr.strip().splitlines() or [""])[-1]
    if bad.returncode == 0 or not last.startswith("--ranks:") or (tmp / "bad-ranks-work").exists():
        failures.append(f"--threads 1 --ranks 2: exit {bad.returncode}, last line {last!r}, "
                        f"work written: {(tmp / 'bad-ranks-work').exists()}")
    return failures


def patch_keep_parity(calib_h5: Path, model_dir: Path) -> list[str]:
    """--vision-patch-keep: item_footprints cover every object's ink; kept_patches keeps every item patch,
    weighs the background so that each sample's weights sum to 144 where it keeps some; tower_on_kept in
    groups gives each sample the features it gets alone on its kept patches."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import numpy as np
    import torch
    import train_builtin as tb
    from transformers import LlavaForConditionalGeneration
    pack = tb.Pack(calib_h5)
    idx = np.arange(min(12, len(pack)))
    imgs, *_ = pack.batch(idx)
    scenes = pack.scenes(idx)
    out = []
    footprint = tb.item_footprints(scenes).reshape(len(idx), tb.GRID, tb.GRID)
    ys, xs = np.mgrid[0:imgs.shape[1], 0:imgs.shape[2]]
    for b, sc in enumerate(scenes):
        for o in sc.get("objects", []):
            # the object's own colour near it: its ink (the noise background is light grey)
            ink = ((np.abs(imgs[b].astype(int) - np.array(o["rgb"])).max(-1) <= 24)
                   & (np.hypot(xs - o["cx"], ys - o["cy"]) <= 1.5 * o["radius"]))
            outside = ink & ~np.kron(footprint[b], np.ones((tb.PATCH, tb.PATCH), dtype=bool))
            if ink.sum() < 10 or outside.any():
                out.append(f"item_footprints: scene {b}'s {o['shape']}: {int(ink.sum())} ink pixels, "
                           f"{int(outside.sum())} outside its footprint")
    items = tb.pooled_targets(scenes, SHAPES, COLORS)
    index, weights, groups = tb.kept_patches(items, scenes, 1, np.random.default_rng(0), 3)
    if sorted(np.concatenate(groups).tolist()) != list(range(len(idx))) or len(groups) != 3:
        out.append(f"kept_patches: groups {[g.tolist() for g in groups]} do not split the batch in three")
    for (b, m, _, _), (_, kept_m, _, _) in zip(items, tb.items_on_kept(items, index)):
        if kept_m.sum() != m.sum() or set(index[b][kept_m].tolist()) != set(np.flatnonzero(m).tolist()):
            out.append(f"kept_patches: an item of scene {b} lost patches")
            break
    for b in range(len(idx)):
        k = int((index[b] >= 0).sum())
        background = weights[b, :k] != 1.0
        if (index[b, k:] != -1).any() or (weights[b, k:] != 0).any() or len(set(index[b, :k].tolist())) != k:
            out.append(f"kept_patches: scene {b}'s index or weights are not padded after its {k} patches")
        elif background.any() and abs(float(weights[b].sum()) - tb.GRID * tb.GRID) > 1e-3:
            out.append(f"kept_patches: scene {b}'s weights sum to {weights[b].sum()}, expected 144")
    model = LlavaForConditionalGeneration.from_pretrained(model_dir).eval()
    tap = tb.VisionTap(model)
    pixels = tb.to_pixels(imgs)
    with torch.no_grad():
        value, _ = tb.tower_on_kept(model.model.vision_tower, tap, pixels, (index, weights, groups))
        for b in range(len(idx)):
            k = int((index[b] >= 0).sum())
            tap.keep = torch.from_numpy(index[b:b + 1, :k])
            model.model.vision_tower(pixel_values=pixels[b:b + 1])
            tap.keep = None
            if not torch.allclose(value[b, :1 + k], tap.value[0], atol=1e-5) or (value[b, 1 + k:] != 0).any():
                out.append(f"tower_on_kept: scene {b}'s features differ from its own run on its kept patches")
        model.model.vision_tower(pixel_values=pixels)  # tap.keep None: all 144 patches again
        if tap.value.shape[1] != 1 + tb.GRID * tb.GRID:
            out.append(f"VisionTap kept patches after tower_on_kept: {tap.value.shape[1] - 1} patches")
    tap.restore()
    return out[:5]


def main() -> int:
    vlmopt = os.environ.get("VLMOPT_BIN", str(REPO_ROOT / "build" / "apps" / "vlmopt" / "vlmopt"))
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="vlmopt-train-smoke-") as tmp:
        tmp = Path(tmp)
        work = tmp / "work"
        first = tmp / "not" / "yet" / "model"
        run = train(vlmopt, first, work)
        if run.returncode != 0:
            print(f"FAIL first run exited {run.returncode}: {run.stderr.strip().splitlines()[-1:]}")
            return 1
        for name in ["config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json",
                     "processor_config.json", "vlmopt_training.json"]:
            if not (first / name).is_file():
                failures.append(f"missing {first / name}")
        training = json.loads((first / "vlmopt_training.json").read_text())
        if training.get("steps") != STEPS:
            failures.append(f"vlmopt_training.json steps: expected {STEPS}, got {training.get('steps')}")
        # The default --allocator tcmalloc re-executes the script with tcmalloc preloaded where it is installed.
        sys.path.insert(0, str(REPO_ROOT / "scripts"))
        import train_builtin as tb
        expected_allocator = "tcmalloc" if tb.tcmalloc_installed() else "system"
        if training.get("allocator") != expected_allocator:
            failures.append(f"vlmopt_training.json allocator: expected {expected_allocator}, got "
                            f"{training.get('allocator')}")
        # The default --precision auto resolves to bf16 only on a CPU with bfloat16 instructions.
        for requested, native, expected in [("auto", True, "bf16"), ("auto", False, "fp32"), ("fp32", True, "fp32"),
                                             ("bf16", True, "bf16")]:
            if tb.resolve_precision(requested, native) != expected:
                failures.append(f"resolve_precision({requested!r}, native_bf16={native}): expected {expected}, "
                                f"got {tb.resolve_precision(requested, native)}")
        # The fp32-only options' auto: off under bf16 (the bf16 hosts' recipe), on under fp32; a number as given.
        for option in ("--digit-augment", "--prestage-relation-lr", "--vision-extra-boxes"):
            fp32_value = tb.FP32_AUTO[option]
            if not fp32_value > 0:
                failures.append(f"FP32_AUTO[{option!r}]: expected > 0, got {fp32_value}")
            for requested, precision, expected in [("auto", "bf16", 0.0), ("auto", "fp32", fp32_value),
                                                   ("0", "fp32", 0.0), ("3", "bf16", 3.0)]:
                got = tb.resolve_auto(option, requested, precision)
                if got != expected:
                    failures.append(f"resolve_auto({option!r}, {requested!r}, {precision!r}): expected {expected}, "
                                    f"got {got}")
            whole = isinstance(fp32_value, int)  # a count: no fractions, and ints back
            if whole and type(tb.resolve_auto(option, "2", "fp32")) is not int:
                failures.append(f"resolve_auto({option!r}, '2'): expected an int")
            for bad in ("-0.5", "nan", "inf", "strong") + (("1.5",) if whole else ()):
                try:
                    tb.resolve_auto(option, bad, "fp32")
                    failures.append(f"resolve_auto({option!r}, {bad!r}): accepted")
                except ValueError:
                    pass
        recorded = training.get("args", {})
        for key, expected in (("prestage_relation_lr", 5e-4), ("vision_extra_boxes", 1)):  # as train() passes them
            if recorded.get(key) != expected or type(recorded.get(key)) is not type(expected):
                failures.append(f"vlmopt_training.json args.{key}: expected {expected!r}, got {recorded.get(key)!r}")
        if training.get("args", {}).get("digit_augment") != 1.0:  # train() passes --digit-augment 1.0
            failures.append(f"vlmopt_training.json args.digit_augment: expected 1.0, got "
                            f"{training.get('args', {}).get('digit_augment')}")
        expected_precision = "bf16" if tb.cpu_has_native_bf16() else "fp32"
        if training.get("args", {}).get("precision") != expected_precision:
            failures.append(f"vlmopt_training.json args.precision: expected {expected_precision} (--precision auto "
                            f"here), got {training.get('args', {}).get('precision')}")
        if len(training.get("vision_log", [])) == 0:
            failures.append("vlmopt_training.json: no first-stage log although --vision-steps 2")
        elif "early_shape" not in training["vision_log"][-1].get("heldout_pooled_acc", {}):
            failures.append("vlmopt_training.json: the first stage's log has no early_shape accuracy although "
                            "--vision-early-shape-layer 1")
        elif training["vision_log"][-1].get("vision_step") != "ema":
            failures.append(f"vlmopt_training.json: the first stage's last log entry is step "
                            f"{training['vision_log'][-1].get('vision_step')}, not the moving average's check "
                            f"although --vision-ema 0.9")
        if len(training.get("decoder_prestage_log", [])) == 0:
            failures.append("vlmopt_training.json: no decoder pre-stage log although --decoder-prestage-steps 2")
        # --prestage-digit-kinds digit,relation: one phase's held-out set asks exactly those two kinds
        phase_kinds = [set(e.get("by_kind", {})) - {"digit_two_box"} for e in training.get("decoder_prestage_log", [])]
        if {"digit", "relation"} not in phase_kinds:
            failures.append(f"--prestage-digit-kinds digit,relation: no pre-stage phase drew exactly those kinds "
                            f"(phases drew {phase_kinds})")
        # --prestage-relation-until relation=1.0 is never met in one step: each relation phase runs twice.
        relation_tries = collections.defaultdict(set)
        for e in training.get("decoder_prestage_log", []):
            if set(e.get("by_kind", {})) == {"relation"}:
                relation_tries[e.get("phase")].add(e.get("try"))
        if len(relation_tries) != 3 or any(tries != {0, 1} for tries in relation_tries.values()):
            failures.append(f"--prestage-relation-until relation=1.0 --prestage-retries 1: relation phases ran tries "
                            f"{dict(relation_tries)}, expected three phases with tries 0 and 1")
        # Eleven phases: position-first, main mix, binding (early), three relation, digit, remix, the two
        # tag phases and --prestage-next-to-steps' phase last.
        phases = sorted({e["phase"] for e in training.get("decoder_prestage_log", []) if "phase" in e})
        if phases != list(range(11)):
            failures.append(f"decoder pre-stage log: phases {phases}, expected 0..10 (the next-to phase last)")
        leftovers = [p.name for p in first.parent.iterdir() if p.name.startswith(".builtin-")]
        if leftovers:
            failures.append(f"temp dirs left next to --out: {leftovers}")

        res = subprocess.run([vlmopt, "-q", "--json", "eval", "--model", str(first), "--data", "builtin:eval",
                              "--limit", "4"], capture_output=True, text=True)
        if res.returncode != 0:
            failures.append(f"vlmopt eval exited {res.returncode}: {res.stderr.strip()[-300:]}")
        else:
            report = json.loads(res.stdout)
            if report.get("n") != 4 or report.get("visual_tokens") != 144:
                failures.append(f"vlmopt eval: expected n 4 and 144 visual tokens, got {report.get('n')}, "
                                f"{report.get('visual_tokens')}")

        from transformers import AutoProcessor, LlavaForConditionalGeneration  # noqa: E402
        try:
            model = LlavaForConditionalGeneration.from_pretrained(first)
            processor = AutoProcessor.from_pretrained(first)
            ids = processor.tokenizer("USER: what color is the circle ? ASSISTANT:")["input_ids"]
            if processor.tokenizer.unk_token_id in ids:
                failures.append(f"transformers tokenizer: unknown word in a template question: {ids}")
            if model.config.image_seq_length != 144:
                failures.append(f"config image_seq_length: expected 144, got {model.config.image_seq_length}")
        except Exception as e:  # noqa: BLE001 - any load failure is the finding
            failures.append(f"transformers could not load {first}: {type(e).__name__}: {e}")

        second = tmp / "again"
        run2 = train(vlmopt, second, work)
        if run2.returncode != 0:
            failures.append(f"second run exited {run2.returncode}: {run2.stderr.strip().splitlines()[-1:]}")
        else:
            if "first stage from" not in run2.stderr:
                failures.append("second run did not take its first stage from the --work cache")
            if "decoder pre-stage from" not in run2.stderr:
                failures.append("second run did not take its decoder pre-stage from the --work cache")
            if sha256(first / "model.safetensors") != sha256(second / "model.safetensors"):
                failures.append("same seed, different weights: the run is not reproducible")
        for vision_cache in work.glob("vision-pooled-*.safetensors"):
            vision_cache.unlink()
        third = tmp / "third"
        # The same weights under glibc's malloc, and with each batch's rows read from HDF5 (the packs not in RAM).
        run3 = train(vlmopt, third, work, "--allocator", "system", "--no-pack-in-memory")
        if run3.returncode != 0:
            failures.append(f"third run exited {run3.returncode}: {run3.stderr.strip().splitlines()[-1:]}")
        elif "decoder pre-stage from" not in run3.stderr or "first stage from" in run3.stderr:
            failures.append("third run: expected the pre-stage from the cache and the vision stage trained")
        elif sha256(first / "model.safetensors") != sha256(third / "model.safetensors"):
            failures.append("pre-stage from the cache, vision stage trained under --allocator system "
                            "--no-pack-in-memory: different weights than the fresh run")
        elif json.loads((third / "vlmopt_training.json").read_text()).get("allocator") != "system":
            failures.append("third run: vlmopt_training.json allocator is not 'system' under --allocator system")

        failures += derived_question_parity(work / "calib.h5")
        failures += vision_tap_parity(first)
        failures += extra_boxes_parity(work / "calib.h5")
        failures += patch_keep_parity(work / "calib.h5", first)
        failures += pack_in_memory_parity(work / "calib.h5")
        # A bad --vision-patch-keep: one line naming the option, before anything is packed or written.
        bad = train(vlmopt, tmp / "bad" / "model", tmp / "bad-work", "--vision-patch-keep", "145")
        last = (bad.stderr.strip().splitlines() or [""])[-1]
        if bad.returncode == 0 or not last.startswith("--vision-patch-keep:") or (tmp / "bad-work").exists() \
                or (tmp / "bad").exists():
            failures.append(f"--vision-patch-keep 145: exit {bad.returncode}, last line {last!r}, "
                            f"work written: {(tmp / 'bad-work').exists()}")
        # A gate that cannot pass: the first try stops at step 1, the second runs all three steps.
        gated = train(vlmopt, tmp / "gated" / "model", work, "--vision-until", "shape=1.0", "--vision-gate-step", "1",
                      "--vision-retries", "1", "--vision-steps", "3")
        restarts, last_steps = gated.stderr.count('"vision_gate": "short"'), gated.stderr.count('"vision_step": 2,')
        if gated.returncode != 0 or restarts != 1 or last_steps != 1 \
                or not (tmp / "gated" / "model" / "model.safetensors").is_file():
            failures.append(f"--vision-until shape=1.0 at step 1: exit {gated.returncode}, started over {restarts} "
                            f"times (expected 1), step 2 reached {last_steps} times (expected 1)")
        bad_gate = train(vlmopt, tmp / "bad-gate" / "model", tmp / "bad-gate-work", "--vision-until", "shape=2")
        last = (bad_gate.stderr.strip().splitlines() or [""])[-1]
        if bad_gate.returncode == 0 or not last.startswith("--vision-until:") or (tmp / "bad-gate-work").exists():
            failures.append(f"--vision-until shape=2: exit {bad_gate.returncode}, last line {last!r}")
        failures += centre_item_parity(work / "calib.h5")
        failures += question_stream_parity(work / f"train-{VISION_PACK}.h5")
        failures += count_layout_parity()
        failures += binding_layout_parity()
        failures += comparator_parity()
        failures += count_target_parity()
        failures += route_parity()
        failures += checkpoint_dtypes(first / "model.safetensors")
        failures += relation_schedule_draws()
        failures += item_tag_parity(work / "calib.h5")
        failures += tag_phase_determinism()
        failures += frozen_positions()
        failures += phase_gate()
        failures += vision_gate()
        failures += digit_augment_parity(work / "calib.h5")
        failures += item_means_parity()
        failures += loss_rows_parity()
        failures += generator_boxes_parity(work / "calib.h5")
        failures += length_groups_parity()
        failures += ranks_primitives(tmp)
        failures += ranks_runs(vlmopt, tmp)

    for f in failures:
        print(f"FAIL {f}")
    if not failures:
        print(f"ok: trained {STEPS} steps three times, identical weights; vlmopt eval and transformers load the result")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
