#!/usr/bin/env python3
"""Screens binding-phase variants of the decoder pre-stage in minutes instead of a 30-minute run (issue 3).

The binding phase (train_builtin.py --prestage-binding-steps) forms the sized-pair routing
("what color is the large X ?" beside a small X) but, with colour and exist questions alone, the
remix after it no longer restores relation (session 27). Whether a variant keeps relation shows at
the pre-stage's end, so this runs the expensive part once and the variants from there:

    binding_phase_screen.py snapshot --snapshot SNAP.safetensors --vlmopt V --work W --out M [train_builtin.py args]
        runs scripts/train_builtin.py with those arguments (an empty --work: a cached pre-stage is
        not re-run) and saves the decoder and position table when the digit phase ends -- the
        state the binding phase starts from -- then stops (~8 min on 2 cores).

    binding_phase_screen.py screen --vlmopt V --snapshot SNAP.safetensors NAME [--steps 500]
        [--kinds color,exist] [--lr 1e-3] [--route 1.0] [--comparator 0] [--freeze-positions]
        [--remix 250]
        one variant of the binding phase (train_builtin.py's arguments and seeds), then the default
        250-step remix, and after each one JSON line on stdout: first-token accuracy on 1536 fixed
        full-mix samples (overall and per kind) and on 512 colour questions of the binding layouts
        ("bind_color"; half of them a sized pair, so ~0.75 when the pair is at chance). ~3.5 min.
        The figures right after the binding phase mostly show which answer words the phase left
        the head on; the ones after the remix are the comparison.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import decoder_prestage as dp  # noqa: E402
import train_builtin as tb  # noqa: E402


def two_box_questions(sampler: dp.SymbolicScenes, rng: np.random.Generator, next_to: bool,
                      n: int = 512) -> list:
    """n digit questions on two boxes drawn from `sampler`: the left/right layout, or the next-to one."""
    if next_to:
        sampler = dataclasses.replace(sampler, next_to=True)
    held = []
    while len(held) < n:
        drawn = sampler.sample(rng, ["digit"])
        boxes = drawn[0]["boxes"]
        if len(boxes) == 2 and ("anchor" in boxes[0]) == next_to:
            held.append(drawn)
    return held


def accuracy_by_kind(decoder, positions, word_id: dict[str, int], held: list) -> dict[str, list[int]]:
    """First-token right (1) or wrong (0) per question of `held`, by kind; in batches of 256."""
    acc: dict[str, list[int]] = {}
    for i in range(0, len(held), 256):
        b = dp.collate(held[i:i + 256], word_id)
        for k, v in dp.accuracy_by_kind(dp.logits(decoder, positions, b), b).items():
            acc.setdefault(k, []).extend(v)
    return acc


def snapshot(out: Path, train_args: list[str]) -> int:
    from safetensors.torch import save_file
    pretrain = dp.pretrain

    def until_digit_phase(lm, positions, *args, **kwargs):
        entries = pretrain(lm, positions, *args, **kwargs)
        if kwargs.get("kinds") == ["digit"]:
            state = {f"decoder.{k}": v.contiguous() for k, v in lm.state_dict().items()}
            state.update({f"positions.{k}": v.contiguous() for k, v in positions.state_dict().items()})
            save_file(state, str(out))
            print(f"[screen] saved the pre-stage after the digit phase -> {out}", file=sys.stderr, flush=True)
            raise SystemExit(0)
        return entries

    dp.pretrain = until_digit_phase
    sys.argv = ["train_builtin.py", *train_args]
    tb.main()
    raise SystemExit("the recipe ran no digit phase (--prestage-digit-steps 0 or a cached pre-stage in --work?)")


def screen(a) -> None:
    from safetensors.torch import load_file
    from transformers import LlavaForConditionalGeneration
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    vocab = json.loads(tb.run_vlmopt(a.vlmopt, "--json", "datasets", "vocab"))
    tok = tb.build_tokenizer(vocab["words"])
    ids = {s: tok.token_to_id(s) for s in tb.SPECIALS}
    config = tb.make_config(tok.get_vocab_size(), ids["<image>"], ids)
    model = LlavaForConditionalGeneration(config)
    model.set_attn_implementation("eager")  # the route loss reads attention probabilities
    decoder, word_id = model.model.language_model, tok.get_vocab()
    positions = dp.PositionTable(config.text_config.hidden_size,
                                 tuple(word_id[w] for w in ("left", "right", "top", "bottom")),
                                 {t: [word_id[w] for w in dp.TAG_WORDS[t]] for t in ("count_color", "count_shape")})
    state = load_file(a.snapshot)
    decoder.load_state_dict({k.removeprefix("decoder."): v for k, v in state.items() if k.startswith("decoder.")})
    positions.load_state_dict({k.removeprefix("positions."): v for k, v in state.items()
                               if k.startswith("positions.")}, strict=False)  # tag rotations: not saved
    positions.tags_active = False  # the tags come on after the remix
    shapes, colors = vocab["answers"]["shape"], vocab["answers"]["color"]
    scenes = dp.SymbolicScenes(shapes, colors, tb.SHAPE_PLURALS, False, count_layouts=True,
                               generator_boxes=a.generator_boxes)
    binding = dataclasses.replace(scenes, binding_layouts=True)
    rng = np.random.default_rng(777)
    held_mix = [scenes.sample(rng, dp.KINDS) for _ in range(1536)]
    held_bind = [binding.sample(rng, ["color"]) for _ in range(512)]

    held_side = two_box_questions(scenes, rng, next_to=False)
    held_next = two_box_questions(scenes, rng, next_to=True)
    accuracy = lambda held: accuracy_by_kind(decoder, positions, word_id, held)

    def report(at: str) -> None:
        decoder.eval()
        with torch.no_grad():
            mix, bind = accuracy(held_mix), accuracy(held_bind)
            side, beside = accuracy(held_side), accuracy(held_next)
        decoder.train()
        print(json.dumps({"name": a.name, "at": at, "mix": round(float(np.mean([x for v in mix.values() for x in v])), 3),
                          **{k: round(float(np.mean(v)), 2) for k, v in sorted(mix.items())},
                          "bind_color": round(float(np.mean(bind["color"])), 3),
                          "digit_side": round(float(np.mean(side["digit"])), 3),
                          "digit_next_to": round(float(np.mean(beside["digit"])), 3)}), flush=True)

    log = lambda phase: (lambda line: print(f"[{phase}] {line}", file=sys.stderr, flush=True))
    report("before")
    t0 = time.time()
    phase_sampler = dataclasses.replace(binding, next_to=a.next_to)
    dp.pretrain(decoder, positions, phase_sampler, word_id, steps=a.steps, batch=64, lr=a.lr, seed=a.seed + 18,
                kinds=a.kinds.split(","), held=min(512, 16 * a.steps), route_weight=a.route,
                comparator_weight=a.comparator, train_positions=not a.freeze_positions, log=log("binding"))
    report(f"after binding ({time.time() - t0:.0f} s)")
    if a.remix:
        dp.pretrain(decoder, positions, binding, word_id, steps=a.remix, batch=64, lr=1e-3, seed=a.seed + 8,
                    kinds=dp.KINDS, held=min(1024, 16 * a.remix), comparator_weight=0.2, log=log("remix"))
        report("after remix")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    snap = sub.add_parser("snapshot", allow_abbrev=False,
                          help="train_builtin.py up to the digit phase's end; the other arguments go to it")
    snap.add_argument("--snapshot", type=Path, required=True, help="the .safetensors file to write")
    sc = sub.add_parser("screen", allow_abbrev=False, help="one binding-phase variant and the remix from a snapshot")
    sc.add_argument("name")
    sc.add_argument("--vlmopt", required=True)
    sc.add_argument("--snapshot", required=True)
    sc.add_argument("--steps", type=int, default=500)
    sc.add_argument("--kinds", default="color,exist", help="as train_builtin.py --prestage-binding-kinds")
    sc.add_argument("--lr", type=float, default=1e-3)
    sc.add_argument("--route", type=float, default=1.0, help="as --prestage-binding-route-weight")
    sc.add_argument("--comparator", type=float, default=0.0, help="the comparator probe's weight in the phase")
    sc.add_argument("--freeze-positions", action="store_true", help="as --prestage-binding-freeze-positions")
    sc.add_argument("--next-to", action="store_true",
                    help="the phase's sampler also draws the \"which digit is next to the X ?\" layout")
    sc.add_argument("--generator-boxes", action="store_true",
                    help="the left/right box layout as the generator draws it, in the phases and the held-out sets")
    sc.add_argument("--remix", type=int, default=250)
    sc.add_argument("--seed", type=int, default=0)
    sc.add_argument("--threads", type=int, default=2)
    a, rest = ap.parse_known_args()
    if a.mode == "snapshot":
        return snapshot(a.snapshot, rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    screen(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
