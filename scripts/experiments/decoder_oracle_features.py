#!/usr/bin/env python3
"""Can the builtin model's decoder learn the visual questions from perfect features? (issue 3)

Trains the builtin model's LLaMA decoder (4 x 256, same tokenizer, prompt and
derived turns as scripts/train_builtin.py) with no vision tower: every image
token's input embedding is an *oracle* feature built from the scene layout the
pack stores, the sum of learned embeddings of the patch's shape, colour, size,
digit and object-centre labels (background = label 0) plus a learned embedding
of the patch position. If the answers still plateau, the decoder's optimisation
is the bottleneck; if they climb, the vision features' quality/format is.
Prints the held-out teacher-forced first-answer-token accuracy (first 256 of
the calibration pack, like train_builtin.py) every --eval-every steps.

    scripts/experiments/decoder_oracle_features.py --vlmopt build/apps/vlmopt/vlmopt \\
        --train WORK/train-28800.h5 --held WORK/calib.h5 [--steps 300 --lr 5e-4]
        [--template 'USER: {question}\\n<image> ASSISTANT:'] [--balanced-turns] [--curriculum]
        [--aligned [--init-decoder DECODER.safetensors]]

--aligned swaps the learned label tables for the decoder's own word embeddings
(AlignedOracleFeatures); --init-decoder continues from a decoder that
decoder_colour_lookup.py --save wrote.

Also logs each 25 steps' training first-turn accuracy per question type, so a
held-out plateau can be told apart from a failure to fit the training batches.
"""
import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_builtin as tb  # noqa: E402
from transformers import LlavaForConditionalGeneration  # noqa: E402


class OracleFeatures(torch.nn.Module):
    """[B, 144] per-patch labels (train_builtin.patch_targets) -> [B, 144, hidden] embeddings."""

    def __init__(self, hidden: int):
        super().__init__()
        self.tables = torch.nn.ModuleDict({k: torch.nn.Embedding(n, hidden) for k, n in tb.AUX_HEADS.items()})
        self.position = torch.nn.Embedding(tb.GRID * tb.GRID, hidden)
        for t in [*self.tables.values(), self.position]:
            torch.nn.init.normal_(t.weight, std=0.02)

    def forward(self, targets: dict) -> torch.Tensor:
        out = self.position.weight.unsqueeze(0)
        for k, table in self.tables.items():
            out = out + table(targets[k].clamp_min(0))  # rim patches (IGNORE) count as background
        return out


def save_decoder(path: str, lm, head, oracle) -> None:
    """Decoder + head + oracle tables (tied tensors are stored once: safetensors' save_model)."""
    safetensors.torch.save_model(torch.nn.ModuleDict({"lm": lm, "head": head, "oracle": oracle}), path)


def load_decoder(path: str, lm, head, oracle) -> None:
    missing, unexpected = safetensors.torch.load_model(
        torch.nn.ModuleDict({"lm": lm, "head": head, "oracle": oracle}), path, strict=True)
    if missing or unexpected:
        raise SystemExit(f"{path}: missing {missing}, unexpected {unexpected}")


def load_symbolic_decoder(path: str, lm, oracle: "AlignedOracleFeatures") -> None:
    """Decoder weights of decoder_symbolic_scenes.py --save (one token per object, tied head) into
    this harness's decoder; its row/column embeddings become the per-patch position table."""
    state = safetensors.torch.load_file(path)
    prefix = "lm.model."
    inner = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    if "embed_tokens.weight" not in inner:  # tied: safetensors' save_model kept the head's name only
        inner["embed_tokens.weight"] = state["lm.lm_head.weight"]
    missing, unexpected = lm.load_state_dict(inner, strict=False)
    if missing or unexpected:
        raise SystemExit(f"{path}: decoder tensors missing {missing}, unexpected {unexpected}")
    grid = torch.arange(tb.GRID * tb.GRID)
    with torch.no_grad():
        oracle.position.weight.copy_(state["row.weight"][grid // tb.GRID] + state["col.weight"][grid % tb.GRID])


def pooled_patch_labels(scenes: list[dict], shapes: list[str], colors: list[str]) -> dict[str, torch.Tensor]:
    """[B, 144] per-patch labels (1 + class, 0 = background) from the pooled objective's object
    masks, so every object covers >= 1 patch; "center" from train_builtin.patch_targets."""
    labels = {k: torch.zeros(len(scenes), tb.GRID * tb.GRID, dtype=torch.long) for k in tb.AUX_HEADS}
    labels["center"] = tb.patch_targets(scenes, shapes, colors)["center"]
    for b, mask, head, label in tb.pooled_targets(scenes, shapes, colors):
        labels[head][b, torch.from_numpy(mask)] = 1 + label
    return labels


class AlignedOracleFeatures(torch.nn.Module):
    """Language-aligned oracle: a patch's feature is the sum of the decoder's own input
    embeddings of its attribute words ("red" + "circle" + "small", "five" for a digit box)
    plus a learned position embedding and a learned object-centre flag. A question word
    then matches an image token by the same vector, and the answer is a copy of one of
    its components (the LLaVA idea: the projector maps into the word-embedding space)."""

    def __init__(self, embed: torch.nn.Embedding, word_ids: dict[str, list[int]], hidden: int):
        super().__init__()
        self.embed = embed  # shared with the decoder (trained with it)
        for k, ids_ in word_ids.items():  # label 1 + i -> word ids[i]; 0 (background) -> no word
            self.register_buffer(f"words_{k}", torch.tensor([0] + ids_, dtype=torch.long), persistent=False)
        self.keys = list(word_ids)
        self.center = torch.nn.Embedding(2, hidden)
        self.position = torch.nn.Embedding(tb.GRID * tb.GRID, hidden)
        for t in (self.center, self.position):
            torch.nn.init.normal_(t.weight, std=0.02)

    def forward(self, targets: dict) -> torch.Tensor:
        out = self.position.weight.unsqueeze(0) + self.center(targets["center"].clamp_min(0))
        for k in self.keys:
            label = targets[k].clamp_min(0)
            words = getattr(self, f"words_{k}")[label]
            out = out + self.embed(words) * (label > 0).unsqueeze(-1).to(out.dtype)
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vlmopt", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--held", required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--schedule-steps", type=int, default=900, help="cosine length (as the real run's)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--extra-turns", type=int, default=3)
    ap.add_argument("--attn-guide-weight", type=float, default=0.3)
    ap.add_argument("--attn-guide-layer", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=75)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pooled-masks", action=argparse.BooleanOptionalAction, default=True,
                    help="label patches with the pooled objective's masks (default; --no-pooled-masks: the "
                         "per-patch targets, which miss small objects: the session-7 runs)")
    ap.add_argument("--balanced-turns", action="store_true", help="derived turns drawn round-robin by kind")
    ap.add_argument("--curriculum", action="store_true",
                    help="first third of the steps on 1-item scenes, second third on <= 2 items, then all")
    ap.add_argument("--aligned", action="store_true",
                    help="oracle features are sums of the decoder's word embeddings of the patch's attributes, "
                         "lm_head tied to them (AlignedOracleFeatures)")
    ap.add_argument("--init-decoder", default=None,
                    help="start from decoder_colour_lookup.py --save (same --aligned setting)")
    ap.add_argument("--init-symbolic", default=None,
                    help="start from decoder_symbolic_scenes.py --save: its decoder, tied embeddings, and "
                         "row + column embeddings as the patch-position table")
    ap.add_argument("--template", default=tb.PROMPT_TEMPLATE, help="prompt template ({question}, <image>)")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)

    run = lambda *a: subprocess.run([args.vlmopt, *a], check=True, capture_output=True, text=True).stdout
    vocab = json.loads(run("--json", "datasets", "vocab"))
    shapes, colors = vocab["answers"]["shape"], vocab["answers"]["color"]
    max_count = len(vocab["answers"]["count"]) - 1
    tok = tb.build_tokenizer(vocab["words"])
    ids = {s: tok.token_to_id(s) for s in tb.SPECIALS}
    config = tb.make_config(tok.get_vocab_size(), ids["<image>"], ids)
    model = LlavaForConditionalGeneration(config)
    guide = args.attn_guide_weight > 0
    if guide:
        model.set_attn_implementation("eager")
    lm, head = model.model.language_model, model.lm_head
    if args.aligned:
        answers = vocab["answers"]
        word_ids = {k: [tok.token_to_id(w) for w in answers[k]] for k in ("shape", "color", "size", "digit")}
        oracle = AlignedOracleFeatures(lm.embed_tokens, word_ids, config.text_config.hidden_size)
        head.weight = lm.embed_tokens.weight  # the answer is a copy of an image token's component
    else:
        oracle = OracleFeatures(config.text_config.hidden_size)
    if args.init_decoder:
        load_decoder(args.init_decoder, lm, head, oracle)
    if args.init_symbolic:
        if not args.aligned:
            raise SystemExit("--init-symbolic needs --aligned (the symbolic decoder reads word-embedding sums)")
        load_symbolic_decoder(args.init_symbolic, lm, oracle)
    # Unique tensors only (the aligned oracle shares embed_tokens, the tied head shares its weight).
    params = list({id(p): p for p in [*lm.parameters(), *head.parameters(), *oracle.parameters()]}.values())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    train, held = tb.Pack(args.train), tb.Pack(args.held)

    def oracle_labels(scenes):
        """Per-patch labels from the pooled objective's masks (every object covers >= 1 patch).

        train_builtin.patch_targets marks only patches within 0.65 r of an object's centre, so
        a small object (r 7-9 px) can have no labelled patch at all and be invisible here
        (18 of the 648 objects of the first 256 calib scenes)."""
        if not args.pooled_masks:
            return tb.patch_targets(scenes, shapes, colors)
        return pooled_patch_labels(scenes, shapes, colors)

    def forward(input_ids, attn, scenes, attentions=False):
        embeds = lm.embed_tokens(input_ids)
        feats = oracle(oracle_labels(scenes))  # [B, 144, hidden]
        image = input_ids == ids["<image>"]
        embeds = embeds.masked_scatter(image.unsqueeze(-1), feats.to(embeds.dtype))
        out = lm(inputs_embeds=embeds, attention_mask=attn, output_attentions=attentions)
        return head(out.last_hidden_state), (out.attentions if attentions else None)

    def held_accuracy(n=256):
        return tb.quick_eval(lm, tok, held, ids, n, 64,
                             logits_fn=lambda input_ids, attn, _imgs, idx: forward(input_ids, attn,
                                                                                   held.scenes(idx))[0],
                             template=args.template)

    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(train))
    if args.curriculum:
        # Few items first: with one object in the scene, pooling every patch already answers a
        # colour/shape question, so the answer readout can be learned before the lookup.
        items = np.array([len(m.get("objects", [])) + len(m.get("digits", []))
                          for m in (json.loads(x) for x in train.meta[:])])
        third = args.steps * args.batch // 3
        first = order[items[order] <= 1][:third]
        rest = order[~np.isin(order, first)]
        second = rest[items[rest] <= 2][:third]  # disjoint from the first stage: no scene twice
        early = np.concatenate([first, second])
        order = np.concatenate([early, order[~np.isin(order, early)]])  # the rest keeps its random order
    t0 = time.time()
    train_by_type = {}
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / args.schedule_steps))
        for g in opt.param_groups:
            g["lr"] = lr
        idx = order[step * args.batch:(step + 1) * args.batch]
        _, qs, ans, types = train.batch(idx)
        scenes = train.scenes(idx)
        extra = [tb.derived_turns(sc, shapes, colors, max_count, rng, args.extra_turns, args.balanced_turns)
                 for sc in scenes]
        input_ids, attn, lab, turns = tb.encode_batch(tok, qs, ans, ids, extra, return_turns=True,
                                                       template=args.template)
        logits, attentions = forward(input_ids, attn, scenes, attentions=guide)
        answer = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), lab[:, 1:].flatten(),
                                                   ignore_index=-100)
        loss = answer
        if guide:
            loss = loss + args.attn_guide_weight * tb.attention_guidance_loss(
                attentions, input_ids, turns, scenes, ids["<image>"], args.attn_guide_layer, shapes, colors)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        # First-turn (the generator's own question) accuracy on this training batch, per type.
        for i, t in enumerate(types):
            pos = int((lab[i] != -100).nonzero()[0])
            c, n = train_by_type.get(t, (0, 0))
            train_by_type[t] = (c + int(logits[i, pos - 1].argmax() == lab[i, pos]), n + 1)
        if step % 25 == 0 or step == args.steps - 1:
            entry = {"step": step, "answer_loss": round(float(answer.detach()), 4), "s": round(time.time() - t0, 1),
                     "train_first_turn_by_type": {k: round(c / n, 2) for k, (c, n) in sorted(train_by_type.items())}}
            train_by_type.clear()
            if (step % args.eval_every == 0 and step > 0) or step == args.steps - 1:
                entry["heldout_acc"], entry["by_type"] = held_accuracy()
            print(json.dumps(entry), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
