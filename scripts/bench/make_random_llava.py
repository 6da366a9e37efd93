#!/usr/bin/env python3
"""Writes a random, LLaVA-shaped checkpoint for benchmarks: a bigger decoder behind a real model's front end.

The new model keeps the vision tower config, image token, projector settings,
tokenizer and processor files of `--like` (normally models/builtin), so the
same datasets, prompt template and image preprocessing apply unchanged, and
replaces the LLaMA decoder with one of the requested size. Weights are
transformers' own random initialisation (nothing is trained): the checkpoint is
for timing and memory measurements, not accuracy.

    scripts/bench/make_random_llava.py --like models/builtin --layers 24 --hidden 1024 \\
        --intermediate 2816 --heads 16 --kv-heads 8 --out /tmp/llava-large [--seed 0]

Deterministic in the seed (same seed and sizes -> same tensors). The directory
is written with save_pretrained (safetensors) into a temporary sibling and
renamed into place, so an interrupted run leaves no half checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

# Files of --like that describe weights or training, not the front end: never copied.
SKIP_FILES = {"config.json", "generation_config.json", "model.safetensors.index.json", "vlmopt_training.json"}


def build_config(like: dict, args: argparse.Namespace) -> LlavaConfig:
    text_like = like["text_config"]
    if args.hidden % args.heads != 0:
        raise SystemExit(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    if args.heads % args.kv_heads != 0:
        raise SystemExit(f"--heads {args.heads} is not divisible by --kv-heads {args.kv_heads}")
    rope_theta = text_like.get("rope_theta", (text_like.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    text = LlamaConfig(
        vocab_size=text_like["vocab_size"], hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=text_like.get("max_position_embeddings", 512),
        rms_norm_eps=text_like.get("rms_norm_eps", 1e-6), rope_theta=rope_theta,
        bos_token_id=text_like.get("bos_token_id"), eos_token_id=text_like.get("eos_token_id"),
        pad_token_id=text_like.get("pad_token_id"), tie_word_embeddings=False)
    # The vision config is taken verbatim: the tower and its preprocessing stay those of --like.
    keep = {k: like[k] for k in ("image_token_index", "image_seq_length", "vision_feature_layer",
                                  "vision_feature_select_strategy", "projector_hidden_act",
                                  "multimodal_projector_bias") if k in like}
    if "image_token_index" not in keep and "image_token_id" in like:
        keep["image_token_index"] = like["image_token_id"]
    return LlavaConfig(vision_config=like["vision_config"], text_config=text.to_dict(), **keep)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--like", required=True, help="LLaVA checkpoint whose vision tower, tokenizer and processor are reused")
    ap.add_argument("--layers", type=int, default=24, help="decoder layers")
    ap.add_argument("--hidden", type=int, default=1024, help="decoder hidden size")
    ap.add_argument("--intermediate", type=int, default=2816, help="decoder MLP size")
    ap.add_argument("--heads", type=int, default=16, help="attention heads")
    ap.add_argument("--kv-heads", type=int, default=8, help="key/value heads (grouped-query attention)")
    ap.add_argument("--out", required=True, help="output directory (replaced if it exists)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    like_dir, out = Path(args.like), Path(args.out)
    like_config = json.loads((like_dir / "config.json").read_text())
    if like_config.get("model_type") != "llava":
        raise SystemExit(f"{like_dir / 'config.json'}: model_type: expected llava, got {like_config.get('model_type')!r}")

    config = build_config(like_config, args)
    torch.manual_seed(args.seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the checkpoint is meant to be shared
        model.save_pretrained(tmp, safe_serialization=True)
        copied = []
        for src in sorted(like_dir.iterdir()):
            if src.is_file() and src.name not in SKIP_FILES and not src.name.endswith(".safetensors"):
                shutil.copy2(src, tmp / src.name)
                copied.append(src.name)
        (tmp / "vlmopt_random.json").write_text(json.dumps({
            "script": "scripts/bench/make_random_llava.py", "like": str(like_dir), "seed": args.seed,
            "layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate,
            "heads": args.heads, "kv_heads": args.kv_heads, "parameters": n_params, "copied": copied,
            "torch": torch.__version__, "transformers": __import__("transformers").__version__}, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"wrote {out}: {n_params / 1e6:.1f} M parameters ({args.layers} layers, hidden {args.hidden}), "
          f"copied {', '.join(copied)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
