#!/usr/bin/env python3
"""Runs the decoder pre-stage's first phase alone, ~2 min instead of a 28-minute run (issue 3, session 38).

The first phase (train_builtin.py --prestage-position-first: size, position and count questions)
either forms the reading of an object's side or stalls for good, and a stalled one leaves the main
mix without its colour and shape routing (seed 2: 0.7715 on builtin:eval). This runs
train_builtin.py with the given arguments up to that phase's end and prints one JSON line: the
held-out first-token accuracy of position at each check, and every kind's at the end.

    prestage_first_phase.py NAME --vlmopt V --work W [--draw-seed D] [--lr LR] [--warmup N]
        [--kinds size,position,count,count] [--eval-every 125] [train_builtin.py args]

  - `--seed` (a train_builtin.py argument) sets the initial weights, as in a full run;
    --draw-seed D makes the phase draw its scenes (and its held-out set) as seed D's would,
    apart from the initial weights.
  - --lr, --warmup and --kinds override that phase's own; without them the phase runs exactly
    as in a full run with the same arguments.
  - W: a --work folder holding the packs (train-*.h5, calib.h5); no stage is read or written.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import decoder_prestage as dp  # noqa: E402
import train_builtin as tb  # noqa: E402

# train_builtin.py draws the first phase with seed + 4 (its phases' seeds are offsets of --seed).
FIRST_PHASE_SEED_OFFSET = 4


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("name")
    ap.add_argument("--vlmopt", required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--draw-seed", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--kinds", default=None)
    ap.add_argument("--eval-every", type=int, default=125)
    a, train_args = ap.parse_known_args()
    pretrain = dp.pretrain

    def first_phase_only(lm, positions, *args, **kwargs):
        if a.draw_seed is not None:
            kwargs["seed"] = a.draw_seed + FIRST_PHASE_SEED_OFFSET
        overrides = {"lr": a.lr, "warmup": a.warmup, "kinds": a.kinds.split(",") if a.kinds else None}
        kwargs.update({k: v for k, v in overrides.items() if v is not None}, eval_every=a.eval_every,
                      log=lambda *_: None)
        entries = pretrain(lm, positions, *args, **kwargs)
        print(json.dumps({"name": a.name, "position": [(e["prestage_step"], e["by_kind"].get("position"))
                                                        for e in entries],
                          "end": entries[-1]["by_kind"]}), flush=True)
        raise SystemExit(0)

    dp.pretrain = first_phase_only
    sys.argv = ["train_builtin.py", "--vlmopt", a.vlmopt, "--work", str(a.work),
                "--out", str(a.work / f"first-phase-{a.name}"), *train_args]
    tb.main()
    raise SystemExit("train_builtin.py ran no decoder pre-stage phase (--decoder-prestage-steps 0?)")


if __name__ == "__main__":
    sys.exit(main())
