#!/usr/bin/env python3
"""Times decoder_prestage.aligned_targets (the vision stage's per-batch alignment targets) against the
same function at another git revision, and checks that both give the same tensor bit for bit.

    scripts/bench/align_targets.py --vlmopt build/apps/vlmopt/vlmopt --pack WORK/train-50000.h5
        [--reference-rev a41431b] [--batches 20] [--threads 1]

WORK/train-50000.h5: the training pack train_builtin.py writes into its --work (`vlmopt datasets pack
builtin:train`). The word embeddings and position table are random (the targets' cost does not depend
on their values); the scenes, items and the count tags' rotations are as in the vision stage, under its
bf16 autocast. Prints one JSON line: seconds per batch of 64 scenes for both, and whether they agree.
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
import decoder_prestage as dp  # noqa: E402
import train_builtin as tb  # noqa: E402
from git_revision import module_at  # noqa: E402

COUNT_TAGS = ("count_color", "count_shape")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vlmopt", required=True, help="the vlmopt binary (its generator's vocabulary)")
    ap.add_argument("--pack", required=True, type=Path)
    ap.add_argument("--reference-rev", default="a41431b", help="git revision to compare with (default: the "
                                                               "last one with one masked add per item)")
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    vocab = json.loads(tb.run_vlmopt(args.vlmopt, "--json", "datasets", "vocab"))
    colors, shapes, words = vocab["answers"]["color"], vocab["answers"]["shape"], vocab["words"]
    word_id = {w: i for i, w in enumerate(words)}
    hidden = 128
    embed = torch.randn(len(words), hidden, generator=torch.Generator().manual_seed(0))
    tag_words = {t: [word_id[w] for w in dp.TAG_WORDS[t]] for t in COUNT_TAGS}
    pack = tb.Pack(args.pack)
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        reference = module_at(args.reference_rev, "scripts/decoder_prestage.py", Path(tmp))
        impls = {"current": (dp, dp.PositionTable(hidden, None, tag_words)),
                 args.reference_rev: (reference, reference.PositionTable(hidden, None, tag_words))}
        impls[args.reference_rev][1].load_state_dict(impls["current"][1].state_dict())
        seconds = {name: 0.0 for name in impls}
        equal = True
        for _ in range(args.batches):
            idx = np.unique(rng.choice(len(pack), 64, replace=False))
            scenes = pack.scenes(idx)
            items = tb.pooled_targets(scenes, shapes, colors, object_centres=True, tags=COUNT_TAGS)
            outs = []
            for name, (module, positions) in impls.items():
                table = positions.table(embed).detach()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    start = time.perf_counter()
                    outs.append(module.aligned_targets(scenes, items, embed, table, word_id, shapes, colors, positions))
                    seconds[name] += time.perf_counter() - start
            equal &= outs[0].dtype == outs[1].dtype and torch.equal(outs[0], outs[1])
    print(json.dumps({"batches": args.batches, "threads": args.threads, "bitwise_equal": bool(equal),
                      "s_per_batch": {k: round(v / args.batches, 4) for k, v in seconds.items()}}))
    if not equal:
        sys.exit(1)


if __name__ == "__main__":
    main()
