#!/usr/bin/env python3
"""Trains vlmopt's embedded default model (models/builtin/) with HF transformers.

The model is a genuine `LlavaForConditionalGeneration` (CLIP vision tower,
2-layer MLP projector, LLaMA decoder with grouped-query attention) shaped like
real LLaVA checkpoints at toy scale: 96x96 images, patch 8 -> 144 visual tokens
that dominate the sequence, and a decoder that dominates prefill cost.

Training data never comes from Python: the C++ dataset code is the single
source of truth, so the script asks `vlmopt datasets pack builtin:train` for an
HDF5 pack and reads it with h5py. The vocabulary of the WordLevel tokenizer is
the closed vocabulary the C++ generator reports (`vlmopt datasets vocab`).

    scripts/train_builtin.py --vlmopt build/apps/vlmopt/vlmopt [--out models/builtin]
        [--steps 1100] [--batch 32] [--seed 0]

Reproducible from the seed: a fixed number of optimizer steps (not a time
budget, so a slower or busier machine gives the same model), CPU, fixed thread
count. About 25-30 minutes on 2 idle cores. Writes the checkpoint atomically
(temp dir + rename).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                          LlavaForConditionalGeneration, LlavaProcessor, PreTrainedTokenizerFast)

# Prompt format shared with the C++ runtime (runtime::kDefaultPromptTemplate).
PROMPT_TEMPLATE = "USER: <image>\n{question} ASSISTANT:"
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<image>"]
IMAGE_SIZE, PATCH = 96, 8
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2  # "default" strategy drops CLS: 144
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def run_vlmopt(vlmopt: str, *args: str) -> str:
    res = subprocess.run([vlmopt, *args], check=True, capture_output=True, text=True)
    return res.stdout


def build_tokenizer(words: list[str]) -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for w in ["USER:", "ASSISTANT:"] + sorted(set(words)):
        if w not in vocab:
            vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return tok


def make_config(vocab_size: int, image_token_id: int, ids: dict[str, int]) -> LlavaConfig:
    vision = CLIPVisionConfig(image_size=IMAGE_SIZE, patch_size=PATCH, hidden_size=128,
                              intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                              hidden_act="quick_gelu", projection_dim=128)
    text = LlamaConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=768,
                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                       bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"],
                       tie_word_embeddings=False)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                       image_seq_length=IMAGE_TOKENS, vision_feature_layer=-2,
                       vision_feature_select_strategy="default", projector_hidden_act="gelu")


class Pack:
    """Streams one HDF5 pack written by `vlmopt datasets pack` (layout: docs/datasets.md)."""

    def __init__(self, path: Path):
        self.f = h5py.File(path, "r")
        self.images = self.f["images"]
        self.questions = self.f["questions"]
        self.answers = self.f["answers"]
        self.types = self.f["question_types"]

    def __len__(self) -> int:
        return self.images.shape[0]

    def batch(self, idx: np.ndarray):
        idx = np.sort(idx)
        imgs = self.images[idx]  # [B,H,W,3] uint8, RGB
        dec = lambda v: v.decode() if isinstance(v, bytes) else str(v)
        return (imgs, [dec(q) for q in self.questions[idx]], [dec(a) for a in self.answers[idx]],
                [dec(t) for t in self.types[idx]])


def to_pixels(imgs: np.ndarray) -> torch.Tensor:
    # The pack's images are already 96x96, so CLIP's resize and center crop are
    # identities; rescale + normalize exactly as CLIPImageProcessor does.
    x = torch.from_numpy(imgs).float().div_(255.0).permute(0, 3, 1, 2)
    mean = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    return (x - mean) / std


def encode_batch(tok: Tokenizer, questions, answers, ids, with_answer=True):
    """Left-aligned sequences: <s> USER: <image>*144 q... ASSISTANT: answer </s>; loss on answer + </s>."""
    seqs, labels = [], []
    for q, a in zip(questions, answers):
        prompt = PROMPT_TEMPLATE.format(question=q).replace("<image>", " ".join(["<image>"] * IMAGE_TOKENS))
        p_ids = tok.encode(prompt).ids
        a_ids = tok.encode(a, add_special_tokens=False).ids + [ids["</s>"]] if with_answer else []
        seqs.append(p_ids + a_ids)
        labels.append([-100] * len(p_ids) + a_ids)
    T = max(map(len, seqs))
    input_ids = torch.full((len(seqs), T), ids["<pad>"], dtype=torch.long)
    attn = torch.zeros((len(seqs), T), dtype=torch.long)
    lab = torch.full((len(seqs), T), -100, dtype=torch.long)
    for i, (s, l) in enumerate(zip(seqs, labels)):
        input_ids[i, :len(s)] = torch.tensor(s)
        attn[i, :len(s)] = 1
        lab[i, :len(l)] = torch.tensor(l)
    return input_ids, attn, lab


@torch.no_grad()
def quick_eval(model, tok, pack: Pack, ids, n: int, batch: int) -> tuple[float, dict]:
    """Teacher-forced first-answer-token accuracy on a pack (cheap progress signal)."""
    model.eval()
    correct, by_type = 0, {}
    for s in range(0, min(n, len(pack)), batch):
        idx = np.arange(s, min(s + batch, n, len(pack)))
        imgs, qs, ans, types = pack.batch(idx)
        input_ids, attn, lab = encode_batch(tok, qs, ans, ids)
        logits = model(input_ids=input_ids, attention_mask=attn, pixel_values=to_pixels(imgs)).logits
        for i in range(len(idx)):
            pos = int((lab[i] != -100).nonzero()[0])
            ok = int(logits[i, pos - 1].argmax()) == int(lab[i, pos])
            correct += ok
            c, t = by_type.get(types[i], (0, 0))
            by_type[types[i]] = (c + ok, t + 1)
    model.train()
    total = sum(t for _, t in by_type.values())
    return correct / max(total, 1), {k: round(c / t, 4) for k, (c, t) in sorted(by_type.items())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vlmopt", required=True, help="path to the vlmopt binary (dataset generator)")
    ap.add_argument("--out", default="models/builtin")
    ap.add_argument("--steps", type=int, default=1100, help="optimizer steps (each sees --batch new samples)")
    ap.add_argument("--batch", type=int, default=32)
    # 1.5e-3 and 1e-3 left the model at the language prior (it never looked at the
    # image); 3e-4 learned the visual questions in a 2026-11-30 diagnostic run.
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=None, help="scratch dir for the packs (default: a temp dir)")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    torch.set_num_threads(args.threads)
    work = Path(args.work or tempfile.mkdtemp(prefix="vlmopt-train-"))
    work.mkdir(parents=True, exist_ok=True)

    vocab_words = json.loads(run_vlmopt(args.vlmopt, "--json", "datasets", "vocab"))["words"]
    samples = args.steps * args.batch
    train_h5, calib_h5 = work / f"train-{samples}.h5", work / "calib.h5"
    if not train_h5.exists():
        print(f"[train] packing builtin:train ({samples} samples) -> {train_h5}", file=sys.stderr)
        run_vlmopt(args.vlmopt, "-q", "datasets", "pack", "builtin:train", str(train_h5), "--limit", str(samples))
    if not calib_h5.exists():
        run_vlmopt(args.vlmopt, "-q", "datasets", "pack", "builtin:calib", str(calib_h5))
    train, held = Pack(train_h5), Pack(calib_h5)

    tok = build_tokenizer(vocab_words)
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    config = make_config(tok.get_vocab_size(), ids["<image>"], ids)
    model = LlavaForConditionalGeneration(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[train] {n_params / 1e6:.2f} M parameters, vocab {tok.get_vocab_size()}", file=sys.stderr)

    steps_max = min(args.steps, len(train) // args.batch)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = 50
    # Linear warmup, then cosine decay to 0 over the fixed step count.
    sched_lr = lambda step: args.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps_max))
    log, t0, rng = [], time.time(), np.random.default_rng(args.seed)
    order = rng.permutation(len(train))
    model.train()
    step = 0
    for step in range(steps_max):
        for g in opt.param_groups:
            g["lr"] = sched_lr(step)
        imgs, qs, ans, _ = train.batch(order[step * args.batch:(step + 1) * args.batch])
        input_ids, attn, lab = encode_batch(tok, qs, ans, ids)
        loss = model(input_ids=input_ids, attention_mask=attn, pixel_values=to_pixels(imgs), labels=lab).loss
        if not torch.isfinite(loss):
            raise SystemExit(f"non-finite loss at step {step}")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0:
            entry = {"step": step, "loss": round(float(loss.detach()), 5), "lr": sched_lr(step), "s": round(time.time() - t0, 1)}
            if step % 200 == 0 and step > 0:
                entry["heldout_acc"], entry["by_type"] = quick_eval(model, tok, held, ids, 256, 64)
            log.append(entry)
            print(f"[train] {json.dumps(entry)}", file=sys.stderr)
    train_seconds = time.time() - t0
    acc, by_type = quick_eval(model, tok, held, ids, len(held), 64)
    step = steps_max
    print(f"[train] done: {step} steps, {train_seconds:.0f} s, calib first-token acc {acc:.4f} {by_type}", file=sys.stderr)

    out = Path(args.out)
    tmp = Path(tempfile.mkdtemp(prefix=".builtin-", dir=out.parent if out.parent.exists() else None))
    model.save_pretrained(tmp, safe_serialization=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", extra_special_tokens={"image_token": "<image>"})
    image_processor = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                         crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                         image_mean=CLIP_MEAN, image_std=CLIP_STD)
    # processor_config.json (LlavaProcessor: AutoProcessor.from_pretrained works),
    # then the tokenizer and preprocessor_config.json on their own for older loaders.
    LlavaProcessor(image_processor=image_processor, tokenizer=fast, patch_size=PATCH,
                   vision_feature_select_strategy="default", num_additional_image_tokens=1).save_pretrained(tmp)
    fast.save_pretrained(tmp)
    image_processor.save_pretrained(tmp)
    (tmp / "vlmopt_training.json").write_text(json.dumps({
        "script": "scripts/train_builtin.py", "args": vars(args), "steps": step, "train_seconds": round(train_seconds, 1),
        "parameters": n_params, "prompt_template": PROMPT_TEMPLATE, "calib_first_token_accuracy": acc,
        "calib_by_type": by_type, "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "log": log}, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    print(f"[train] wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
