#!/usr/bin/env python3
"""Which half of a visual question is slow for the builtin decoder to learn: the copy or the routing? (issue 3)

Trains the builtin model's 4 x 256 LLaMA decoder from scratch on one question
template only, "what color is the <shape> ?", with oracle image features
(decoder_oracle_features.py: --aligned sums the decoder's own word embeddings
of each patch's attributes and ties lm_head to them; otherwise learned
per-label tables). Scenes come from a train pack written by `vlmopt datasets
pack builtin:train`:

  --min-objects 1  scenes with exactly one object: the answer is a copy of the
                   colour every object patch carries, no routing needed;
  --min-objects 2  scenes with >= 2 objects, asking about an object whose shape
                   is unique: the answer position must first find the patches
                   of the named shape (route), then copy their colour.

Prints the training-batch colour accuracy every 10 steps (every batch is new
scenes drawn from the pack, with replacement across steps).

    scripts/experiments/decoder_colour_lookup.py --vlmopt build/apps/vlmopt/vlmopt \\
        --train WORK/train-28800.h5 [--min-objects 2] [--aligned] [--lr 1e-3] [--steps 150]
        [--attn-guide-weight 0.3] [--background-keep 0.1] [--save decoder.safetensors] [--template 'USER: {question}\n<image> ASSISTANT:']

--all-templates trains every lookup direction at once (a decoder pre-stage for
the full question mix); --min-objects does not apply then.

--background-keep P feeds the decoder only the image tokens of objects and
digit boxes plus each background patch with probability P, at their original
RoPE positions (token dropping during training, as FLIP does for CLIP): shorter
sequences make a step cheaper and leave the answer position fewer tokens to
search.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_builtin as tb  # noqa: E402
import decoder_oracle_features as dof  # noqa: E402
from transformers import LlavaForConditionalGeneration  # noqa: E402


def unique_shape_objects(scene: dict) -> list[dict]:
    shapes = [o["shape"] for o in scene.get("objects", [])]
    return [o for o in scene.get("objects", []) if shapes.count(o["shape"]) == 1]


def drop_tokens(keep, input_ids, embeds, attn, lab, positions, pad_id):
    """Keeps the tokens where keep [B, T] is true, left-aligned and right-padded; each kept token
    keeps its original position id."""
    n = keep.sum(1)
    T = int(n.max())
    out_ids = torch.full((keep.size(0), T), pad_id, dtype=input_ids.dtype)
    out_emb = embeds.new_zeros(keep.size(0), T, embeds.size(-1))
    out_attn = torch.zeros_like(out_ids)
    out_lab = torch.full_like(out_ids, -100)
    out_pos = torch.zeros_like(out_ids)
    for b in range(keep.size(0)):
        idx = keep[b].nonzero().squeeze(1)
        k = idx.numel()
        out_ids[b, :k], out_emb[b, :k], out_lab[b, :k] = input_ids[b, idx], embeds[b, idx], lab[b, idx]
        out_attn[b, :k] = 1
        out_pos[b, :k] = positions[b, idx]
        # Padding continues the positions (any value works: it is masked out).
        out_pos[b, k:] = positions[b, idx[-1]] + 1 + torch.arange(T - k)
    return out_ids, out_emb, out_attn, out_lab, out_pos


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vlmopt", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--min-objects", type=int, default=2, help="1: exactly one object; N > 1: at least N")
    ap.add_argument("--all-templates", action="store_true",
                    help="instead of the colour template: one of train_builtin's derived questions per scene "
                         "(colour, shape, size, position, count, exist, digit lookups; kinds drawn uniformly)")
    ap.add_argument("--aligned", action="store_true", help="word-embedding oracle features, tied lm_head")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3, help="constant after a 20-step warmup")
    ap.add_argument("--attn-guide-weight", type=float, default=0.0,
                    help="train_builtin's attention guidance at layer 2 (0: off)")
    ap.add_argument("--background-keep", type=float, default=1.0,
                    help="probability of keeping a background image token (1: all tokens, the default)")
    ap.add_argument("--template", default=tb.PROMPT_TEMPLATE, help="prompt template ({question}, <image>)")
    ap.add_argument("--save", default=None,
                    help="write the trained decoder, head and oracle tables here (safetensors; "
                         "decoder_oracle_features.py --init-decoder continues from it)")
    ap.add_argument("--scan", type=int, default=6000, help="scenes of the pack to draw from")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.background_keep < 1.0 and args.attn_guide_weight > 0:
        raise SystemExit("--attn-guide-weight needs all 144 image tokens (its patch indices): use one or the other")
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)

    run = lambda *a: subprocess.run([args.vlmopt, *a], check=True, capture_output=True, text=True).stdout
    vocab = json.loads(run("--json", "datasets", "vocab"))
    shapes, colors = vocab["answers"]["shape"], vocab["answers"]["color"]
    tok = tb.build_tokenizer(vocab["words"])
    ids = {s: tok.token_to_id(s) for s in tb.SPECIALS}
    config = tb.make_config(tok.get_vocab_size(), ids["<image>"], ids)
    model = LlavaForConditionalGeneration(config)
    guide = args.attn_guide_weight > 0
    model.set_attn_implementation("eager" if guide else "sdpa")
    lm, head = model.model.language_model, model.lm_head
    hidden = config.text_config.hidden_size
    if args.aligned:
        word_ids = {k: [tok.token_to_id(w) for w in vocab["answers"][k]] for k in ("shape", "color", "size", "digit")}
        oracle = dof.AlignedOracleFeatures(lm.embed_tokens, word_ids, hidden)
        head.weight = lm.embed_tokens.weight
    else:
        oracle = dof.OracleFeatures(hidden)
    params = list({id(p): p for p in [*lm.parameters(), *head.parameters(), *oracle.parameters()]}.values())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))

    pack = tb.Pack(args.train)
    scenes_all = [json.loads(x) for x in pack.meta[:args.scan]]
    max_count = len(vocab["answers"]["count"]) - 1
    if args.all_templates:
        pool = [i for i, m in enumerate(scenes_all) if m.get("objects")]
    elif args.min_objects == 1:
        pool = [i for i, m in enumerate(scenes_all) if len(m.get("objects", [])) == 1 and not m.get("digits")]
    else:
        pool = [i for i, m in enumerate(scenes_all)
                if len(m.get("objects", [])) >= args.min_objects and unique_shape_objects(m)]
    mode = "all templates" if args.all_templates else f"colour template, min objects {args.min_objects}"
    print(f"[colour-lookup] {len(pool)} scenes ({mode})", file=sys.stderr)

    rng = np.random.default_rng(args.seed)
    t0 = time.time()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, (step + 1) / 20)
        scenes = [scenes_all[i] for i in rng.choice(pool, args.batch, replace=False)]
        if args.all_templates:
            # One derived question per scene, its kind drawn uniformly among those the layout answers.
            qa = [tb.derived_turns(sc, shapes, colors, max_count, rng, 1, balanced=True)[0] for sc in scenes]
            questions, answers = [q for q, _ in qa], [a for _, a in qa]
        else:
            targets = [objs[rng.integers(len(objs))] for objs in map(unique_shape_objects, scenes)]
            questions, answers = [f"what color is the {o['shape']} ?" for o in targets], [o["color"] for o in targets]
        input_ids, attn, lab, turns = tb.encode_batch(tok, questions, answers, ids,
                                                       return_turns=True, template=args.template)
        patch_labels = dof.pooled_patch_labels(scenes, shapes, colors)
        image = input_ids == ids["<image>"]
        embeds = lm.embed_tokens(input_ids).masked_scatter(image.unsqueeze(-1), oracle(patch_labels))
        positions = torch.arange(input_ids.size(1)).expand_as(input_ids)
        if args.background_keep < 1.0:
            foreground = torch.stack([patch_labels[k] > 0 for k in tb.AUX_HEADS]).any(0)  # [B, 144]
            keep_patch = foreground | (torch.rand(foreground.shape) < args.background_keep)
            keep = attn.bool().clone()
            keep[image] = keep_patch.flatten()
            # (--attn-guide-weight is refused with dropping: its patch indices assume all 144 tokens.)
            input_ids, embeds, attn, lab, positions = drop_tokens(keep, input_ids, embeds, attn, lab, positions,
                                                                  ids["<pad>"])
        out = lm(inputs_embeds=embeds, attention_mask=attn, position_ids=positions, output_attentions=guide)
        logits = head(out.last_hidden_state)
        answer = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), lab[:, 1:].flatten(),
                                                   ignore_index=-100)
        loss = answer
        if guide:
            loss = loss + args.attn_guide_weight * tb.attention_guidance_loss(
                out.attentions, input_ids, turns, scenes, ids["<image>"], 2, shapes, colors)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            first = [int((row != -100).nonzero()[0]) for row in lab]
            acc = float(np.mean([int(logits[i, p - 1].argmax() == lab[i, p]) for i, p in enumerate(first)]))
            print(json.dumps({"step": step, "answer_loss": round(float(answer.detach()), 3),
                              "answer_acc" if args.all_templates else "colour_acc": round(acc, 2),
                              "s": round(time.time() - t0)}), flush=True)
    if args.save:
        dof.save_decoder(args.save, lm, head, oracle)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
