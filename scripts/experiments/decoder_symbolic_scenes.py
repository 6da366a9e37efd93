#!/usr/bin/env python3
"""Can the builtin decoder learn the whole question mix when each object is one token? (issue 3)

Session 9 located the builtin model's plateau in the from-scratch decoder's
routing (find the patches a question names, then read them) and showed that on
one question template it forms abruptly after ~450 steps. This runs the
decoder pre-stage of scripts/decoder_prestage.py on its own, with no vision
tower, no image and no vlmopt build: symbolic scenes, one token per object
(the sum of the decoder's word embeddings of its attributes plus learned row and
column embeddings, at its centre patch's RoPE position), lm_head tied to the
embeddings, the builtin decoder config (4 x 256, GQA).

    scripts/experiments/decoder_symbolic_scenes.py [--steps 3000] [--batch 64]
        [--lr 1e-3] [--kinds color,shape,...] [--mimetic ALPHA] [--side-words] [--next-to] [--count-layouts] [--save F]
        [--init CACHE] [--relation-words W,...] [--comparator-weight W] [--horizontal-share P]
        [--comparator-axis-weights WX,WY] [--save-stage F]

Prints held-out first-answer-token accuracy per kind (1024 fixed samples) every
--eval-every steps. --save writes the decoder ("lm.model.*", tied head as
"lm.lm_head.weight") and the position embeddings ("row.weight", "col.weight"),
which decoder_oracle_features.py --init-symbolic reads; --save-stage writes the
format of train_builtin.py's pre-stage cache, which --init reads (to chain phases).
At the end it prints relation accuracy per relation word (1024 fixed relation
questions, the four words).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import decoder_prestage as dp  # noqa: E402

# The generator's attribute words (`vlmopt datasets vocab`); listed here so this runs without a build.
SHAPES = ["circle", "square", "triangle", "star", "cross"]
COLORS = ["red", "green", "blue", "yellow", "orange", "purple"]
PLURALS = {"circle": "circles", "square": "squares", "triangle": "triangles", "star": "stars", "cross": "crosses"}


def mimetic_init(lm: LlamaForCausalLM, alpha: float) -> None:
    """W_q W_k^T ~ alpha * (a 32-dim projection of I) per head (Trockman & Kolter 2023, "Mimetic
    initialization of self-attention layers"): at step 0 a token attends to the tokens whose
    embeddings resemble its own, the match a lookup needs, instead of uniformly."""
    cfg = lm.config
    d, hd = cfg.hidden_size, cfg.head_dim
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    with torch.no_grad():
        for layer in lm.model.layers:
            att = layer.self_attn
            basis = torch.linalg.qr(torch.randn(d, d))[0]  # orthonormal columns
            k_w, q_w = torch.zeros_like(att.k_proj.weight), torch.zeros_like(att.q_proj.weight)
            for g in range(cfg.num_key_value_heads):
                sub = basis[:, (g * hd) % d:(g * hd) % d + hd].T  # [hd, d]
                k_w[g * hd:(g + 1) * hd] = sub
                for h in range(g * group, (g + 1) * group):
                    q_w[h * hd:(h + 1) * hd] = alpha * sub
            att.k_proj.weight.copy_(k_w + 0.02 * torch.randn_like(k_w))
            att.q_proj.weight.copy_(q_w + 0.02 * torch.randn_like(q_w))


def relation_by_word(decoder, positions: dp.PositionTable, word_id: dict[str, int], count_layouts: bool,
                     n: int = 1024) -> dict[str, float]:
    """First-answer-token accuracy on n fixed relation questions (the four words), per word."""
    sampler = dp.SymbolicScenes(SHAPES, COLORS, PLURALS, False, count_layouts=count_layouts)
    rng = np.random.default_rng(123)
    held = [sampler.sample(rng, ["relation"]) for _ in range(n)]
    acc: dict[str, list[bool]] = {}
    decoder.eval()
    with torch.no_grad():
        for i in range(0, n, 256):
            b = dp.collate(held[i:i + 256], word_id)
            pred = dp.logits(decoder, positions, b)[torch.arange(len(held[i:i + 256])), b["answer_pos"]].argmax(-1)
            for (_, _, q, _), ok in zip(held[i:i + 256], (pred == b["answer"]).tolist()):
                acc.setdefault(next(w for w in dp.RELATION_WORDS if f" {w} the " in q), []).append(ok)
    return {w: round(float(np.mean(v)), 3) for w, v in sorted(acc.items())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--kinds", default=",".join(dp.KINDS))
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--held", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mimetic", type=float, default=0.0, help="alpha of a mimetic attention init (0 = HF default)")
    ap.add_argument("--save", default=None)
    ap.add_argument("--init", default=None,
                    help="start from a train_builtin.py pre-stage cache (--work/decoder-prestage-*.safetensors)")
    ap.add_argument("--next-to", action="store_true", help="also the digit-next-to-object layout")
    ap.add_argument("--count-layouts", action="store_true",
                    help="count questions on the generator's count layouts, answers zero..five uniform "
                         "(decoder_prestage.SymbolicScenes.count_sample)")
    ap.add_argument("--side-words", action="store_true",
                    help="add each token's side in word-embedding space (decoder_prestage.PositionTable)")
    ap.add_argument("--relation-words", default="left of,right of,above,below",
                    help="the relation words asked (session 17: \"left of\" alone is learned, all four are not)")
    ap.add_argument("--comparator-weight", type=float, default=0.0,
                    help="weight of the probe on relation questions' comparison (decoder_prestage.comparator_targets)")
    ap.add_argument("--horizontal-share", type=float, default=None,
                    help="draw \"left of\" / \"right of\" with this probability, else \"above\" / \"below\" "
                         "(SymbolicScenes.horizontal_share; overrides --relation-words)")
    ap.add_argument("--comparator-axis-weights", default="1,1",
                    help="the probe's horizontal,vertical target weights (session 18: the axis weighted up forms first)")
    ap.add_argument("--save-stage", default=None, help="write the decoder and positions as train_builtin's cache")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    word_id = json.loads((ROOT / "models/builtin/tokenizer.json").read_text())["model"]["vocab"]
    base = json.loads((ROOT / "models/builtin/config.json").read_text())["text_config"]
    for key in ("architectures", "dtype", "transformers_version", "model_type"):
        base.pop(key, None)
    base.update(vocab_size=len(word_id), tie_word_embeddings=True)
    lm = LlamaForCausalLM(LlamaConfig(**base))
    if args.mimetic > 0:
        mimetic_init(lm, args.mimetic)
    side = tuple(word_id[w] for w in ("left", "right", "top", "bottom")) if args.side_words else None
    positions = dp.PositionTable(lm.config.hidden_size, side)
    if args.init:
        import safetensors.torch
        stage = torch.nn.ModuleDict({"decoder": lm.model, "positions": positions})
        stage.load_state_dict(safetensors.torch.load_file(args.init), strict=True)
    sampler = dp.SymbolicScenes(SHAPES, COLORS, PLURALS, args.next_to, count_layouts=args.count_layouts,
                                 relation_words=tuple(args.relation_words.split(",")),
                                 horizontal_share=args.horizontal_share)
    dp.pretrain(lm.model, positions, sampler, word_id, steps=args.steps,
                batch=args.batch, lr=args.lr, seed=args.seed, kinds=args.kinds.split(","),
                eval_every=args.eval_every, held=args.held, comparator_weight=args.comparator_weight,
                comparator_axis_weights=tuple(float(w) for w in args.comparator_axis_weights.split(",")))
    print(json.dumps({"relation_by_word": relation_by_word(lm.model, positions, word_id, args.count_layouts)}))
    if args.save_stage:
        import safetensors.torch
        safetensors.torch.save_model(torch.nn.ModuleDict({"decoder": lm.model, "positions": positions}), args.save_stage)
    if args.save:
        import safetensors.torch
        safetensors.torch.save_model(torch.nn.ModuleDict({"lm": lm, "row": positions.row, "col": positions.col}),
                                     args.save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
