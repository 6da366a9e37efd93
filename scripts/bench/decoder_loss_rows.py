#!/usr/bin/env python3
"""Times a decoder training step with the last layer on every position against
train_builtin.py --decoder-loss-rows (the last layer on the positions the answer loss reads),
on the pre-stage's and the joint stage's batches, and checks that both give the same loss.

    scripts/bench/decoder_loss_rows.py --vlmopt build/apps/vlmopt/vlmopt --pack WORK/train-50000.h5
        [--model models/builtin] [--batches 10] [--threads 2]

Pre-stage batches: 64 symbolic scenes of the main mix (decoder_prestage.SymbolicScenes, every
kind), collated as the stage does; a step is decoder_prestage.logits' forward, the answer
cross-entropy and the backward (eager attention). Joint batches: 32 scenes of the training pack
with 3 derived turns each (encode_batch), the decoder alone on the tower's output as fixed inputs
(its forward and backward; the tower's part of a joint step does not change). fp32. Prints one
JSON line: seconds per step (the median of the batches), tokens per row and the positions the
loss reads per row, and the largest loss difference between the two ways.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import decoder_prestage as dp  # noqa: E402
import decoder_rows  # noqa: E402
import train_builtin as tb  # noqa: E402
from transformers import LlavaForConditionalGeneration  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vlmopt", required=True, help="the vlmopt binary (its generator's vocabulary)")
    ap.add_argument("--pack", required=True, type=Path)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "builtin")
    ap.add_argument("--batches", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    vocab = json.loads(tb.run_vlmopt(args.vlmopt, "--json", "datasets", "vocab"))
    colors, shapes = vocab["answers"]["color"], vocab["answers"]["shape"]
    tok = tb.build_tokenizer(vocab["words"])
    ids = {s: tok.token_to_id(s) for s in tb.SPECIALS}
    word_id = tok.get_vocab()
    model = LlavaForConditionalGeneration.from_pretrained(args.model)
    model.set_attn_implementation("eager")
    model.train()
    decoder = model.model.language_model
    hidden = model.config.text_config.hidden_size
    positions = dp.PositionTable(hidden, tuple(word_id[w] for w in ("left", "right", "top", "bottom")))
    rows = decoder_rows.LossRows(decoder)
    rng = np.random.default_rng(1)

    sampler = dp.SymbolicScenes(shapes, colors, tb.SHAPE_PLURALS)
    prestage = [dp.collate([sampler.sample(rng, dp.KINDS) for _ in range(64)], word_id) for _ in range(args.batches)]

    def prestage_step(batch, only: bool) -> float:
        with rows.only(batch["labels"]) if only else contextlib.nullcontext():
            out = dp.logits(decoder, positions, batch)
        loss = torch.nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                                 ignore_index=decoder_rows.IGNORE)
        loss.backward()
        return float(loss.detach())

    pack = tb.Pack(args.pack)
    max_count = len(vocab["answers"]["count"]) - 1
    joint = []
    embed = model.get_input_embeddings()
    for _ in range(args.batches):
        idx = np.sort(rng.choice(len(pack), 32, replace=False))
        imgs, qs, ans, _ = pack.batch(idx)
        extra = [tb.derived_turns(sc, shapes, colors, max_count, rng, 3, True) for sc in pack.scenes(idx)]
        input_ids, attn, labels = tb.encode_batch(tok, qs, ans, ids, extra)
        with torch.no_grad():  # the tower and projector's output, placed at the image tokens
            tower = model.model.vision_tower(tb.to_pixels(imgs), output_hidden_states=True)
            image = model.model.multi_modal_projector(
                tower.hidden_states[model.config.vision_feature_layer][:, 1:])  # [32, 144, hidden]
            x = embed(input_ids)
            x[input_ids == ids["<image>"]] = image.reshape(-1, x.size(-1))
        joint.append((x, attn, labels))

    def joint_step(batch, only: bool) -> float:
        x, attn, labels = batch
        with rows.only(labels) if only else contextlib.nullcontext():
            hidden_states = decoder(inputs_embeds=x.detach().requires_grad_(True), attention_mask=attn).last_hidden_state
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden_states)[:, :-1].flatten(0, 1),
                                                 labels[:, 1:].flatten(), ignore_index=decoder_rows.IGNORE)
        loss.backward()
        return float(loss.detach())

    result = {}
    for name, batches, step in (("prestage", prestage, prestage_step), ("joint", joint, joint_step)):
        labels = [b["labels"] if isinstance(b, dict) else b[2] for b in batches]
        result[name] = {"tokens_per_row": round(float(np.mean([lab.size(1) for lab in labels])), 1),
                        "loss_rows_per_row": round(float(np.mean([int((lab[:, 1:] != decoder_rows.IGNORE).sum())
                                                                  / lab.size(0) for lab in labels])), 2)}
        losses = {}
        for only in (False, True):
            step(batches[0], only)  # warm-up
            times, values = [], []
            for batch in batches:
                model.zero_grad(set_to_none=True)
                t = time.perf_counter()
                values.append(step(batch, only))
                times.append(time.perf_counter() - t)
            losses[only] = values
            result[name]["loss_rows_s" if only else "all_positions_s"] = round(statistics.median(times), 4)
        result[name]["largest_loss_difference"] = float(max(abs(a - b) for a, b in zip(losses[False], losses[True])))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
