#!/usr/bin/env python3
"""Screens a change to the decoder pre-stage's later phases in ~6 minutes instead of a 33-minute run (issue 3).

The phases after the main mix (relation, digit, binding, remix, tags; train_builtin.py's recipe)
decide which question forms the pre-stage hands on, and they cost ~6 of the pre-stage's ~11
minutes on 2 cores. This runs train_builtin.py with the given arguments, takes the first
phases (--prestage-position-first and the main mix) from a snapshot, and stops at the
pre-stage's end:

    prestage_tail_screen.py --snapshot SNAP.safetensors --vlmopt V --work W NAME [train_builtin.py args]

  - SNAP missing: the first phases run and are saved there (decoder, position table and
    torch's RNG state, so that the later phases draw as in a full run); the screen goes on.
  - SNAP present: loaded in place of the first phases. A snapshot stands only for runs whose
    first phases are the same: same --seed, --decoder-prestage-*, --prestage-position-first,
    --prestage-first-kinds and sampler options (--prestage-generator-boxes, ...).
  - W: a --work folder holding the packs (train-*.h5, calib.h5) and no pre-stage cache (the
    stage is never read from or written to it).

Prints one JSON line on stdout: the last phase's held-out accuracy by kind, and first-token
accuracy on 512 left/right and 512 next-to digit questions of the generator's layouts
("digit_side", "digit_next_to"). The later phases compute exactly as in the full run (session
30: the same figures to the last digit).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import decoder_prestage as dp  # noqa: E402
import train_builtin as tb  # noqa: E402
from binding_phase_screen import accuracy_by_kind, two_box_questions  # noqa: E402


def two_box_accuracy(decoder, positions, word_id: dict[str, int], sampler: dp.SymbolicScenes,
                     next_to: bool) -> float:
    """First-token accuracy on 512 digit questions of two boxes: left/right, or next-to."""
    held = two_box_questions(sampler, np.random.default_rng(777), next_to)
    decoder.eval()
    with torch.no_grad():
        right = accuracy_by_kind(decoder, positions, word_id, held)["digit"]
    decoder.train()
    return round(float(np.mean(right)), 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("name")
    ap.add_argument("--snapshot", type=Path, required=True)
    ap.add_argument("--vlmopt", required=True)
    ap.add_argument("--work", type=Path, required=True)
    a, train_args = ap.parse_known_args()
    pretrain = dp.pretrain
    state = {"main_done": False}

    def first_phases_from_snapshot(lm, positions, *args, **kwargs):
        # The main mix is the one phase without a kinds list; --prestage-position-first's comes before it.
        first = not state["main_done"]
        is_main = kwargs.get("kinds") is None
        if first and a.snapshot.exists():
            if is_main:
                tensors = load_file(str(a.snapshot))
                torch.set_rng_state(tensors.pop("rng_state"))
                lm.load_state_dict({k.removeprefix("decoder."): v for k, v in tensors.items()
                                    if k.startswith("decoder.")})
                positions.load_state_dict({k.removeprefix("positions."): v for k, v in tensors.items()
                                           if k.startswith("positions.")}, strict=False)
                state["main_done"] = True
                print(f"[screen] first phases from {a.snapshot}", file=sys.stderr, flush=True)
            return []
        entries = pretrain(lm, positions, *args, **kwargs)
        if first and is_main:
            tensors = {f"decoder.{k}": v.contiguous() for k, v in lm.state_dict().items()}
            tensors.update({f"positions.{k}": v.contiguous() for k, v in positions.state_dict().items()})
            tensors["rng_state"] = torch.get_rng_state()
            save_file(tensors, str(a.snapshot))
            state["main_done"] = True
            print(f"[screen] saved the first phases -> {a.snapshot}", file=sys.stderr, flush=True)
        return entries

    def stop_after_prestage(work, key, stage, what, train):
        if what != "decoder pre-stage":
            raise RuntimeError(f"the screen reached the {what} (expected to stop after the pre-stage)")
        log = train()
        vocab = json.loads(tb.run_vlmopt(a.vlmopt, "--json", "datasets", "vocab"))
        word_id = tb.build_tokenizer(vocab["words"]).get_vocab()
        scenes = dp.SymbolicScenes(vocab["answers"]["shape"], vocab["answers"]["color"], tb.SHAPE_PLURALS, False,
                                   count_layouts=True, generator_boxes=True)
        decoder, positions = stage["decoder"], stage["positions"]
        print(json.dumps({"name": a.name, "end": log[-1],
                          "digit_side": two_box_accuracy(decoder, positions, word_id, scenes, next_to=False),
                          "digit_next_to": two_box_accuracy(decoder, positions, word_id, scenes, next_to=True)}),
              flush=True)
        raise SystemExit(0)

    dp.pretrain = first_phases_from_snapshot
    tb.cached_stage = stop_after_prestage
    sys.argv = ["train_builtin.py", "--vlmopt", a.vlmopt, "--work", str(a.work),
                "--out", str(a.work / f"screen-{a.name}"), *train_args]
    tb.main()
    raise SystemExit("train_builtin.py ran no decoder pre-stage (--decoder-prestage-steps 0?)")


if __name__ == "__main__":
    sys.exit(main())
