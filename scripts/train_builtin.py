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
        [--steps 250] [--batch 32] [--seed 0] [--work DIR]

Three stages, the LLaVA recipe turned around for a model with no pretrained parts
(docs/BENCHMARKS.md, builtin model, sessions 10-15):

1. decoder pre-stage (scripts/decoder_prestage.py, 500 + 750 + 350 + 300 + 150 + 600 steps): the decoder
   alone on symbolic scenes, each object one token made of its words' embeddings plus its
   side in word-embedding space. This is where it learns to route a question to the
   object it names, which it did not learn from images within any CPU budget tried.
   The first 500 steps ask size, position and count questions only (count drawn as often as
   the other two together: with it relation formed better, 0.8345 vs 0.8085 on images, one
   seed, session 20), at half the others' rate (--prestage-first-lr 5e-4: at 1e-3 the phase
   stalled on seed 2 and the routing never formed after it, 0.7715 on images; session 38): in the full mix the
   decoder never learned to read the side (session 12), and with count there the
   routing forms within the first 750-1000 steps of the full mix instead of ~2500
   (session 14); the mix plateaus after that (session 15). Then 350 steps of relation
   questions alone, with a probe on the comparison they ask (is the second object right
   of / below the first): a relation answer is that comparison XOR the word's polarity,
   which the answer loss alone never started, in any mix or budget (session 17). The
   steps lean first on the horizontal words, then on the vertical ones, then take all
   four evenly: evenly from the start, only the vertical comparison formed (session 18).
   Then 300 steps of digit questions (--prestage-digit-steps), five in six of them (one in six
   relation questions with the probe on, --prestage-digit-kinds), with the two digit boxes where the
   generator puts them (--prestage-generator-boxes: the left one in the image's left half): the
   two-box form ("which digit is in the left box ?") forms there, 0.38 -> 0.85 at the pre-stage's
   end (150 digit-only steps, session 22), which weighting digits in the full mix never did; on the
   AMD hosts it took 300 steps (session 23), the relation draws keep relation through them (0.57 ->
   0.93 at the pre-stage's end) and the generator's layout lets the routing transfer to images
   (left/right 50-56 of 78 right instead of 26-36; session 30: digits 0.560 -> 0.680 on images).
   Count questions come on the generator's count layouts (zero..five uniform).
   With --count-tags (session 25, the shipped model; on by default), every object's
   count tag goes on its token (decoder_prestage.TAGS: the number words of the objects of its colour
   and of its shape, each under a fixed rotation) from here on, and 150 count-only steps follow: a count
   question becomes a lookup and the vision stage learns the counting (count 0.54 -> 0.75 on
   images, 0.8520 -> 0.871 overall, on an AMD host where the digits' two-box form did not form;
   0.656-0.688 in every run since, so 0.75 was likely a lucky draw).
   Last, 600 full-mix steps (--prestage-next-to-steps) whose scenes also hold the "which digit is
   next to the X ?" layout, digit questions three times as often as each other kind, the relation
   probe at a fifth of its weight so that the mix keeps the comparisons, and a loss on one head's
   attention from the answer position to the asked box (--prestage-next-to-route-weight): that
   two-hop lookup formed in no earlier phase or mix (0.006-0.06 on symbolic scenes), and formed
   with the loss (0.92; without it 0.52, a coin between the two boxes); on images next to went
   from 22 to 38 of 61 (seed 0) and from 18 to 40 (seed 1; session 39). This phase took the place
   of the two full-mix phases that came after the relation and the count-tag phases (250 and 150
   steps: --prestage-remix-steps, --count-tag-remix-steps), which kept the recipe within 30 minutes;
2. vision stage (2000 steps, on all 50000 training scenes, --vision-pack: 2883 distinct training
   digits and 6250 count scenes; on the first 28800 the tower memorised its 2551 digits and 3592 count
   scenes, held-out digit 0.87 and count_shape 0.75 against 0.93 and 0.91, session 35): the tower on
   pooled per-object labels (shape, colour, size, digit); the projector pulled onto the pre-staged
   decoder's symbolic tokens patch by patch (--align-weight), and each object's
   and box's words read out of its mean projected feature through the decoder's
   embeddings (--readout-weight: without it the projected box features carried
   the digit at chance although the tower had it). An object's words go on its
   centre patch alone, one token per object as in the pre-stage; a box's on all
   its patches (--align-object-centres, session 20: no gain measured, 0.8085 vs 0.8125
   without; on because the shipped model was trained with it). 2000 steps, not 1000: on
   session 21's Intel host 1000 steps read 0.67 of held-out digit boxes and the model scored
   0.7955; 2000 read 0.85 and scored 0.8480 (session 22's f7; with the digit phase 0.94 and 0.8520).
   8 of every batch's scenes are count questions (--vision-count-scenes), up to six objects with zero
   to five of one colour or shape, for the count tags, which random scenes mostly ask at one or two
   (session 30: 0.8825 against 0.875 without);
3. joint stage (250 steps): everything on the answers, with the stage-2 losses
   kept on, and extra question/answer turns per image derived from the scene
   layout with the generator's templates, drawn round-robin by kind (the first
   turn is always the generator's own question, in exactly the evaluation format).
   8 of every batch's 32 scenes have digit boxes (--joint-digit-scenes; 1 in 8
   otherwise): the projected box features carried the digit (0.7-0.8 read out on
   evaluation boxes) while the decoder answered 0.36 of the digit questions (session 15).
   8 more are count questions (--joint-question-scenes count=8), zero to five evenly as
   builtin:eval asks them: the derived turns of random scenes ask mostly zero to two, and
   the decoder did not count three to five on images (count 0.47-0.49 -> 0.56, session 20).

The vision and joint stages run their forward passes under bf16 autocast (--precision bf16;
the weights, gradients, optimizer state and checkpoint stay float32): 18 % and 25 % faster
on this host's AVX512-BF16 cores, at the same accuracy (session 19). The pre-stage stays
float32: bf16 barely sped its short sequences up, and under the changed rounding its digit
routing did not form. On a CPU without bfloat16 instructions (AVX2 only, e.g. AMD Zen 2) torch's
bf16 matmuls are ~100x slower than fp32, so there the default --precision auto trains in fp32
(resolve_precision; session 41): the weights then differ from the shipped ones, as they do on any
other host. On a 2-core Zen 2 EPYC the recipe took 51.3 min so (pre-stage 872 s, vision stage 1648 s,
joint stage 504 s) and scored 0.8795, digits 0.556. Its tower read the evaluation boxes as well as the
earlier towers (319 of 389), but the answers missed many boxes it read right. So under fp32 the default
--digit-augment auto redraws the digit boxes' ink (0.5; resolve_auto): on that host 0.9135, digits
0.772, the asked box lost after a right read 28 times instead of 69 (session 42). Under bf16 it stays off.

Under fp32 two more options default to on (auto; resolve_auto): the relation phases at half the
pre-stage's rate (--prestage-relation-lr 5e-4) and two more digit boxes pasted into each vision-stage
scene (--vision-extra-boxes 2). On that host: 0.935 on builtin:eval, digits 0.860 (215 of 250), both
of issue 3's targets met, against 0.9135 and 0.772 before (95 fixed / 52 broken,
p = 0.0005); seed 1 0.9085, digits 0.872 (session 45). models/builtin from session 45 to 50 was that seed-0
run (E2s0h): on an fp32 host the defaults train it, byte for byte on the 2-core Zen 2 (session 46, from the cached
pre-stage), ~46 min fresh there (pre-stage 762 s alone, vision stage ~1500 s, joint stage 425 s), over issue 3's
30 minutes. --item-means segment --vision-patch-keep 1 (off) cut the vision stage to ~825 s there (session 47; ~34
min fresh, a variant measured 32.9 min) at accuracy not apart from the full patches; seed 0 still misses the digit
target with them (0.816), as every faster variant of its pre-stage did. Under bf16 both
options stay off (not measured there): the defaults' bf16 run (0.9245, digits 0.796) took 26.3 min on
an AVX512-BF16 host.

--ranks 2 (off) trains the vision and joint stages in two processes of one thread each, each on half of
every batch, the gradients averaged (train_ranks.py); the pre-stage runs in one of them with both threads
and is the same cache entry as without. On the 2-core Zen 2, seed 1 from session 49's cached pre-stage with
the three options above: vision stage 746 s against 885 s, joint stage 356 s against 393 s, 0.9155,
digits 0.792, against 0.925, digits 0.832 in one process (other draws; 59 fixed / 78 broken, p = 0.12;
session 50). --prestage-length-groups 2 (off) runs each pre-stage batch as two groups by length, the same
loss and gradients up to rounding: -4.8 % on the first phase's first 250 steps. With both, a fresh seed-1 run
there met both of issue 3's targets (0.925, digits 0.872) in 30.8 min, packing included: 48 s over the limit.

models/builtin since session 51 is that command's run on a 2-core Intel Xeon (CPU model 207: AVX-512, AMX), in
fp32 (--precision fp32, which auto does not pick there), with the held-out checks thinned out
(--vision-check-every 2000 --eval-every 1000: they train nothing):

    --seed 1 --precision fp32 --ranks 2 --prestage-length-groups 2 --item-means segment --vision-patch-keep 1
    --decoder-loss-rows --vision-check-every 2000 --eval-every 1000

18.9 min fresh there, packing included (pre-stage 417 s, vision stage 453 s, joint stage 204 s), and a second
fresh run gave the same weights byte for byte; 0.916, digits 0.860 (both targets), 1.9 points below E2s0h
(61 fixed / 99 broken, p = 0.003, mostly counts). Seed 0 with the same options missed the digits there
(0.9275, digits 0.812), and the defaults with --precision fp32 took 31.5 min and scored 0.894, digits 0.660
(their tower formed slowly: held-out shape 0.53 at vision step 500).

No training aid is saved in the checkpoint. Reproducible from the seed: fixed
step counts (not a time budget, so a slower or busier machine gives the same
model), CPU, fixed thread count, on one host (another CPU's kernels round differently:
the session-11 model does not come out of the session-12 host, and the digits depend on it: session 20's
recipe (1000 vision steps) scored 0.7955, digits 0.21, on session 21's Intel host against 0.8345, digits
0.47, on the AMD host that trained it -- its vision stage read 0.67 of held-out boxes instead of 0.93,
and in fp32 it learned as slowly);
stages 1 and 2 are cached in --work
(safetensors, keyed by their arguments and decoder_prestage.py's hash), and a
cached stage gives byte-identical weights. On the 2-core AMD EPYC host of sessions 12-19
the stages took 590 s (169 + 238 + 42 + 27 + 28 + 77, float32), 629 s and 329 s: 26.2 min end
to end, counting the held-out checks and packing the joint stage's 8000 scenes (~15 s), with
the vision stage's pack already in --work (session 19).
- A second fresh run an hour and a half later gave the same weights byte for byte and took
  28.4 min (626 s, 657 s, 387 s): this host's speed swings ~10 % within an hour.
- Session 18's float32 recipe (300 joint steps) took 33-35 min on the same host, over issue 3's
  30 minutes.
- Session 20's recipe (the same step counts) took 22.4 min on that session's host (499 s, 558 s,
  261 s), which ran session 19's recipe plus the count scenes in 19.2 min an hour earlier.
- The session-14 recipe (750 + 3000 pre-stage steps) took 39.5 min on this host.
- Without the digit phase, 2000 vision steps took 24.7 min on session 21's 2-core Intel Xeon (AMX)
  host (329 s, 914 s, 225 s) and 24.5 min on session 22's (304 s, 923 s, 228 s), both fresh and
  alone, byte for byte the same weights. The shipped recipe (with it) took 27.7 and 27.6 min there
  an hour later, fresh and alone, byte for byte the same weights (385 s, 1003 s, 255 s; that hour
  the unchanged first pre-stage phase took 96.5 s instead of 80 s).
- On session 23's 2-core AMD EPYC host it does not fit: the pre-stage took ~600 s and the vision stage
  0.66 s a step (~39 min projected, the run stopped at vision step 100). With --attention eager it took
  34.2 min, fresh and alone (624 s, 1052 s, 346 s), and scored 0.8485 (0.8520 shipped, paired p = 0.70).
  On that host the digit phase did not form the two-box form (0.41-0.43 at the pre-stage's end, with
  either kernel, against 0.85 on the Intel hosts); with 300 digit steps it did (0.82), digits rose
  0.572 -> 0.656 on images but relation and count fell, 0.8415 overall (BENCHMARKS.md, session 23).
- Session 25's recipe (t5, shipped in sessions 26-30: --count-tags, eager kernels) took 28.1 min fresh and
  alone on session 25's AMD EPYC host (~545 s, 857 s, 262 s) and scored 0.871; the defaults gave the
  same weights byte for byte there in session 26, in 29.4 min. With 300 digit steps
  and a 400-step remix (session 26) 29.9 min and 0.866.
- The shipped recipe since session 31 (the generator's boxes, 300 digit-phase steps with relation
  draws, vision count scenes) took 29.2 min fresh and alone on session 30's AMD EPYC host (1753 s:
  vision stage 868 s, joint stage 273 s) and scored 0.8825; the defaults gave the same
  weights byte for byte in session 31, in 29.4 min (1764 s: vision 902 s, joint 275 s).
- Session 33's recipe (that one with --joint-tower-lr-scale 0.3: the tower learns at 0.3 of the
  decoder's rate in the joint stage) scored 0.8905 and took 28.1 min fresh and alone on session 33's
  AMD EPYC host (1685 s: vision stage 857 s, joint stage 259 s), byte for byte the cached runs' weights.
- Session 35's recipe (that one drawing the vision stage from all 50000 training scenes) scored 0.8995
  and took 27.2 min fresh and alone on session 35's AMD EPYC host (1634 s: pre-stage 527 s, vision
  stage 808 s, joint stage 256 s; 43 s packing and held-out checks), byte for byte the cached run's weights.

- Session 38's recipe (that one with the first pre-stage phase at 5e-4) scored 0.9015 and took 28.3 min on session
  38's AMD EPYC host, alone, with the packs already in --work (1695 s: pre-stage ~530 s, vision stage 845 s, joint
  stage 293 s); packing them took ~45 s in session 35's fresh run. Not re-run fresh.
- Session 39's recipe (the next-to phase in place of the two remixes) scored 0.9245 and took 30.6 min on session
  39's AMD EPYC host, alone, with the packs already in --work (1833 s: pre-stage phases 651 s, vision stage 844 s,
  joint stage ~295 s): over the 30-minute limit. The phases it shares with session 38's recipe ran 8-25 % slower
  than there (first phase 122 s vs 113 s, digit phase 80 s vs 63 s); at session 38's speed the pre-stage would take
  ~605 s and the run ~29.8 min. Fresh (packing included, alone): 31.1 min (1864 s), the same weights.
- The same recipe under tcmalloc (--allocator, default since session 40) and with the vision stage's held-out
  check every 500 steps instead of 100: 26.3 min fresh and alone on session 40's AMD EPYC host (1579 s: pre-stage
  phases ~585 s, vision stage 732 s, joint stage 220 s), the same weights byte for byte (sha256 33aef159...).

Writes the checkpoint atomically (temp dir + rename).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# tcmalloc's shared library (Debian's libtcmalloc-minimal4, which scripts/setup.sh installs).
TCMALLOC_LIBRARY = "libtcmalloc_minimal.so.4"
ALLOCATORS = ("tcmalloc", "system")  # --allocator's choices, the first the default
ALLOCATOR = "system"  # what this process runs on: "tcmalloc" once preload_tcmalloc has re-executed it


def tcmalloc_installed() -> bool:
    """Whether the dynamic loader's cache (ldconfig -p) holds TCMALLOC_LIBRARY."""
    import ctypes.util
    return ctypes.util.find_library("tcmalloc_minimal") == TCMALLOC_LIBRARY


def preload_tcmalloc() -> None:
    """Re-executes this script with tcmalloc preloaded, before torch is imported (--allocator tcmalloc).

    Why: under tcmalloc a short run took 20-25 % less time on the 2-core AMD EPYC host (150 vision + 26
    joint steps, scripts/bench/train_allocator.sh: 87-91 s against 114-119 s; jemalloc 163-177 s), and the
    full recipe 26.3 min instead of 31.1, with the weights byte for byte the same: an allocator changes
    where tensors live, not the arithmetic (torch aligns every CPU tensor to 64 bytes under either).
    Likely cause: glibc hands the steps' multi-megabyte buffers back to the kernel, which faults them
    in again every step; raising glibc's mmap and trim thresholds (GLIBC_TUNABLES) won back half of it."""
    if os.environ.get("VLMOPT_TRAIN_PRELOADED") is not None:
        # The re-executed process: its children (the vlmopt binary) get the caller's LD_PRELOAD back.
        global ALLOCATOR
        ALLOCATOR = "tcmalloc"
        was = os.environ.pop("VLMOPT_TRAIN_PRELOADED")
        if was:
            os.environ["LD_PRELOAD"] = was
        else:
            os.environ.pop("LD_PRELOAD", None)
        return
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--allocator", choices=ALLOCATORS, default=ALLOCATORS[0])
    if pre.parse_known_args()[0].allocator != "tcmalloc":
        return
    if not tcmalloc_installed():
        print(f"[train] warning: {TCMALLOC_LIBRARY} not found (Debian: libtcmalloc-minimal4); training with the "
              "system allocator, ~20 % slower, the same weights", file=sys.stderr, flush=True)
        return
    was = os.environ.get("LD_PRELOAD", "")
    env = dict(os.environ, VLMOPT_TRAIN_PRELOADED=was,
               LD_PRELOAD=f"{TCMALLOC_LIBRARY} {was}".strip())
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


if __name__ == "__main__":
    preload_tcmalloc()

import h5py
import safetensors.torch
import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
import decoder_prestage
import decoder_rows
import train_ranks
from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                          LlavaForConditionalGeneration, LlavaProcessor, PreTrainedTokenizerFast)

# Prompt format shared with the C++ runtime (runtime::kDefaultPromptTemplate).
PROMPT_TEMPLATE = "USER: <image>\n{question} ASSISTANT:"
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<image>"]
IMAGE_SIZE, PATCH = 96, 8
VISION_LAYERS = 4  # the tower's depth (make_config)
DECODER_LAYERS = 4
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


def make_config(vocab_size: int, image_token_id: int, ids: dict[str, int], vision_feature_layer: int = -2) -> LlavaConfig:
    vision = CLIPVisionConfig(image_size=IMAGE_SIZE, patch_size=PATCH, hidden_size=128,
                              intermediate_size=512, num_hidden_layers=VISION_LAYERS, num_attention_heads=4,
                              hidden_act="quick_gelu", projection_dim=128)
    text = LlamaConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=768,
                       num_hidden_layers=DECODER_LAYERS, num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                       bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"],
                       tie_word_embeddings=False)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                       image_seq_length=IMAGE_TOKENS, vision_feature_layer=vision_feature_layer,
                       vision_feature_select_strategy="default", projector_hidden_act="gelu")


class Pack:
    """One HDF5 pack written by `vlmopt datasets pack` (layout: docs/datasets.md), read row by row
    or held in RAM."""

    def __init__(self, path: Path, in_memory: bool = False):
        """in_memory: read every dataset whole now (the 50000-scene pack: 1.4 GB of images, ~7 s) and
        serve rows from RAM; the same rows, without an HDF5 read and gzip inflate per row."""
        self.f = h5py.File(path, "r")
        names = ("images", "questions", "answers", "question_types", "meta")
        self.images, self.questions, self.answers, self.types, self.meta = (
            self.f[n][...] if in_memory else self.f[n] for n in names)

    def __len__(self) -> int:
        return self.images.shape[0]

    @staticmethod
    def rows(dataset, idx: np.ndarray) -> list:
        """dataset[i] for each i of idx, ascending. One read per row: h5py's fancy selection
        (dataset[idx]) took 0.13 s for 64 gzip-chunked images, the loop 0.01 s (session 13)."""
        if isinstance(dataset, np.ndarray):  # in memory: copies, as a read gives (callers may write into them)
            return [np.array(dataset[i]) if dataset.dtype != object else dataset[i] for i in np.sort(idx)]
        return [dataset[i] for i in np.sort(idx)]

    @staticmethod
    def text(value) -> str:
        """A string dataset's element as str (h5py gives bytes for variable-length strings)."""
        return value.decode() if isinstance(value, bytes) else str(value)

    def batch(self, idx: np.ndarray):
        imgs = np.stack(self.rows(self.images, idx))  # [B,H,W,3] uint8, RGB
        dec = self.text
        return (imgs, [dec(q) for q in self.rows(self.questions, idx)], [dec(a) for a in self.rows(self.answers, idx)],
                [dec(t) for t in self.rows(self.types, idx)])

    def scenes(self, idx: np.ndarray) -> list[dict]:
        return [json.loads(m) for m in self.rows(self.meta, idx)]


# Dense auxiliary supervision of the vision tower (training only; the heads are
# not part of the checkpoint). One answer token per sample is a weak signal for
# a vision tower trained from scratch: the decoder settles on the language prior
# long before the patch features say anything. Per-patch targets from the scene
# layout (which shape/colour/size/digit covers the patch, and which patch holds
# an object's centre) give 144 labels per image and make the features linearly
# readable within a few hundred steps; the decoder then only has to learn to
# look them up. Label 0 = background, IGNORE = patch on an object's boundary.
GRID = IMAGE_SIZE // PATCH
IGNORE = -100
AUX_HEADS = {"shape": 6, "color": 7, "size": 3, "digit": 11, "center": 2}


def patch_targets(scenes: list[dict], shapes: list[str], colors: list[str]) -> dict[str, torch.Tensor]:
    """Per-patch class targets [B, GRID*GRID] (row-major, like CLIP's patch order)."""
    n = len(scenes)
    out = {k: np.zeros((n, GRID, GRID), dtype=np.int64) for k in AUX_HEADS}
    centers = (np.arange(GRID) * PATCH + (PATCH - 1) / 2.0)
    py, px = np.meshgrid(centers, centers, indexing="ij")
    for b, sc in enumerate(scenes):
        for o in sc.get("objects", []):
            d = np.hypot(px - o["cx"], py - o["cy"])
            inner, rim = d <= 0.65 * o["radius"], (d > 0.65 * o["radius"]) & (d <= 1.15 * o["radius"])
            for key, val in (("shape", 1 + shapes.index(o["shape"])), ("color", 1 + colors.index(o["color"])),
                             ("size", 1 if o["size"] == "small" else 2)):
                out[key][b][rim & (out[key][b] == 0)] = IGNORE
                out[key][b][inner] = val
            out["center"][b][min(int(o["cy"]) // PATCH, GRID - 1), min(int(o["cx"]) // PATCH, GRID - 1)] = 1
        for dg in sc.get("digits", []):
            x0, y0, side = dg["x"], dg["y"], dg["side"]
            inside = (px >= x0 + 3) & (px <= x0 + side - 3) & (py >= y0 + 3) & (py <= y0 + side - 3)
            edge = (px >= x0 - 2) & (px <= x0 + side + 2) & (py >= y0 - 2) & (py <= y0 + side + 2) & ~inside
            out["digit"][b][edge & (out["digit"][b] == 0)] = IGNORE
            out["digit"][b][inside] = 1 + int(dg["label"])
    return {k: torch.from_numpy(v.reshape(n, GRID * GRID)) for k, v in out.items()}


# Extra question/answer turns per training image (training only). Each scene
# comes from the C++ generator with one question; its layout (meta) answers many
# more, phrased with the generator's own templates. Appending K of them as
# further turns ("... ASSISTANT: a1 </s> USER: q2 ASSISTANT: a2 </s> ...")
# multiplies the answer supervision per image for ~10 tokens each, while the
# first turn stays exactly the evaluation format. Only questions whose answer
# is unambiguous from the layout are derived (unique referents, clear margins):
# the decoder pre-stage's question list (decoder_prestage.SymbolicScenes.questions),
# all eight kinds, over the scene's layout.
NUMBER_WORDS = decoder_prestage.NUMBERS
SHAPE_PLURALS = {"circle": "circles", "square": "squares", "triangle": "triangles", "star": "stars", "cross": "crosses"}


def derived_turns(scene: dict, shapes: list[str], colors: list[str], max_count: int,
                  rng: np.random.Generator, k: int, balanced: bool = False,
                  first_kind: str | None = None) -> list[tuple[str, str]]:
    """K (question, answer) turns drawn from every question the layout answers unambiguously.

    Uniformly over candidates (the shipped recipe), most of them are counts or
    existence checks of absent attributes ("zero"/"no"), which the language prior
    answers; `balanced` draws the kinds round-robin (exist split into yes and no)
    so the lookups that need the image dominate. `first_kind`: that kind's questions
    come first (up to K of them, in random order), the other turns as above."""
    by_kind = decoder_prestage.SymbolicScenes(shapes, colors, SHAPE_PLURALS, relation_margin=16,
                                              sized_color_singles=True).questions(
        decoder_prestage.scene_from_meta(scene))
    cands: list[tuple[str, str, str]] = []  # (kind, question, answer)
    for kind, qas in by_kind.items():
        for q, a in qas:
            if kind == "count" and NUMBER_WORDS.index(a) > max_count:
                continue
            cands.append((f"exist-{a}" if kind == "exist" else kind, q, a))
    if not cands or k <= 0:
        return []
    head: list[tuple[str, str]] = []
    if first_kind is not None:
        firsts = [c[1:] for c in cands if c[0] == first_kind]
        head = [firsts[i] for i in rng.permutation(len(firsts))][:k]
        cands = [c for c in cands if c[0] != first_kind]
        k -= len(head)
        if not cands or k <= 0:
            return head
    if balanced:
        kinds = sorted({kind for kind, _, _ in cands})
        pools = [[c[1:] for c in cands if c[0] == kind] for kind in kinds]
        pools = [[pool[i] for i in rng.permutation(len(pool))] for pool in pools]
        out: list[tuple[str, str]] = []
        while len(out) < k and any(pools):
            for j in rng.permutation(len(pools)):
                if pools[j] and len(out) < k:
                    out.append(pools[j].pop())
        return head + out
    pick = rng.choice(len(cands), size=min(k, len(cands)), replace=False)
    return head + [cands[i][1:] for i in pick]


# Attention guidance (training only). A decoder trained from scratch spends most
# of a CPU budget on a plateau before its last query token learns to look up the
# image patches a question refers to. The scene layout says which patches those
# are, so a small loss -log(attention mass on them) at one decoder layer (head
# mean, from each turn's "ASSISTANT:" token) shortens that plateau; the answer
# loss still decides what is read there.
def referent_patches(question: str, scene: dict, shapes: list[str], colors: list[str]) -> list[int]:
    """Patch indices (row-major, 0..GRID*GRID-1) of the items `question` is about; [] if none."""
    words = question.split()
    singular = {**{s: s for s in shapes}, **{p: s for s, p in SHAPE_PLURALS.items()}}
    centers = np.arange(GRID) * PATCH + (PATCH - 1) / 2.0
    py, px = np.meshgrid(centers, centers, indexing="ij")
    mask = np.zeros((GRID, GRID), dtype=bool)
    if "digit" in words:
        boxes = scene.get("digits", [])
        if "left" in words or "right" in words:
            boxes = sorted(boxes, key=lambda d: d["x"])[:1] if "left" in words else sorted(boxes, key=lambda d: -d["x"])[:1]
        for d in boxes:
            mask |= (px >= d["x"]) & (px <= d["x"] + d["side"]) & (py >= d["y"]) & (py <= d["y"] + d["side"])
        return list(np.flatnonzero(mask.reshape(-1)))
    constraints, i = [], 0
    while i < len(words):
        w = words[i]
        if w in colors and i + 1 < len(words) and words[i + 1] in singular:
            constraints.append((w, singular[words[i + 1]]))
            i += 2
            continue
        if w in colors:
            constraints.append((w, None))
        elif w in singular:
            constraints.append((None, singular[w]))
        i += 1
    sizes = [w for w in words if w in ("small", "large")]
    size = sizes[0] if len(sizes) == 1 else None
    for o in scene.get("objects", []):
        if size is not None and o["size"] != size:
            continue
        if any((c is None or o["color"] == c) and (sh is None or o["shape"] == sh) for c, sh in constraints):
            mask |= np.hypot(px - o["cx"], py - o["cy"]) <= max(0.65 * o["radius"], PATCH / 2)
            mask[min(int(o["cy"]) // PATCH, GRID - 1), min(int(o["cx"]) // PATCH, GRID - 1)] = True
    return list(np.flatnonzero(mask.reshape(-1)))


def attention_guidance_loss(attentions, input_ids, turns, scenes, image_id, layer, shapes, colors):
    """Mean over turns with referents of -log(head-mean attention mass on the referent patches)."""
    probs = attentions[layer].mean(dim=1)  # [B, T, T]
    terms = []
    for b, sample_turns in enumerate(turns):
        first_image = int((input_ids[b] == image_id).nonzero()[0])
        for pos, question in sample_turns:
            patches = referent_patches(question, scenes[b], shapes, colors)
            if patches:
                cols = torch.tensor(patches, dtype=torch.long) + first_image
                terms.append(-torch.log(probs[b, pos, cols].sum() + 1e-6))
    return torch.stack(terms).mean() if terms else probs.new_zeros(())


def balanced_patch_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with foreground and background patches weighted equally.

    A plain mean over all patches is ~99 % background for the digit head (a box
    covers a few of 144 patches and only some scenes have one): it reached 0.02
    while the heads read the digit on object patches at chance and a probe on
    the shipped model's box features reads it at 25 %. Averaging the two groups
    separately makes the few object patches carry half of the signal."""
    ce = torch.nn.functional.cross_entropy(logits, target, ignore_index=IGNORE, reduction="none")
    fg, bg = target > 0, target == 0
    if not bool(fg.any()):
        return ce[bg].mean()
    return 0.5 * (ce[fg].mean() + ce[bg].mean())


class VisionTap:
    """Captures the vision tower's hidden state that feeds the projector (vision_feature_layer).

    While training, the layers after that one are skipped (identity forward): like LLaVA's, the
    tower's last layer feeds nothing (feature layer -2), gets no gradient and keeps its initial
    weights, but CLIP still ran it, a quarter of every tower forward. restore() before saving."""

    def __init__(self, model: LlavaForConditionalGeneration, early_layer: int = 0):
        tower = model.model.vision_tower
        layers = (tower.vision_model if hasattr(tower, "vision_model") else tower).encoder.layers
        index = model.config.vision_feature_layer % (len(layers) + 1)  # hidden_states index
        self.value = None
        self.early = None  # layer early_layer's output [B, 1 + GRID*GRID, hidden] (--vision-early-shape-layer)
        # [B, K] patch indices (0..GRID*GRID-1, sorted) the next forward keeps, or None for all
        # (--vision-patch-keep): the embeddings' output, position vectors added, is cut to CLS + those.
        self.keep: torch.Tensor | None = None
        (tower.vision_model if hasattr(tower, "vision_model") else tower).embeddings.register_forward_hook(
            self._keep_hook)
        layers[index - 1].register_forward_hook(self._hook)
        if early_layer:
            if not 1 <= early_layer < index:
                raise ValueError(f"--vision-early-shape-layer: expected 1..{index - 1} (a layer before the "
                                 f"feature layer), got {early_layer}")
            layers[early_layer - 1].register_forward_hook(self._early_hook)
        # hidden_states[index] is layer index-1's output; an identity layer after it keeps the
        # count of hidden states, so hidden_states[vision_feature_layer] is the same tensor.
        self.skipped = list(layers)[index:]
        for layer in self.skipped:
            layer.forward = lambda hidden_states, *_args, **_kwargs: hidden_states

    def restore(self) -> None:
        for layer in self.skipped:
            del layer.forward  # the class's forward again

    def _hook(self, _module, _inputs, output):
        self.value = output[0] if isinstance(output, tuple) else output

    def _keep_hook(self, _module, _inputs, output):
        if self.keep is None:
            return None  # the output as it is
        rows = torch.cat([torch.zeros_like(self.keep[:, :1]), self.keep + 1], 1)  # CLS, then the kept patches
        return output.gather(1, rows.unsqueeze(-1).expand(-1, -1, output.size(-1)))

    def _early_hook(self, _module, _inputs, output):
        self.early = output[0] if isinstance(output, tuple) else output


def object_patch_accuracy(logits: torch.Tensor, target: torch.Tensor) -> float | None:
    """Accuracy of a per-patch head on object patches (label > 0) only; None if there are none."""
    fg = target > 0
    return round(float((logits[fg].argmax(-1) == target[fg]).float().mean()), 3) if bool(fg.any()) else None


def pretrain_vision(model, tap, heads, train: "Pack", held: "Pack", shapes, colors, args) -> list[dict]:
    """Optional first stage: the vision tower alone on the dense per-patch labels.

    Trained jointly, the from-scratch tower does not learn shape or digit identity
    within the step budget (docs/BENCHMARKS.md, builtin model); alone it costs ~1/4
    of a joint step per image. Balanced loss (object vs background patches);
    random samples of the same pack from a separate stream, so the joint run
    sees its samples in the same order as without this stage."""
    tower = model.model.vision_tower
    opt = torch.optim.AdamW(list(tower.parameters()) + list(heads.parameters()), lr=args.vision_lr, weight_decay=0.01)
    rng = np.random.default_rng(args.seed + 1)
    log, t0 = [], time.time()
    held_idx = np.arange(min(256, len(held)))
    for step in range(args.vision_steps):
        for g in opt.param_groups:
            g["lr"] = args.vision_lr * min(1.0, (step + 1) / 30)
        idx = rng.choice(len(train), size=args.vision_batch, replace=False)
        imgs, *_ = train.batch(idx)
        tower(pixel_values=to_pixels(imgs))
        targets = patch_targets(train.scenes(idx), shapes, colors)
        feats = tap.value[:, 1:, :]
        loss = sum(balanced_patch_loss(h(feats).flatten(0, 1), targets[k].flatten()) for k, h in heads.items())
        loss = loss / len(heads)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == args.vision_steps - 1:
            with torch.no_grad():
                imgs, *_ = held.batch(held_idx)
                tower(pixel_values=to_pixels(imgs))
                t = patch_targets(held.scenes(held_idx), shapes, colors)
                acc = {k: object_patch_accuracy(h(tap.value[:, 1:, :]).flatten(0, 1), t[k].flatten())
                       for k, h in heads.items() if k != "center"}
            entry = {"vision_step": step, "loss": round(float(loss.detach()), 4), "s": round(time.time() - t0, 1),
                     "heldout_object_patch_acc": acc}
            log.append(entry)
            print(f"[train] {json.dumps(entry)}", file=sys.stderr)
    return log


# Pooled object supervision (training only). The decoder reads an object through
# attention, i.e. a weighted mean of the patch features over the object; asking
# that mean (not every patch) for the object's shape / colour / size / digit
# learned the digits about twice as fast as the per-patch loss
# (scripts/experiments/vision_pooled_digits.py, docs/BENCHMARKS.md).
POOLED_HEADS = {"shape": 5, "color": 6, "size": 2, "digit": 10}


def pooled_targets(scenes: list[dict], shapes: list[str], colors: list[str], object_centres: bool = False,
                   box_centres: bool = False, tags: tuple[str, ...] = ()):
    """Per item: (sample index, [GRID*GRID] patch mask, head, label) for every object and digit box.

    object_centres: an object's mask is its centre patch alone (the one token per object that the
    decoder pre-stage reads), not the patches it covers. box_centres: the same for a digit box.
    tags: also these item tags (some of decoder_prestage.TAGS; --count-tags, --digit-tags), each item's
    as its own head, labelled with the index of its word in decoder_prestage.TAG_WORDS."""
    centers = np.arange(GRID) * PATCH + (PATCH - 1) / 2.0
    py, px = np.meshgrid(centers, centers, indexing="ij")
    items = []
    for b, sc in enumerate(scenes):
        obj_tags, box_tags = decoder_prestage.item_tags(decoder_prestage.scene_from_meta(sc)) if tags else ([], [])
        for j, o in enumerate(sc.get("objects", [])):
            mask = (np.zeros((GRID, GRID), dtype=bool) if object_centres else
                    np.hypot(px - o["cx"], py - o["cy"]) <= max(0.8 * o["radius"], PATCH / 2))
            m = mask.reshape(-1)
            m[decoder_prestage.patch_index(o["cx"], o["cy"])] = True
            items.append((b, m, "shape", shapes.index(o["shape"])))
            items.append((b, m, "color", colors.index(o["color"])))
            items.append((b, m, "size", 0 if o["size"] == "small" else 1))
            items += [(b, m, t, obj_tags[j][k]) for k, t in enumerate(decoder_prestage.TAGS)
                      if t in tags and obj_tags[j][k] != decoder_prestage.NO_TAG]
        for j, dg in enumerate(sc.get("digits", [])):
            x0, y0, side = dg["x"], dg["y"], dg["side"]
            if box_centres:
                inside = np.zeros(GRID * GRID, dtype=bool)
                inside[decoder_prestage.patch_index(x0 + side / 2, y0 + side / 2)] = True
            else:
                inside = ((px >= x0) & (px <= x0 + side) & (py >= y0) & (py <= y0 + side)).reshape(-1)
            items.append((b, inside, "digit", int(dg["label"])))
            items += [(b, inside, t, box_tags[j][k]) for k, t in enumerate(decoder_prestage.TAGS)
                      if t in tags and box_tags[j][k] != decoder_prestage.NO_TAG]
    return items


def item_footprints(scenes: list[dict]) -> np.ndarray:
    """[B, GRID*GRID] bool: the patches an object or a digit box draws ink on. An object stays within
    1.2 of its radius from its centre (the triangle's corners; datasets/scenes.cpp), +1 px of
    anti-aliasing; a box within its square."""
    corners = np.arange(GRID) * PATCH  # a patch spans [corner, corner + PATCH)
    lo_y, lo_x = np.meshgrid(corners, corners, indexing="ij")
    out = np.zeros((len(scenes), GRID, GRID), dtype=bool)
    for b, sc in enumerate(scenes):
        for o in sc.get("objects", []):
            # the distance from the centre to the nearest point of each patch
            dx = np.clip(o["cx"], lo_x, lo_x + PATCH - 1) - o["cx"]
            dy = np.clip(o["cy"], lo_y, lo_y + PATCH - 1) - o["cy"]
            out[b] |= np.hypot(dx, dy) <= 1.2 * o["radius"] + 1
        for dg in sc.get("digits", []):
            x0, y0, side = dg["x"], dg["y"], dg["side"]
            out[b] |= (lo_x + PATCH > x0) & (lo_x < x0 + side) & (lo_y + PATCH > y0) & (lo_y < y0 + side)
    return out.reshape(len(scenes), GRID * GRID)


def kept_patches(items, scenes: list[dict], keep: int, rng: np.random.Generator,
                 groups: int = 1) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """The patches a vision-stage step keeps (--vision-patch-keep): per sample every patch an item
    (object or digit box) draws on (item_footprints; an item's mask covers only its interior, and
    without its edges the tower lost shape and size: held-out size 0.74 against 0.985 at step 1000,
    session 47) and background patches drawn at random, K in all. As FLIP drops patches, with the
    objects kept. The samples go into `groups` groups by their item patches (--vision-patch-groups),
    each run through the tower on its own: K = max(keep, the group's busiest sample's item patches).

    Returns ([B, Kmax] patch indices, sorted, -1 after a sample's K; [B, Kmax] float32 weights: 1 on
    an item's patch, on a kept background patch the number of background patches over the number
    kept, so that a weighted mean over the kept patches estimates the mean over all 144 (the alignment
    loss's; a sample whose items fill its K keeps no background and weighs in with its items alone),
    0 after K; the sample indices of each group)."""
    item = item_footprints(scenes)
    for b, m, _, _ in items:
        item[b] |= m
    batch = len(scenes)
    busy = item.sum(1)
    chunks = ([np.arange(batch)] if groups <= 1 else
              [np.sort(c) for c in np.array_split(np.argsort(busy, kind="stable"), groups) if c.size])
    k_of = np.empty(batch, dtype=np.int64)
    for c in chunks:
        k_of[c] = max(keep, int(busy[c].max()))
    index = np.full((batch, k_of.max()), -1, dtype=np.int64)
    weights = np.zeros((batch, k_of.max()), dtype=np.float32)
    for b in range(batch):
        background = np.flatnonzero(~item[b])
        drawn = rng.choice(background, size=k_of[b] - int(busy[b]), replace=False)
        index[b, :k_of[b]] = np.sort(np.concatenate([np.flatnonzero(item[b]), drawn]))
        weights[b, :k_of[b]] = np.where(item[b, index[b, :k_of[b]]], 1.0, background.size / max(drawn.size, 1))
    return index, weights, chunks


def items_on_kept(items, index: np.ndarray):
    """items (pooled_targets) with each mask cut to its sample's kept patches ([B, K] index, -1: none)."""
    return [(b, np.append(m, False)[index[b]], h, y) for b, m, h, y in items]


def tower_on_kept(tower, tap: "VisionTap", pixels: torch.Tensor, kept) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tower's feature-layer output (and tap.early) on kept_patches' patches, group by group:
    [B, 1 + Kmax, hidden], CLS first, zeros after a sample's K."""
    index, _, chunks = kept
    value, early = None, None
    for c in chunks:
        k = int((index[c] >= 0).sum(1).max())
        tap.keep = torch.from_numpy(index[c, :k])
        try:
            tower(pixel_values=pixels if len(chunks) == 1 else pixels[torch.from_numpy(c)])
        finally:
            tap.keep = None
        if len(chunks) == 1:
            return tap.value, tap.early
        if value is None:
            value = tap.value.new_zeros(len(index), 1 + index.shape[1], tap.value.size(-1))
            early = None if tap.early is None else value.clone()
        rows = torch.from_numpy(c)
        value = value.index_put((rows,), torch.nn.functional.pad(tap.value, (0, 0, 0, index.shape[1] - k)))
        if early is not None:
            early = early.index_put((rows,), torch.nn.functional.pad(tap.early, (0, 0, 0, index.shape[1] - k)))
    return value, early


def digit_tags_key(args) -> str:
    """The cache-key part for --digit-tags ("both" keeps the key it had as an on/off switch)."""
    return {None: "", "both": "-digittags"}.get(args.digit_tags, f"-digittags-{args.digit_tags}")


def item_tag_names(args) -> tuple[str, ...]:
    """The item tags (decoder_prestage.TAGS) that --count-tags and --digit-tags switch on."""
    on = {"count_color": args.count_tags, "count_shape": args.count_tags, "next_digit": args.digit_tags in ("both", "next"),
          "box_side": args.digit_tags in ("both", "side")}
    return tuple(t for t in decoder_prestage.TAGS if on[t])


COUNT_HEADS = ("count_color", "count_shape")  # the pooled heads --vision-count-weight scales


def pooled_losses(feats: torch.Tensor, items, heads) -> tuple[dict, dict]:
    """Cross-entropy and accuracy per head on the mask-mean of `feats` [B, GRID*GRID, hidden]."""
    losses, accs = {}, {}
    for name in heads.keys():
        rows = [(b, m, y) for b, m, h, y in items if h == name]
        if not rows:
            continue
        logits = heads[name](decoder_prestage.item_means(feats, rows))
        labels = torch.tensor([y for _, _, y in rows])
        losses[name] = torch.nn.functional.cross_entropy(logits, labels)
        accs[name] = (float((logits.detach().argmax(-1) == labels).float().mean()), len(rows))
    return losses, accs


def digit_scene_indices(pack: "Pack") -> np.ndarray:
    return np.array([i for i, m in enumerate(pack.meta[:]) if json.loads(m).get("digits")], dtype=np.int64)


def augment_digit_boxes(imgs: np.ndarray, scenes: list[dict], rng: np.random.Generator,
                        strength: float) -> np.ndarray:
    """imgs [B, H, W, 3] uint8 with every digit box's ink redrawn under a fresh random writer
    variation (training only): rotation up to 12 degrees, horizontal shear up to 0.25, scale
    0.9-1.1 and a shift up to 6 % of the box, each times `strength`; and a quarter of the boxes
    (times `strength`) with their strokes half a pixel thicker, as many thinner. The box and its border stay where
    the scene's meta says, so every target is unchanged.

    Why: the sheet's 3000 training digits are each seen ~25 times in the vision stage, and the
    model reads them but not new writers' (the shipped model: single-box digit questions 0.98 on
    builtin:train, 0.79 on builtin:eval, whose digits come from other sheet columns)."""
    out = imgs.copy()
    if strength <= 0:
        return out
    # The draws box by box, in the scenes' order (the stream as it has always been drawn) ...
    boxes = []  # (scene, x, y, inner side, theta [2, 3], stroke draw)
    for b, scene in enumerate(scenes):
        for d in scene.get("digits", []):
            angle = math.radians(12.0) * strength * rng.uniform(-1, 1)
            shear = 0.25 * strength * rng.uniform(-1, 1)
            scale = 1.0 + 0.1 * strength * rng.uniform(-1, 1)
            shift = 0.12 * strength * rng.uniform(-1, 1, size=2)  # grid units: 2 = the box's side
            c, s_ = math.cos(angle), math.sin(angle)
            # grid_sample's theta maps output coordinates to input ones: rotation @ shear / scale.
            linear = np.array([[c, -s_], [s_, c]]) @ np.array([[1.0, shear], [0.0, 1.0]]) / scale
            boxes.append((b, int(d["x"]) + 1, int(d["y"]) + 1, int(d["side"]) - 2,
                          np.concatenate([linear, shift[:, None]], axis=1), rng.random()))
    # ... then one warp per box size, 3x faster than box by box: grid_sample and the pooling compute
    # each sample apart, so every box comes out as from a warp of its own, bit for bit (the smoke test
    # checks: scenes one by one against the whole batch).
    for inner in sorted({box[3] for box in boxes}):
        group = [box for box in boxes if box[3] == inner]
        ink = 1.0 - torch.from_numpy(np.stack([out[b, y:y + inner, x:x + inner, 0] for b, x, y, _, _, _ in group])
                                     .astype(np.float32)).div_(255.0)[:, None]  # [N, 1, inner, inner]
        theta = torch.tensor(np.stack([box[4] for box in group]), dtype=torch.float32)
        grid = torch.nn.functional.affine_grid(theta, list(ink.shape), align_corners=False)
        warped = torch.nn.functional.grid_sample(ink, grid, padding_mode="zeros", align_corners=False)
        stroke = torch.tensor([box[5] for box in group], dtype=torch.float64).view(-1, 1, 1, 1)
        thicker = stroke < 0.25 * strength  # half a pixel thicker: the mean of the ink and its 3x3 dilation
        thinner = (stroke >= 0.25 * strength) & (stroke < 0.5 * strength)  # thinner: the same with the erosion
        warped = torch.where(thicker, 0.5 * (warped + torch.nn.functional.max_pool2d(warped, 3, 1, 1)),
                             torch.where(thinner, 0.5 * (warped - torch.nn.functional.max_pool2d(-warped, 3, 1, 1)),
                                         warped))
        paper = (1.0 - warped.clamp(0, 1))[:, 0].mul(255.0).round().to(torch.uint8).numpy()
        for (b, x, y, _, _, _), box_paper in zip(group, paper):
            out[b, y:y + inner, x:x + inner] = box_paper[..., None]
    return out


# px between a pasted box and any object: more than the 8 px within which scene_from_meta reads a box as
# beside an object (the generator's "next to" layout leaves 1-3 px)
BOX_OBJECT_GAP = 10
BOX_BOX_GAP = 3      # px between two boxes
PASTE_TRIES = 20


def paste_extra_digit_boxes(imgs: np.ndarray, scenes: list[dict], donors: list[tuple[np.ndarray, dict]],
                            rng: np.random.Generator, per_scene: int) -> tuple[np.ndarray, list[dict]]:
    """Up to `per_scene` more digit boxes in each scene of imgs [B, H, W, 3] uint8 (vision stage only):
    each a donor box (its image and its "digits" entry, from another training scene) copied pixel for
    pixel -- border and paper, as the generator drew it -- to a free spot at least BOX_OBJECT_GAP px from
    every object and BOX_BOX_GAP px from every box. Returns new images and scene dicts (the given ones are
    not changed); every pasted box is in its scene's "digits", so the pooled digit head and the
    alignment targets see it as any other box.

    Why: the digit head reads the boxes' mean feature, ~60 boxes a batch of 64 scenes, and its held-out
    accuracy still climbs at the stage's last step (0.85 at 1500, 0.94 at 2000; session 42); the tower
    reads 0.86-0.89 of builtin:eval's boxes. More boxes a step give it more writers' digits for the
    same tower time (the step's cost is the batch of scenes, not its boxes)."""
    out, new_scenes = imgs.copy(), []
    canvas = imgs.shape[1]
    donor_pos = 0
    for b, scene in enumerate(scenes):
        scene = dict(scene, digits=list(scene.get("digits", [])))
        taken = [(o["cx"] - o["radius"] - BOX_OBJECT_GAP, o["cy"] - o["radius"] - BOX_OBJECT_GAP,
                  o["cx"] + o["radius"] + BOX_OBJECT_GAP, o["cy"] + o["radius"] + BOX_OBJECT_GAP)
                 for o in scene.get("objects", [])]
        taken += [(d["x"] - BOX_BOX_GAP, d["y"] - BOX_BOX_GAP, d["x"] + d["side"] + BOX_BOX_GAP,
                   d["y"] + d["side"] + BOX_BOX_GAP) for d in scene["digits"]]
        for _ in range(per_scene):
            donor_img, box = donors[donor_pos % len(donors)]
            donor_pos += 1
            side = int(box["side"])
            for _ in range(PASTE_TRIES):
                x, y = (int(v) for v in rng.integers(2, canvas - 2 - side + 1, size=2))
                if all(x + side <= x0 or x >= x1 or y + side <= y0 or y >= y1 for x0, y0, x1, y1 in taken):
                    sx, sy = int(box["x"]), int(box["y"])
                    out[b, y:y + side, x:x + side] = donor_img[sy:sy + side, sx:sx + side]
                    scene["digits"].append({**box, "x": x, "y": y})
                    taken.append((x - BOX_BOX_GAP, y - BOX_BOX_GAP, x + side + BOX_BOX_GAP, y + side + BOX_BOX_GAP))
                    break
        new_scenes.append(scene)
    return out, new_scenes


def pretrain_vision_pooled(model, tap, heads, train: "Pack", held: "Pack", shapes, colors, args,
                           align=None, early_heads=None, attempt: int = 0, gate: bool = False,
                           ranks: train_ranks.Ranks | None = None) -> list[dict]:
    """First stage, pooled objective: the vision tower alone, half of every batch
    from the scenes with digit boxes (1 in 8 scenes otherwise).

    early_heads ({"shape": Linear}), if given, reads each object's shape from tap.early too, an
    earlier layer's output, weighted as one more head (--vision-early-shape-layer).

    With args.vision_ema > 0 the stage ends on the moving average of its weights, checked on the
    held-out scenes once more (log entry "vision_step": "ema").

    align(features [B, 144, hidden], scenes, items) -> {name: loss}, if given, adds the projector's
    alignment to the pre-trained decoder's input space ("align", weight args.align_weight; and
    "readout", weight args.readout_weight); the projector then trains here too.

    gate (with args.vision_until, a dict: --vision-until): the stage stops at step args.vision_gate_step
    when a kind's held-out accuracy is below its figure there; its last log entry then has "gate_short".
    attempt k > 0 draws the batches from the streams of seed + 1000 * k (vision_stage_gated).

    ranks (--ranks): every rank draws the same scenes and trains on its share of them, with its own
    streams for what it draws for them; the held-out checks run on rank 0 (train_ranks.py)."""
    ranks = ranks or train_ranks.Ranks()
    tower = model.model.vision_tower
    seed = args.seed + 1000 * attempt
    params = list(tower.parameters()) + list(heads.parameters())
    if early_heads is not None:
        params += list(early_heads.parameters())
    if align is not None:
        params += list(model.model.multi_modal_projector.parameters())
    opt = torch.optim.AdamW(params, lr=args.vision_lr, weight_decay=0.01)
    rng = np.random.default_rng(seed + 1)
    digit_idx = digit_scene_indices(train)
    augment_rng = np.random.default_rng(ranks.seed(seed + 21))  # its own stream: the batches stay as without
    paste_rng = np.random.default_rng(ranks.seed(seed + 25))  # the same for --vision-extra-boxes
    keep_rng = np.random.default_rng(ranks.seed(seed + 27))  # and for --vision-patch-keep

    donor_cache: dict[int, tuple[np.ndarray, dict]] = {}  # scene index -> (image, scene): <= 6250 scenes, 172 MB

    def draw_donor_boxes(n: int) -> list[tuple[np.ndarray, dict]]:
        """n (image, digit box) pairs: one random box of each of n random training scenes with boxes."""
        donor_idx = np.sort(paste_rng.choice(digit_idx, size=n, replace=n > len(digit_idx)))
        # Each scene read from the pack once: 128 reads a step were 4 % of the stage's time.
        missing = np.array(sorted({int(i) for i in donor_idx} - donor_cache.keys()), dtype=np.int64)
        if missing.size:
            donor_cache.update(zip(missing.tolist(), zip(Pack.rows(train.images, missing), train.scenes(missing))))
        donor_imgs = [donor_cache[int(i)][0] for i in donor_idx]
        donor_scenes = [donor_cache[int(i)][1] for i in donor_idx]
        order = paste_rng.permutation(n)  # rows come back sorted by index: shuffle them back
        return [(donor_imgs[i], donor_scenes[i]["digits"][paste_rng.integers(len(donor_scenes[i]["digits"]))])
                for i in order]
    count_idx = question_streams(train, {"count": 1}, 0)[0][1] if args.vision_count_scenes > 0 else None
    log, t0 = [], time.time()
    held_idx = np.arange(min(256, len(held)))
    half = args.vision_batch // 2
    # The average's copy of every trained weight (fp32, as the weights); live_weights share the weights' storage.
    ema = [p.detach().clone() for p in params] if args.vision_ema > 0 else None
    live_weights = [p.detach() for p in params]

    def held_out_accuracies() -> dict:
        with torch.no_grad():
            tower.eval()
            imgs, *_ = held.batch(held_idx)
            tower(pixel_values=to_pixels(imgs))
            held_items = pooled_targets(held.scenes(held_idx), shapes, colors, tags=item_tag_names(args))
            _, held_accs = pooled_losses(tap.value[:, 1:, :], held_items, heads)
            if early_heads is not None:
                _, early_held = pooled_losses(tap.early[:, 1:, :], held_items, early_heads)
                held_accs.update({f"early_{k}": v for k, v in early_held.items()})
            tower.train()
        return held_accs

    for step in range(args.vision_steps):
        # Warmup, then cosine to 10 % of the peak.
        warm = min(1.0, (step + 1) / 30)
        for g in opt.param_groups:
            g["lr"] = args.vision_lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * step / args.vision_steps)))
        digits = min(half, len(digit_idx))  # a tiny pack (smoke test) may hold fewer digit scenes
        counts = min(args.vision_count_scenes, len(count_idx)) if count_idx is not None else 0
        parts = [rng.choice(len(train), size=args.vision_batch - digits - counts, replace=False),
                 rng.choice(digit_idx, size=digits, replace=False)]
        if counts:
            parts.append(rng.choice(count_idx, size=counts, replace=False))
        idx = ranks.share(np.unique(np.concatenate(parts)))
        imgs, *_ = train.batch(idx)
        scenes = train.scenes(idx)
        if args.vision_extra_boxes > 0:
            imgs, scenes = paste_extra_digit_boxes(imgs, scenes, draw_donor_boxes(len(idx) * args.vision_extra_boxes),
                                                   paste_rng, args.vision_extra_boxes)
        if args.digit_augment > 0:
            imgs = augment_digit_boxes(imgs, scenes, augment_rng, args.digit_augment)
        items = pooled_targets(scenes, shapes, colors, tags=item_tag_names(args))
        kept = (kept_patches(items, scenes, args.vision_patch_keep, keep_rng, args.vision_patch_groups)
                if args.vision_patch_keep > 0 else None)
        with autocast(args):
            if kept is None:
                tower(pixel_values=to_pixels(imgs))
                value, early_value, on_kept = tap.value, tap.early, items
            else:
                value, early_value = tower_on_kept(tower, tap, to_pixels(imgs), kept)
                on_kept = items_on_kept(items, kept[0])
            losses, accs = pooled_losses(value[:, 1:, :], on_kept, heads)
            loss = sum(args.vision_count_weight * v if k in COUNT_HEADS else v for k, v in losses.items()) / len(losses)
            if early_heads is not None:
                early, _ = pooled_losses(early_value[:, 1:, :], on_kept, early_heads)
                loss = loss + sum(early.values()) / len(losses)
                losses.update({f"early_{k}": v for k, v in early.items()})
            if align is not None:
                aligned = align(value[:, 1:, :], scenes, items, kept) if kept is not None else \
                    align(value[:, 1:, :], scenes, items)
                losses.update(aligned)
                loss = loss + sum(aligned_weight(args, k) * v for k, v in aligned.items())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        ranks.average_gradients(params)
        opt.step()
        if ema is not None:
            with torch.no_grad():
                decay = min(args.vision_ema, (1 + step) / (10 + step))
                torch._foreach_lerp_(ema, live_weights, 1.0 - decay)
        gate_step = gate and bool(args.vision_until) and step == args.vision_gate_step
        if step % args.vision_check_every == 0 or step == args.vision_steps - 1 or gate_step:
            held_accs = ranks.main_wide(held_out_accuracies)
            entry = {"vision_step": step, "loss": round(float(loss.detach()), 4), "s": round(time.time() - t0, 1),
                     **{k: round(float(losses[k].detach()), 4) for k in ("align", "readout") if k in losses},
                     "heldout_pooled_acc": {k: round(a, 3) for k, (a, _) in held_accs.items()},
                     "heldout_items": {k: n for k, (_, n) in held_accs.items()}}
            missing = sorted(set(args.vision_until) - held_accs.keys()) if step == 0 else []
            if missing:  # checked at the first check, not 500 steps in
                raise SystemExit(f"--vision-until: the stage has no head {missing[0]} (heads: {sorted(held_accs)})")
            short = sorted(k for k, v in args.vision_until.items() if held_accs[k][0] < v) if gate_step else []
            if short:
                entry["gate_short"] = short
            log.append(entry)
            print(f"[train] {json.dumps(entry)}", file=sys.stderr, flush=True)
            if short:
                return log
    if ema is not None:
        with torch.no_grad():
            torch._foreach_copy_(live_weights, ema)
        held_accs = ranks.main_wide(held_out_accuracies)
        entry = {"vision_step": "ema", "decay": args.vision_ema,
                 "heldout_pooled_acc": {k: round(a, 3) for k, (a, _) in held_accs.items()}}
        log.append(entry)
        print(f"[train] {json.dumps(entry)}", file=sys.stderr, flush=True)
    return log


def vision_stage_gated(train_stage, stage: torch.nn.Module, retries: int, log=print) -> list[dict]:
    """train_stage(attempt, gate) -> its log entries, under --vision-until: a try whose held-out check at
    --vision-gate-step falls short starts the stage over (run_with_restarts) on the draws of attempt
    1, 2, ... (at most `retries` times); the last try runs to the end whatever it reaches (it runs with
    gate False). How fast the tower forms is a draw (session 48: held-out shape 0.48-0.84 at step 500
    on one pre-stage, rates 3 % apart), and a slow start ends with fewer digits read. Returns every
    try's entries, each with "try" when a try was started over. retries 0: no gate, no snapshot."""
    if retries == 0:
        return train_stage(0, False)

    def attempt_run(attempt: int) -> tuple[list[dict], bool]:
        run = train_stage(attempt, attempt < retries)
        short = run[-1].get("gate_short") if run else None
        if short:
            log(json.dumps({"vision_gate": "short", "kinds": short, "try": attempt, "then": "start over"}))
        return run, bool(short)

    runs = run_with_restarts(stage, retries + 1, attempt_run)
    return runs[0] if len(runs) == 1 else [{**e, "try": a} for a, run in enumerate(runs) for e in run]


# Relation phase kinds of --prestage-relation-schedule: (share of horizontal-word draws, or None for
# the four words evenly; the comparator probe's horizontal and vertical target weights).
RELATION_AXES = {"h": (0.8, (3.0, 1.0)), "v": (0.2, (1.0, 3.0)), "all": (None, (1.0, 1.0))}


def parse_relation_schedule(text: str) -> list[tuple[float | None, tuple[float, float], int]]:
    """"h200,v150,all100" -> [(share, axis weights, steps), ...]; "" -> []."""
    phases = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        axis = item.rstrip("0123456789")
        steps = item[len(axis):]
        if axis not in RELATION_AXES or not steps or int(steps) <= 0:
            raise SystemExit(f"--prestage-relation-schedule: expected AXIS+STEPS with AXIS one of "
                             f"{sorted(RELATION_AXES)} and STEPS > 0, got {item!r}")
        share, weights = RELATION_AXES[axis]
        phases.append((share, weights, int(steps)))
    return phases


def parse_question_scenes(text: str) -> dict[str, int]:
    """--joint-question-scenes "count=8,digit=4" -> {"count": 8, "digit": 4}."""
    out: dict[str, int] = {}
    for part in filter(None, text.split(",")):
        kind, _, n = part.partition("=")
        if kind not in decoder_prestage.KINDS or not n.isdigit() or kind in out:
            raise SystemExit(f"--joint-question-scenes: expected TYPE=N,... with TYPE one of {decoder_prestage.KINDS} "
                             f"(each once), got {part!r}")
        out[kind] = int(n)
    return out


def parse_until(option: str, text: str, kinds: list[str] | None = None) -> dict[str, float]:
    """--prestage-first-until "position=0.85" -> {"position": 0.85} (empty text: no gate); `kinds`: the
    names allowed (default: the pre-stage's kinds and digit_two_box)."""
    kinds = kinds if kinds is not None else decoder_prestage.KINDS + ["digit_two_box"]
    out: dict[str, float] = {}
    for part in filter(None, text.split(",")):
        kind, _, figure = part.partition("=")
        try:
            accuracy = float(figure)
        except ValueError:
            accuracy = -1.0
        if kind not in kinds or not 0 < accuracy <= 1 or kind in out:
            raise SystemExit(f"{option}: expected KIND=ACCURACY,... with KIND one of {kinds} (each once) and "
                             f"0 < ACCURACY <= 1, got {part!r}")
        out[kind] = accuracy
    return out


def gated_phase(train_phase, stage: torch.nn.Module, seed: int, until: dict[str, float] | None, retries: int,
                log=print) -> list[dict]:
    """train_phase(seed) -> its log entries, under a gate (--prestage-first-until, --prestage-relation-until).

    When a kind of `until` ends the phase below its held-out accuracy, the phase starts over from
    the weights `stage` had before it, on the draws of seed + 1000 * k (k = 1.. `retries`); the
    last try stands whatever it reaches. The routing forms abruptly or stalls for good: seed 2's
    first phase stalled with position near 0.6 and stayed there when it ran twice as long (session
    38), so a stalled phase is started over rather than run on. Whether a restart helps depends on
    how often the phase stalls from that start: at the default rate seed 2's start stalled on all
    three draws tried, with --prestage-first-lr 5e-4 on neither of two. A phase met on its first try computes
    exactly as without the gate. Returns every try's entries, each with "try" when the phase has a gate."""
    if not until:
        return train_phase(seed)

    def attempt_run(attempt: int) -> tuple[list[dict], bool]:
        run = [{**e, "try": attempt} for e in train_phase(seed + 1000 * attempt)]
        short = sorted(k for k, v in until.items() if run[-1]["by_kind"].get(k, 0.0) < v)
        if short:
            log(json.dumps({"gate": until, "short": short, "try": attempt,
                            "then": "start over" if attempt < retries else "keep"}))
        return run, bool(short)

    return [e for run in run_with_restarts(stage, retries + 1, attempt_run) for e in run]


def run_with_restarts(stage: torch.nn.Module, tries: int, attempt_run) -> list[list[dict]]:
    """The restart loop of the gates (gated_phase, vision_stage_gated): attempt_run(attempt) -> (its log
    entries, whether to start over) for attempt 0, 1, ... < tries, until one need not start over. Each
    try after the first starts from the weights `stage` and torch's RNG state had before the first, so
    a first try that stands computes exactly as a plain call. Returns each try's entries."""
    start = {k: v.detach().clone() for k, v in stage.state_dict().items()}
    rng = torch.get_rng_state()
    runs: list[list[dict]] = []
    for attempt in range(tries):
        if attempt:
            stage.load_state_dict(start)
            torch.set_rng_state(rng)
        run, again = attempt_run(attempt)
        runs.append(run)
        if not again:
            break
    return runs


def question_streams(pack: "Pack", question_scenes: dict[str, int], seed: int) -> list[tuple[int, np.ndarray]]:
    """(scenes per step, the pack's indices whose question has that type, shuffled) per entry of
    --joint-question-scenes; the j-th type shuffles with seed + j."""
    types = np.array([Pack.text(t) for t in pack.types[:]])
    streams = []
    for j, (kind, n) in enumerate(question_scenes.items()):
        of_kind = np.flatnonzero(types == kind)
        if not len(of_kind):
            raise SystemExit(f"--joint-question-scenes {kind}={n}: the vision pack has no {kind} questions "
                             "(pass a larger --vision-pack)")
        streams.append((n, np.random.default_rng(seed + j).permutation(of_kind)))
    return streams


PRECISIONS = ("auto", "fp32", "bf16")  # --precision's choices, the first the default


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 in hardware (AVX512-BF16 or AMX tiles), as torch detects it."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def resolve_precision(requested: str, native_bf16: bool) -> str:
    """--precision auto -> bf16 where the CPU has bfloat16 instructions, fp32 where it has not.

    Why: without them torch has no fast bfloat16 matmul on the CPU. On a 2-core AMD EPYC (Zen 2, AVX2 only) a
    2048x256 @ 256x1024 matmul took 2363 ms in bf16 against 25 ms in fp32, one thread: bf16 autocast would
    stall the vision stage there, while on the AVX512-BF16 hosts it is 18-25 % faster (session 19)."""
    if requested == "auto":
        return "bf16" if native_bf16 else "fp32"
    if requested == "bf16" and not native_bf16:
        print("[train] warning: --precision bf16 on a CPU without bfloat16 instructions (AVX512-BF16, AMX): "
              "its matmuls run ~100x slower than fp32 here", file=sys.stderr, flush=True)
    return requested


# What `auto` resolves to where the stages train in fp32 (resolve_auto); under bf16 each is off, the recipe the
# AVX512-BF16 hosts trained (session 40), where none of them has been measured.
FP32_AUTO = {"--digit-augment": 0.5, "--prestage-relation-lr": 5e-4, "--vision-extra-boxes": 2}


def resolve_auto(option: str, requested: str, precision: str) -> float | int:
    """An fp32-only option's `auto` -> 0 (off) under bf16, FP32_AUTO[option] under fp32; a number >= 0 as given,
    a whole one (an int) where FP32_AUTO[option] is an int (a count).

    Why (on a 2-core Zen 2 host without bfloat16 instructions, where every stage trains in fp32):
    - --digit-augment 0.5: without it the recipe read the evaluation boxes as well as the bf16 runs (319 of 389)
      but answered 139 of 250 digit questions; with it 193 (121 fixed / 53 broken overall, p = 2.7e-7; session 42).
      Under bf16 it gained nothing (sessions 29 and 35): the bf16 runs already carried a right read to the answer.
    - --prestage-relation-lr 5e-4 with --vision-extra-boxes 2: 0.935, digits 0.860 on seed 0 (against 0.9135 and
      0.772 with neither: 95 fixed / 52 broken, p = 0.0005) and 0.9085, digits 0.872 on seed 1 (session 45). The
      half rate alone stalled seed 0's vision stage (0.6245, session 44); the extra boxes alone gained seed 0 no
      digit (session 45)."""
    kind = type(FP32_AUTO[option])
    if requested == "auto":
        return kind(0) if precision == "bf16" else FP32_AUTO[option]
    try:
        value = float(requested)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0.0) or (kind is int and not value.is_integer()):
        raise ValueError(f"{option}: expected auto or {'a whole number' if kind is int else 'a number'} >= 0, "
                         f"got {requested!r}")
    return kind(value)


def autocast(args):
    """The training forward passes' autocast context (--precision, resolved)."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16")


def aligned_weight(args, name: str) -> float:
    """Loss weight of an entry of align()'s result."""
    return {"align": args.align_weight, "readout": args.readout_weight}[name]


def to_pixels(imgs: np.ndarray) -> torch.Tensor:
    # The pack's images are already 96x96, so CLIP's resize and center crop are
    # identities; rescale + normalize exactly as CLIPImageProcessor does.
    x = torch.from_numpy(imgs).float().div_(255.0).permute(0, 3, 1, 2)
    mean = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    return (x - mean) / std


def encode_batch(tok: Tokenizer, questions, answers, ids, extra_turns=None, return_turns=False,
                 template: str = PROMPT_TEMPLATE):
    """Left-aligned sequences: <s> USER: <image>*144 q... ASSISTANT: answer </s> [USER: q ASSISTANT: a </s>]...;
    loss on every answer + </s>."""
    seqs, labels = [], []
    turns = []  # per sample: [(position of the turn's "ASSISTANT:" token, question)]
    for i, (q, a) in enumerate(zip(questions, answers)):
        prompt = template.format(question=q).replace("<image>", " ".join(["<image>"] * IMAGE_TOKENS))
        p_ids = tok.encode(prompt).ids
        a_ids = tok.encode(a, add_special_tokens=False).ids + [ids["</s>"]]
        turns.append([(len(p_ids) - 1, q)])
        seq, lab = p_ids + a_ids, [-100] * len(p_ids) + a_ids
        for q2, a2 in (extra_turns[i] if extra_turns else []):
            t_ids = tok.encode(f"USER: {q2} ASSISTANT:", add_special_tokens=False).ids
            a_ids = tok.encode(a2, add_special_tokens=False).ids + [ids["</s>"]]
            turns[-1].append((len(seq) + len(t_ids) - 1, q2))
            seq, lab = seq + t_ids + a_ids, lab + [-100] * len(t_ids) + a_ids
        seqs.append(seq)
        labels.append(lab)
    T = max(map(len, seqs))
    input_ids = torch.full((len(seqs), T), ids["<pad>"], dtype=torch.long)
    attn = torch.zeros((len(seqs), T), dtype=torch.long)
    lab = torch.full((len(seqs), T), -100, dtype=torch.long)
    for i, (s, l) in enumerate(zip(seqs, labels)):
        input_ids[i, :len(s)] = torch.tensor(s)
        attn[i, :len(s)] = 1
        lab[i, :len(l)] = torch.tensor(l)
    if return_turns:
        return input_ids, attn, lab, turns
    return input_ids, attn, lab


@torch.no_grad()
def quick_eval(model, tok, pack: Pack, ids, n: int, batch: int, logits_fn=None,
               template: str = PROMPT_TEMPLATE) -> tuple[float, dict]:
    """Teacher-forced first-answer-token accuracy on a pack (cheap progress signal).

    logits_fn(input_ids, attention_mask, images, idx) -> logits replaces the plain
    model call (experiments that feed the decoder something else)."""
    if logits_fn is None:
        logits_fn = lambda input_ids, attn, imgs, _idx: model(
            input_ids=input_ids, attention_mask=attn, pixel_values=to_pixels(imgs)).logits
    model.eval()
    correct, by_type = 0, {}
    for s in range(0, min(n, len(pack)), batch):
        idx = np.arange(s, min(s + batch, n, len(pack)))
        imgs, qs, ans, types = pack.batch(idx)
        input_ids, attn, lab = encode_batch(tok, qs, ans, ids, template=template)
        logits = logits_fn(input_ids, attn, imgs, idx)
        for i in range(len(idx)):
            pos = int((lab[i] != -100).nonzero()[0])
            ok = int(logits[i, pos - 1].argmax()) == int(lab[i, pos])
            correct += ok
            c, t = by_type.get(types[i], (0, 0))
            by_type[types[i]] = (c + ok, t + 1)
    model.train()
    total = sum(t for _, t in by_type.values())
    return correct / max(total, 1), {k: round(c / t, 4) for k, (c, t) in sorted(by_type.items())}


RNG_STATE_KEY = "__torch_rng_state__"  # in a cached stage's safetensors, next to the weights


def cached_stage(work: Path, key: str, stage: torch.nn.Module, what: str, train,
                 ranks: train_ranks.Ranks | None = None, solo: bool = False) -> list[dict]:
    """Loads `stage`'s weights and log from --work/<key>.*, or runs train() (-> log entries) and
    stores both there: log first, weights last via temp + rename, so the weights' presence means
    the entry is complete (safetensors, no pickle).

    The file also holds torch's global RNG state as train() left it, and loading restores it:
    a stage that draws from that RNG (the pre-stage's probes) would otherwise leave the next
    stage's initial weights depending on whether this one came from the cache. A file without
    the state (written before session 19) counts as a miss.

    A key too long for a file name (the vision stage's embeds the pre-stage's) is cut, with a hash of the
    whole key appended; shorter keys name their files as they always did.

    ranks (--ranks): rank 0 decides whether the entry is there and alone writes it; every rank checks
    that it ends the stage on rank 0's weights. solo: rank 0 alone runs train(), with every rank's
    threads, and the others wait, then load the entry it wrote."""
    ranks = ranks or train_ranks.Ranks()
    if len(key) > 200:  # file names end at 255 bytes; ".safetensors" and ".partial" must fit
        key = f"{key[:160]}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    cache = work / f"{key}.safetensors"

    def load() -> list[dict] | None:
        tensors = safetensors.torch.load_file(cache)
        rng_state = tensors.pop(RNG_STATE_KEY, None)
        if rng_state is None:
            print(f"[train] {cache} holds no RNG state (an older cache): training the {what} again", file=sys.stderr)
            return None
        stage.load_state_dict(tensors, strict=True)
        torch.set_rng_state(rng_state)
        print(f"[train] {what} from {cache}", file=sys.stderr)
        ranks.same_weights(stage, what)
        return json.loads((work / f"{key}.json").read_text())

    if ranks.broadcast_json(cache.exists()) and (log := load()) is not None:
        return log
    if solo and ranks.world > 1:
        if ranks.main:
            with ranks.all_threads():
                log = train()
            store(work, key, cache, stage, log)
        ranks.broadcast_json("stored")  # the others wait here
        if not ranks.main:
            return load()
        ranks.same_weights(stage, what)  # with the others' load()
        return log
    log = train()
    ranks.same_weights(stage, what)
    if ranks.main:
        store(work, key, cache, stage, log)
    return log


def store(work: Path, key: str, cache: Path, stage: torch.nn.Module, log: list[dict]) -> None:
    """cached_stage's entry: the log, then the weights and torch's RNG state via temp + rename."""
    (work / f"{key}.json").write_text(json.dumps(log))
    partial = cache.with_suffix(".partial")
    tensors = {k: v.contiguous() for k, v in stage.state_dict().items()}
    tensors[RNG_STATE_KEY] = torch.get_rng_state()
    safetensors.torch.save_file(tensors, partial)
    os.replace(partial, cache)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vlmopt", required=True, help="path to the vlmopt binary (dataset generator)")
    ap.add_argument("--out", default="models/builtin")
    ap.add_argument("--steps", type=int, default=250,
                    help="joint-stage optimizer steps (each sees --batch new samples)")
    ap.add_argument("--batch", type=int, default=32)
    # From scratch (no pre-stages), 5e-4 was the stable rate (1e-3 and 1.5e-3 stayed at the
    # language prior). After the decoder pre-stage the joint stage only adapts: 5e-4 in the
    # warmup knocked the session-10 pre-staged decoder back (0.70 -> 0.67 held-out in 25 steps).
    # With session 15's stages the joint stage was under-trained at 2e-4: 4e-4, 6e-4 and 1e-3
    # give 0.765, 0.770 and 0.773 on builtin:eval against 0.752 (session 16, docs/BENCHMARKS.md).
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch threads in all (over --ranks' processes)")
    ap.add_argument("--ranks", type=int, default=1,
                    help="N > 1: the vision and joint stages in N processes of --threads / N threads each, each on "
                         "1/N of every batch, the gradients averaged (train_ranks.py): other draws than one process "
                         "(the vision stage its own cache entry); the pre-stage runs in rank 0 with every thread, "
                         "byte for byte one process's. On the 2-core Zen 2: vision stage -15.7 %%, joint stage "
                         "-9.4 %% (session 50)")
    ap.add_argument("--allocator", choices=ALLOCATORS, default=ALLOCATORS[0],
                    help="tcmalloc: re-run this script with tcmalloc preloaded (preload_tcmalloc: ~20 %% faster, "
                         "the same weights); system: the C library's malloc")
    ap.add_argument("--attention", choices=["sdpa", "eager"], default="eager",
                    help="attention kernels while training (the checkpoint's config is the same either way). "
                         "eager (matmul, softmax, matmul) steps the vision tower faster than sdpa's CPU "
                         "flash-attention kernels, whose backward is slow at head size 32: session 22's recipe took "
                         "34.2 min instead of ~39 on session 23's AMD EPYC host, at the same accuracy (0.8485, "
                         "paired p = 0.70). The shipped model (session 25) was trained with eager: other kernels "
                         "round differently and give other weights")
    ap.add_argument("--count-tags", action=argparse.BooleanOptionalAction, default=True,
                    help="every object's symbolic token also carries its count tag: the number words of the "
                         "objects of its colour and of its shape in the scene, each under a fixed rotation of the "
                         "word-embedding space (decoder_prestage.PositionTable.item_tag); the vision stage aligns "
                         "the projector to it and reads it out. A count question becomes an attribute lookup for "
                         "the decoder, and the counting moves to the vision tower: count 0.54 -> 0.75 on images, "
                         "0.871 overall against session 22's 0.8520 (p = 0.019) on an AMD host (session 25; the "
                         "shipped model)")
    ap.add_argument("--digit-tags", nargs="?", const="both", default=None, choices=["both", "next", "side"],
                    help="also the digit tags: an object with a digit box beside it carries that box's digit (next), "
                         "each of two boxes side by side its side (\"left\" / \"right\"; side), each under its own "
                         "rotation (decoder_prestage.TAGS): the two-box digit questions become lookups as well. Both, "
                         "with --count-tags: no gain, digits 0.508, count 0.584 (session 25); with the session-35 "
                         "recipe and --count-tag-steps 300, 0.8475: the tower read the digit beside an object on 4 of "
                         "12 held-out objects and its own digits fell 0.926 -> 0.815; the sides alone 0.877 (session 36)")
    ap.add_argument("--count-tag-steps", type=int, default=150,
                    help="with --count-tags / --digit-tags: pre-stage steps of the questions they serve alone with "
                         "the tags on, after the other phases")
    ap.add_argument("--count-tag-remix-steps", type=int, default=0,
                    help="with --count-tags / --digit-tags: then pre-stage steps of the full mix with the tags on "
                         "(150 until session 39; --prestage-next-to-steps' full mix took its place)")
    ap.add_argument("--prestage-next-to-steps", type=int, default=600,
                    help="a last pre-stage phase of N steps on scenes that also hold the \"which digit is next to "
                         "the X ?\" layout (SymbolicScenes.next_to_scene), digit questions drawn three times as "
                         "often as each other kind, with --prestage-next-to-route-weight's loss on the attention "
                         "to the asked box, and the relation probe at --prestage-remix-comparator-weight. 0 = off")
    ap.add_argument("--prestage-next-to-route-weight", type=float, default=0.5,
                    help="weight of decoder_prestage.route_targets' loss (head 0 of --prestage-route-layer attending "
                         "from the answer position to the asked box) in the --prestage-next-to-steps phase. From a "
                         "finished pre-stage, 600 steps at 0.5 took next-to from 0.06 to 0.92 on symbolic scenes; "
                         "without it the phase stopped at 0.52, a coin between the two boxes")
    ap.add_argument("--prestage-next-to-lr", type=float, default=5e-4,
                    help="learning rate of the --prestage-next-to-steps phase")
    ap.add_argument("--precision", choices=PRECISIONS, default=PRECISIONS[0],
                    help="bf16: the vision and joint stages' forward passes and losses run under CPU autocast to "
                         "bfloat16 (weights, gradients and optimizer state stay float32, and so does the "
                         "checkpoint); the decoder pre-stage always runs in float32. auto: bf16 where the CPU has "
                         "bfloat16 instructions (AVX512-BF16, AMX), "
                         "fp32 elsewhere (see resolve_precision). models/builtin trained in fp32 (--precision fp32 on an AMX host, "
                         "session 51). The training record names the one used")
    ap.add_argument("--work", default=None, help="scratch dir for the packs (default: a temp dir)")
    ap.add_argument("--extra-turns", type=int, default=3,
                    help="question/answer turns derived from each training scene's layout, appended after its own")
    ap.add_argument("--attn-guide-weight", type=float, default=0.0,
                    help="weight of the attention guidance loss (0 = off; the pre-staged decoder routes in "
                         "its own layers, and guidance at one layer fights it)")
    ap.add_argument("--attn-guide-layer", type=int, default=2, help="decoder layer whose attention is guided")
    ap.add_argument("--eval-every", type=int, default=200, help="held-out check every N steps")
    ap.add_argument("--aux-weight", type=float, default=1.0,
                    help="weight of the dense per-patch auxiliary loss on the vision tower (0 = off)")
    ap.add_argument("--vision-steps", type=int, default=2000,
                    help="first train the vision tower (and, with --align-weight, the projector) alone for N "
                         "steps (0 = off). On session 21's Intel host 1000 steps read 0.67 of held-out digit boxes "
                         "(0.93 on the AMD host that trained the session-20 model) and scored 0.7955; 1500: 0.8215; "
                         "2000: 0.8480 (24.7 min end to end there, alone)")
    ap.add_argument("--vision-objective", choices=["pooled", "patch"], default="pooled",
                    help="vision-tower auxiliary loss (first stage and joint stage): per object/box on the mean of "
                         "its patch features (shipped), or per patch (the 900-step model's recipe, 16e7112)")
    ap.add_argument("--vision-check-every", type=int, default=500,
                    help="the vision stage's held-out check (256 scenes, float32 forward: ~3.8 s on the 2-core "
                         "AMD EPYC host) every N steps and at its last step; it trains nothing, so the weights "
                         "are the same at any N (every 100 until session 40: 21 checks, ~80 s)")
    ap.add_argument("--vision-until", default="",
                    help="KIND=ACC,...: a gate on the vision stage (pooled objective); when a head's held-out "
                         "accuracy at --vision-gate-step is below ACC, the stage starts over on other draws "
                         "(--vision-retries). Kinds: the pooled heads and the count tags' heads. How fast the tower "
                         "forms is a draw: held-out shape at step 500 was 0.48-0.92 across runs, and runs below "
                         "~0.75 read fewer digits in the end (session 48). Off: ''")
    ap.add_argument("--vision-gate-step", type=int, default=500, help="the step --vision-until is checked at")
    ap.add_argument("--vision-retries", type=int, default=1,
                    help="with --vision-until: times the vision stage may start over; the last try stands")
    ap.add_argument("--vision-batch", type=int, default=64)
    ap.add_argument("--vision-lr", type=float, default=3e-3)
    ap.add_argument("--prestage-generator-boxes", action=argparse.BooleanOptionalAction, default=True,
                    help="the pre-stage draws the two-box digit layout as the generator does (the left box in the "
                         "image's left half, the right one in the right half: a lookup by side) instead of both "
                         "boxes anywhere on one row (a comparison of their columns). With the 300-step digit phase "
                         "the left/right routing transfers to images in every run (50-56 of 78 right against 26-36 "
                         "without; sessions 29-30; the shipped model, session 31)")
    ap.add_argument("--digit-augment", default="auto",
                    help="redraw every digit box's ink in the vision and joint stages under a fresh random writer "
                         "variation of this strength (augment_digit_boxes: rotation, shear, scale, shift, stroke "
                         "width; 0 = off): the training sheet holds 3000 digits, and the shipped model reads its "
                         "single boxes 0.98 on builtin:train against 0.79 on builtin:eval. auto: off under bf16, "
                         f"{FP32_AUTO['--digit-augment']} under fp32 (see resolve_auto)")
    ap.add_argument("--vision-count-scenes", type=int, default=8,
                    help="scenes of every vision batch drawn from the pack's count questions (the generator's count "
                         "layouts: up to six objects, zero to five of one colour or shape), out of the half not "
                         "drawn from digit scenes; for the count tags (--count-tags), which random scenes mostly "
                         "ask at one or two (0 = off). 8 with --count-tags: count 0.724 against 0.712 without (session 25); "
                         "on the shipped recipe 0.8825 against 0.875 without, count 0.672 against 0.656 (session 30)")
    ap.add_argument("--vision-count-weight", type=float, default=1.0,
                    help="weight of the count tags' pooled heads (count_color, count_shape) in the vision stage, "
                         "against 1 for each other head: the tower reads a count-by-shape tag of three or four "
                         "objects right on 15 of 72 and 25 of 136 of its own training scenes' objects "
                         "(scripts/experiments/count_tag_readout.py; session 31). 3: no better (three 14 of 75, four 8 of 72 on eval), "
                         "and the digit head fell: 0.860 against 0.8825, digits 0.532 (session 31)")
    ap.add_argument("--vision-feature-layer", type=int, default=-2, choices=[-1, -2],
                    help="the tower's hidden state the projector reads (config.json's vision_feature_layer): -2, "
                         "as LLaVA, leaves three of the four layers to the features; -1 uses all four (the stage "
                         "then runs the last layer too). -1 read the count-by-shape tags 0.934 held-out against "
                         "0.752 and lifted count 0.672 -> 0.736, but cost digits (0.640) and relation (0.924): 0.882 "
                         "against 0.8825, and the vision stage took 8.5 %% longer (session 31)")
    ap.add_argument("--vision-early-shape-layer", type=int, default=0,
                    help="L > 0: in the vision stage a pooled shape head also reads each object from layer L's "
                         "output (1-based, before the feature layer), weighted as one more head. Why: the tower "
                         "counts colours (present in the pixels) but not shapes beyond two; shape identity formed "
                         "by layer L leaves the layers after it to count. It does form (held-out 0.93 at L 1, "
                         "0.997 at L 2) but the count-by-shape tags of three and four objects still read 12-19 of "
                         "~75 on eval, and the models draw 0.881 (L 2) and 0.8835 (L 1) against 0.8825: count "
                         "0.72-0.74 (count spans 0.65-0.74 over seven vision stages on the same pre-stage), digits 0.63-0.65 "
                         "(session 32). 0: off")
    ap.add_argument("--vision-extra-boxes", default="auto",
                    help="K: in the vision stage only, each scene of a batch gets up to K more digit boxes, copied "
                         "from other training scenes to free spots (paste_extra_digit_boxes): more boxes for the "
                         "pooled digit head at the same tower cost. 2, fp32 (session 45): the tower reads 10 and 8 "
                         "more of builtin:eval's 389 boxes on seeds 0 and 1; seed 1 (--prestage-relation-lr 5e-4) "
                         "answers 218 of 250 digit questions against 207 without, seed 0 193 as before; with "
                         "--prestage-relation-lr 5e-4 seed 0 answers 215 (0.935 overall: E2s0h, models/builtin in sessions 45-50). auto: "
                         f"{FP32_AUTO['--vision-extra-boxes']} under fp32, 0 (off) under bf16 (see resolve_auto)")
    ap.add_argument("--vision-patch-keep", type=int, default=0,
                    help="K: each vision-stage step runs the tower on K of the 144 patches of each image (kept_patches: "
                         "every patch its items draw on and random background ones; more where the items need more), "
                         "as FLIP drops patches; the joint stage and every evaluation see all patches. 0: all. 1 (the "
                         "items' patches and what their busiest neighbour in the group needs), fp32, with --item-means "
                         "segment (session 47): ~96 patches an image, the vision stage 825 s instead of 1218 s on seed 0 "
                         "(0.9285, digits 0.816; segment alone 0.9315, 0.804: 54 fixed / 60 broken); with "
                         "--vision-patch-groups 3 ~75 patches, 757 s on seed 1 (0.923, digits 0.852; segment alone "
                         "0.9185, 0.888: 58 / 49)")
    ap.add_argument("--vision-patch-groups", type=int, default=1,
                    help="with --vision-patch-keep: the tower runs on the batch in this many groups of samples, "
                         "by how many patches their items draw on, each group as long as its busiest sample needs "
                         "(scripts/bench/vision_patch_keep.py: tower step 0.296 s at 1 group, 0.238 s at 3, 0.489 s "
                         "on all patches). The busiest third of a batch then keeps little or no background: 3 groups on seed 0 "
                         "(session 47, fresh, 32.9 min) read 337 of 389 evaluation boxes against 354 with 1 group and "
                         "scored 0.909, digits 0.720 (vs segment alone: 43 fixed / 88 broken, p = 1e-4)")
    ap.add_argument("--prestage-length-groups", type=int, default=1,
                    help="G > 1: each pre-stage step runs its batch as G groups sorted by length, each padded to its "
                         "own longest row, the losses divided by their counts over the whole batch: the same loss "
                         "and gradients up to summation order (decoder_prestage.step_loss), fewer padded slots")
    ap.add_argument("--decoder-loss-rows", action=argparse.BooleanOptionalAction, default=False,
                    help="the decoder's last layer runs on the positions the answer loss reads only, in the pre-stage "
                         "and the joint stage (scripts/decoder_rows.py): the same loss and gradients up to summation "
                         "order, a decoder step ~20 %% faster; off, the defaults give E2s0h bit for bit on its host")
    ap.add_argument("--item-means", choices=decoder_prestage.ITEM_MEANS_KERNELS, default="gather",
                    help="how the pooled heads and the readout average an item's patches (decoder_prestage."
                         "item_means): gather (E2s0h's) or segment (models/builtin's since session 51), the same means summed in another order "
                         "(the last bits differ), 10x cheaper with its backward. segment, fp32 (session 46): the vision "
                         "stage ~1210 s instead of ~1640 s; seed 0 0.9315, digits 0.804 (the tower reads 352 of 389 "
                         "boxes, but the joint stage's next-to routing lost 18 of them), below the digit target; "
                         "seed 1 0.9185, digits 0.888 (gather 0.9085, 0.872)")
    ap.add_argument("--pack-in-memory", action=argparse.BooleanOptionalAction, default=True,
                    help="hold the training packs in RAM (~1.6 GB with the vision stage's 50000 scenes) instead of "
                         "reading each batch's rows from HDF5: the same batches; the vision stage's first 200 steps "
                         "86.8 s against 95.0 s (session 49)")
    ap.add_argument("--vision-ema", type=float, default=0.0,
                    help="D in (0, 1): the vision stage ends on an exponential moving average of its weights "
                         "(tower, heads, projector; decay min(D, (1 + t) / (10 + t)) at step t) instead of the last "
                         "step's. Why: the stage's learning rate ends at 10 %% of its peak, so the last step's "
                         "weights still carry the last batches' noise. 0.995: worse, 0.869 against 0.8825 with "
                         "session 31's joint stage, 0.8865 against 0.8905 with the shipped one (session 33). 0: off")
    ap.add_argument("--aux-balanced", action="store_true",
                    help="weight object and background patches equally in the per-patch auxiliary loss "
                         "(see balanced_patch_loss)")
    ap.add_argument("--init-from", default=None,
                    help="start from this checkpoint directory instead of random weights (experiments)")
    ap.add_argument("--balanced-turns", action=argparse.BooleanOptionalAction, default=True,
                    help="draw the derived turns round-robin by kind (see derived_turns); uniformly over all "
                         "candidates, relation questions (every pair, four relations) would crowd out the rest")
    ap.add_argument("--decoder-prestage-steps", type=int, default=750,
                    help="first train the decoder alone on symbolic scenes, one token per object (see "
                         "scripts/decoder_prestage.py; 0 = off)")
    ap.add_argument("--decoder-prestage-batch", type=int, default=64)
    ap.add_argument("--decoder-prestage-lr", type=float, default=1e-3)
    ap.add_argument("--readout-weight", type=float, default=1.0,
                    help="weight of the loss reading each object's and box's words out of its mean projected "
                         "feature through the decoder's embeddings (decoder_prestage.readout_loss; with "
                         "--align-weight)")
    ap.add_argument("--prestage-side-words", action=argparse.BooleanOptionalAction, default=True,
                    help="symbolic image tokens (and the aligned targets) also carry their side in word-embedding "
                         "space (decoder_prestage.PositionTable); with --prestage-position-first")
    ap.add_argument("--prestage-position-first", type=int, default=500,
                    help="start the pre-stage with N steps of --prestage-first-kinds questions only: in the full "
                         "mix the decoder never learns to read the side (0.56-0.62 held-out, with or without side "
                         "words, also when continued), started this way it keeps it (0.94) (0 = off)")
    ap.add_argument("--prestage-first-kinds", default="size,position,count,count",
                    help="question kinds of the --prestage-position-first phase (comma-separated, of "
                         "decoder_prestage.KINDS; a kind listed twice is drawn twice as often); with count "
                         "the full mix's routing formed by step 1000 instead of ~2500 (session 14)")
    ap.add_argument("--prestage-first-lr", type=float, default=5e-4,
                    help="learning rate of the --prestage-position-first phase (0 = --decoder-prestage-lr's). At "
                         "1e-3 seed 2's phase stalled with position at 0.69 (three draws: 0.69-0.80) and its main mix "
                         "never formed the colour and shape routing (0.7715 on builtin:eval); at 5e-4 it formed on "
                         "every draw tried (0.92-0.98) and counted better there (0.71 vs 0.58), seed 0 scored 0.9015 "
                         "(0.8995 at 1e-3, p = 0.83; session 38)")
    ap.add_argument("--prestage-first-until", default="",
                    help="gate on the --prestage-position-first phase, KIND=ACCURACY,...: when a listed kind's "
                         "held-out accuracy ends below its figure, the phase starts over from the weights it "
                         "started from, on other draws (at most --prestage-retries times); empty = no gate")
    ap.add_argument("--prestage-relation-until", default="",
                    help="gate on each --prestage-relation-schedule phase, KIND=ACCURACY,... as for "
                         "--prestage-first-until (empty = no gate). Seed 1's horizontal phase stalls under fp32 "
                         "(0.42; relation 0.756 on images against the shipped model's 0.952). With relation=0.7 "
                         "all three tries stalled (0.42-0.49) and the vertical phase after them too (0.47-0.50 "
                         "against 0.87 without the gate): the stall comes from where the full mix left the "
                         "decoder, not from the draws (session 43)")
    ap.add_argument("--prestage-relation-lr", default="auto",
                    help="learning rate of the --prestage-relation-schedule phases (0 = --decoder-prestage-lr's; "
                         f"auto: {FP32_AUTO['--prestage-relation-lr']} under fp32, 0 under bf16: see resolve_auto). "
                         "Seed 1's phases stall at 1e-3 under fp32 (0.42 / 0.87 / 0.71 on symbolic scenes) and form "
                         "at 5e-4 (0.84 / 0.92 / 0.96; seed 0 at 1e-3: 0.87 / 0.92 / 0.95), as half the rate formed "
                         "seed 2's first phase (session 43). On images (fp32, session 44) seed 1 scores 0.9165 "
                         "(0.897 at 1e-3; relation 0.980, digits 0.828), but seed 0's vision stage did not form "
                         "shape or digit after this pre-stage (0.6245); with --vision-extra-boxes 2 it did, and "
                         "scored 0.935 (session 45). Not measured under bf16")
    ap.add_argument("--prestage-retries", type=int, default=2,
                    help="the most times a gated phase starts over")
    ap.add_argument("--prestage-next-to", action=argparse.BooleanOptionalAction, default=False,
                    help="the pre-stage also samples the generator's digit-next-to-object layout")
    ap.add_argument("--prestage-count-layouts", action=argparse.BooleanOptionalAction, default=True,
                    help="the pre-stage asks its count questions on the generator's count layouts "
                         "(decoder_prestage.SymbolicScenes.count_sample: answers zero..five uniform)")
    ap.add_argument("--prestage-cooldown", type=int, default=0,
                    help="lower the pre-stage's learning rate linearly to 10 %% over its last N full-mix steps "
                         "(0 = constant)")
    ap.add_argument("--prestage-relation-schedule", default="h150,v100,all100",
                    help="after the full mix, phases of relation questions alone with the comparator probe, "
                         "then --prestage-remix-steps of the full mix again (comma-separated AXIS+STEPS; \"\" = "
                         "neither). hN: N steps asking \"left of\" / \"right of\" 4 times in 5 and weighing the "
                         "probe's horizontal target 3:1; vN: the same for \"above\" / \"below\"; allN: the four "
                         "words evenly. In the mix the probe did not start relation within 200 steps, alone it "
                         "reached 0.92 in 300 (session 17); with the four words evenly the vertical comparison "
                         "formed and the horizontal one did not (eval: left of / right of 0.50-0.52), while "
                         "h150,v100,all100 formed both (0.88-0.94 per word on symbolic scenes; session 18)")
    ap.add_argument("--prestage-remix-steps", type=int, default=0,
                    help="full-mix steps after the relation phases, for the kinds they set back (250 until "
                         "session 39; --prestage-next-to-steps' full mix, with the same probe, took its place)")
    ap.add_argument("--prestage-remix-digit-weight", type=int, default=1,
                    help="in the remix, digit questions are drawn this many times as often as each other kind "
                         "(1 = evenly): evenly, the two-box form (\"which digit is in the left box ?\") stayed at "
                         "0.38 on symbolic scenes, at 5 it reached 0.70 within the remix (session 19)")
    ap.add_argument("--prestage-digit-steps", type=int, default=300,
                    help="digit questions (with the other kinds of --prestage-digit-kinds) for N pre-stage steps "
                         "after the relation phases, before the remix (0 = off; like the remix, it runs only with --prestage-relation-schedule). 150: the two-box digit form ends the pre-stage at 0.85 on symbolic "
                         "scenes instead of 0.38, and the model answers 0.584 of the digit questions instead of "
                         "0.508 (47 fixed / 28 broken, p = 0.037; 0.8520 vs 0.8480 overall, session 22). 300 on the AMD hosts, "
                         "where 150 did not form it (session 23); the shipped recipe since session 31")
    ap.add_argument("--prestage-digit-kinds", default="digit,digit,digit,digit,digit,relation",
                    help="the kinds the digit phase draws, comma-separated; a kind listed k times is drawn k "
                         "times as often, and with relation among them the phase has the remix's comparator "
                         "probe (as --prestage-binding-kinds). Digits alone for 300 steps on the generator's "
                         "boxes formed the left/right form (0.96) but the remix after it no longer restored "
                         "relation (0.57 at the pre-stage's end, 0.680 on images; session 29); digit x5,relation "
                         "kept it (0.93 at the pre-stage's end, two-box digits 0.91; on images relation 0.924, "
                         "left/right 56 of 78 right; without --digit-augment 0.968 and 50 of 78, digits 0.636, "
                         "0.875 overall against t5's 0.871, count 0.656; with --vision-count-scenes 8 as well 0.8825, "
                         "digits 0.680, count 0.672; session 30; the shipped recipe since session 31)")
    ap.add_argument("--prestage-digit-early", action=argparse.BooleanOptionalAction, default=False,
                    help="the digit phase right after the main mix, before the relation phases, instead of "
                         "after them. There 300 steps on the generator's boxes did not form the left/right form "
                         "(0.50 at the phase's end against 0.96 after the relation phases; session 30)")
    ap.add_argument("--prestage-digit-next-to", action=argparse.BooleanOptionalAction, default=False,
                    help="the digit phase's scenes also hold the \"which digit is next to the X ?\" layout "
                         "(SymbolicScenes.next_to_scene), a quarter of its digit questions. With digit x5,relation "
                         "on the generator's boxes the phase then formed neither form (two-box 0.50 at its end; "
                         "next-to 0.006 at the pre-stage's end; session 30)")
    ap.add_argument("--prestage-binding-steps", type=int, default=0,
                    help="colour and exist questions alone for N pre-stage steps after the digit phase, before "
                         "the remix, on the generator's binding layouts (decoder_prestage.SymbolicScenes."
                         "binding_sample: \"what color is the large X ?\" beside a small X, \"is there a red X ?\" "
                         "with lures sharing the colour or the shape), which the remix and the tag phases then "
                         "draw too (0 = off; runs only with --prestage-relation-schedule). Every model through "
                         "session 25 answered the sized pair at chance. 150 did not form it (colour 0.70 on these "
                         "layouts at the phase's end, the sized pair 22 of 60 right on images) and the remix lost "
                         "size and relation: 0.846 against 0.871 without; 600 steps left the pair at chance too (session 26)")
    ap.add_argument("--prestage-remix-comparator-weight", type=float, default=0.2,
                    help="weight of the comparator probe in the remix: without it the remix erased formed "
                         "comparisons (per word 0.88-0.94 -> 0.55-0.78), at the relation phases' 1.0 it kept "
                         "colour, shape and size from recovering (held-out 0.68), at 0.2 relation held at 0.75-0.93 "
                         "per word and the rest recovered (held-out 0.83; session 18). 0 = off")
    ap.add_argument("--prestage-comparator-weight", type=float, default=1.0,
                    help="weight of the relation phase's probe on the comparison its questions ask (is the second "
                         "object right of / below the first; decoder_prestage.comparator_targets): without it "
                         "relation stays at chance, an XOR the answer loss alone gives no gradient to "
                         "(session 17); in the full mix it kept the routing from forming. 0 = off")
    ap.add_argument("--prestage-count-weight", type=float, default=0.0,
                    help="weight of a probe on the count a count question asks (decoder_prestage.count_targets, "
                         "ordinal) in every pre-stage phase, read where the comparator probe reads (0 = off)")
    ap.add_argument("--prestage-route-weight", type=float, default=0.0,
                    help="weight of a loss on one attention head (--prestage-route-layer, head 0) attending from "
                         "the answer position to the box a two-box digit question asks about "
                         "(decoder_prestage.route_targets), in the remix phase (eager attention there). Off: "
                         "at 1.0 in every phase (with --prestage-count-route-weight 1) the main mix's colour and "
                         "digit routing did not form (held-out colour 0.26, digit 0.09 at step 749, against "
                         "0.87 / 0.62 without), and at 0.5 in the remix the two-box form ended lower (0.29 vs "
                         "0.38; session 21); at 1.0 in the remix after a routed binding phase it lost position "
                         "and relation (0.6, 0.56; session 26). 0 = off")
    ap.add_argument("--prestage-count-route-weight", type=float, default=0.0,
                    help="the same on head 2 of that layer for count questions: the attention from the answer "
                         "position spread evenly over <s> and the objects counted "
                         "(decoder_prestage.count_route_targets), in the remix phase. At 0.5 with "
                         "--prestage-route-weight 0.5 the remix ended at count 0.43, two-box digits 0.29 and "
                         "held-out 0.788, against 0.50 / 0.38 / 0.843 without (session 21). 0 = off")
    ap.add_argument("--prestage-binding-route-weight", type=float, default=0.0,
                    help="the --prestage-route-weight loss in the binding phase (--prestage-binding-steps), "
                         "where a sized colour question's target is the object it names: at 1.0 with 300 "
                         "binding steps that colour "
                         "rose 0.69 -> 0.80 over the phase's last 50 steps (0.73-0.74 without, in 600; "
                         "session 26), with 600 steps to 0.97: the pair forms; 500 steps with a 500-step remix "
                         "kept it to the end (colour 0.956 on builtin:eval, the pair 52 of 60) but lost relation "
                         "(0.524; 0.814 overall; session 27, see --prestage-binding-early). 0 = off")
    ap.add_argument("--prestage-binding-early", action=argparse.BooleanOptionalAction, default=False,
                    help="the binding phase right after the main mix, before the relation phases, instead of "
                         "after the digit phase. Late (600 steps, route loss 1.0: colour 0.97 on the binding "
                         "layouts) the remix ended at position 0.72 and relation 0.43, against 0.97 and 0.87 "
                         "without the phase; early (colour 0.93) the relation phases no longer formed relation "
                         "(0.51-0.54 against 0.66-0.93; session 27)")
    ap.add_argument("--prestage-binding-kinds", default="color,exist",
                    help="the kinds the binding phase draws, comma-separated; a kind listed k times is drawn k "
                         "times as often, and with relation among them the phase has the remix's comparator probe. "
                         "color,exist alone cost position and relation (--prestage-binding-early); every kind with "
                         "colour and exist twice (600 steps, route loss 1.0) did not form the pair (colour 0.63 on "
                         "the binding layouts at the phase's end; 0.860 against 0.871 without the phase, count "
                         "0.676; session 27); color x4,exist,relation (500 steps, route loss 1.0, "
                         "--prestage-binding-freeze-positions) kept relation (0.932) and formed the pair (48 of 60, "
                         "colour 0.952) but count fell (0.660): 0.875 (p = 0.62; session 28)")
    ap.add_argument("--prestage-binding-freeze-positions", action=argparse.BooleanOptionalAction, default=False,
                    help="the pre-stage's position table (PositionTable: the row and column embeddings) frozen in "
                         "the binding phase, whose questions never ask where an object is: trained there, "
                         "position read 0.85 after the remix, frozen 0.95 (0.94 without the phase; session 28)")
    ap.add_argument("--prestage-route-layer", type=int, default=2,
                    help="decoder layer whose heads 0 (--prestage-route-weight) and 2 "
                         "(--prestage-count-route-weight; another key/value group) are guided")
    ap.add_argument("--prestage-comparator-layer", type=int, default=2,
                    help="decoder layer whose output at the answer position the comparator probe reads")
    ap.add_argument("--vision-pack", type=int, default=None,
                    help="samples of builtin:train the vision stage (and the joint stage's digit and count scenes) "
                         "draw from (0 = the joint stage's pack, --steps x --batch; default: all of builtin:train, "
                         "as many as `vlmopt datasets show` reports). All of builtin:train (50000) holds 6250 digit scenes with 2883 distinct training digits and 6250 count "
                         "scenes; 28800 (sessions 11-34) held 3599 / 2551 / 3592, and the tower memorised them: "
                         "held-out digit 0.87 -> 0.93, count_shape 0.75 -> 0.91, builtin:eval 0.8905 -> 0.8995 "
                         "(session 35)")
    ap.add_argument("--joint-digit-scenes", type=int, default=8,
                    help="of each joint-stage batch, this many scenes with digit boxes drawn from the vision "
                         "pack (its digit scenes in a fixed random order) instead of the next scenes of the "
                         "joint pack, where 1 in 8 has a box")
    ap.add_argument("--joint-question-scenes", default="count=8",
                    help="TYPE=N,...: N scenes per joint step drawn from the vision pack's questions of that "
                         "type (e.g. count=8), in place of joint-pack scenes")
    ap.add_argument("--joint-tower-lr-scale", type=float, default=0.3,
                    help="the vision tower's learning rate in the joint stage, as a fraction of --lr (the decoder's). "
                         "Why: the vision stage ends at 10 %% of its 3e-3 peak, and a 1e-3 peak in the joint stage "
                         "moves the tower's features (its count tags) again. 1 (session 31's recipe): 0.8825, count "
                         "0.672; 0.3: 0.8905, count 0.740; 0.1: 0.887; 0 (frozen): 0.8895 (session 33)")
    ap.add_argument("--joint-digit-turns-first", action=argparse.BooleanOptionalAction, default=False,
                    help="the --joint-digit-scenes' derived turns ask their digit questions first")
    ap.add_argument("--align-weight", type=float, default=1.0,
                    help="weight of the loss pulling the projector's output per patch onto the pre-staged "
                         "decoder's symbolic image tokens (vision first stage and joint stage; needs "
                         "--decoder-prestage-steps)")
    ap.add_argument("--align-object-centres", action=argparse.BooleanOptionalAction, default=True,
                    help="align (and read out) an object's words on its centre patch only, its other patches "
                         "to their position vector like the background: the pre-stage's one token per object, "
                         "so that counting the tokens that carry a word counts the objects")
    ap.add_argument("--align-box-centres", action=argparse.BooleanOptionalAction, default=False,
                    help="the same for a digit box: \"box\" and its digit word on the patch holding its centre, "
                         "as the pre-stage's one box token (the tower's pooled digit head still reads the "
                         "whole box). Off: no measurable effect (0.7975 vs 0.7955 without, 107 fixed / 103 "
                         "broken, p = 0.84; digits 0.212 vs 0.208; session 21, Intel host)")
    args = ap.parse_args()
    # The feature layer's hidden_states index: with 4 layers, -2 is the 3rd layer's output, -1 the 4th's.
    feature_layer_index = VISION_LAYERS + 1 + args.vision_feature_layer
    if not 0 <= args.vision_early_shape_layer < feature_layer_index:
        ap.error(f"--vision-early-shape-layer: expected 0 (off) or 1..{feature_layer_index - 1} (a layer before "
                 f"--vision-feature-layer {args.vision_feature_layer}), got {args.vision_early_shape_layer}")

    if not 0.0 <= args.vision_ema < 1.0:
        ap.error(f"--vision-ema: expected 0 (off) or a decay in (0, 1), got {args.vision_ema}")
    if args.joint_tower_lr_scale < 0.0:
        ap.error(f"--joint-tower-lr-scale: expected >= 0 (0 freezes the tower), got {args.joint_tower_lr_scale}")
    native_bf16 = cpu_has_native_bf16()
    args.precision = resolve_precision(args.precision, native_bf16)
    print(f"[train] precision: {args.precision} (CPU bfloat16 instructions: {native_bf16})", file=sys.stderr, flush=True)
    try:
        args.digit_augment = resolve_auto("--digit-augment", args.digit_augment, args.precision)
        args.prestage_relation_lr = resolve_auto("--prestage-relation-lr", args.prestage_relation_lr, args.precision)
        args.vision_extra_boxes = resolve_auto("--vision-extra-boxes", args.vision_extra_boxes, args.precision)
    except ValueError as e:
        ap.error(str(e))
    decoder_prestage.item_means_kernel = args.item_means
    print(f"[train] digit augmentation: {args.digit_augment}, relation phases' rate: "
          f"{args.prestage_relation_lr or 'the pre-stage rate'}, extra boxes per vision scene: {args.vision_extra_boxes}",
          file=sys.stderr, flush=True)
    # Every check on the arguments alone comes before any work (packing takes ~30 s).
    if args.align_weight > 0 and args.decoder_prestage_steps <= 0:
        raise SystemExit("--align-weight needs --decoder-prestage-steps > 0, the space it aligns to "
                         "(pass --align-weight 0 without a pre-stage)")
    relation_phases = parse_relation_schedule(args.prestage_relation_schedule)  # a bad one fails before any work
    if args.prestage_remix_digit_weight < 1:
        raise SystemExit(f"--prestage-remix-digit-weight: expected >= 1, got {args.prestage_remix_digit_weight}")
    first_until = parse_until("--prestage-first-until", args.prestage_first_until)
    relation_until = parse_until("--prestage-relation-until", args.prestage_relation_until)
    args.vision_until = parse_until("--vision-until", args.vision_until, list(POOLED_HEADS) + list(COUNT_HEADS))
    if args.vision_until and args.vision_objective != "pooled":
        raise SystemExit(f"--vision-until: needs --vision-objective pooled, got {args.vision_objective}")
    if args.vision_until and not 0 < args.vision_gate_step < args.vision_steps:
        raise SystemExit(f"--vision-gate-step: expected 1..{args.vision_steps - 1} (--vision-steps), "
                         f"got {args.vision_gate_step}")
    if args.vision_retries < 0:
        raise SystemExit(f"--vision-retries: expected >= 0, got {args.vision_retries}")
    if relation_until and (set(relation_until) != {"relation"} or not relation_phases):
        raise SystemExit("--prestage-relation-until: the relation phases ask relation only and there must be some "
                         f"(--prestage-relation-schedule {args.prestage_relation_schedule!r}), got "
                         f"{args.prestage_relation_until!r}")
    unasked = sorted(set(first_until) - set(args.prestage_first_kinds.split(",")))
    if unasked:
        raise SystemExit(f"--prestage-first-until: the first phase does not ask {unasked} "
                         f"(--prestage-first-kinds {args.prestage_first_kinds})")
    if args.prestage_first_lr < 0:
        raise SystemExit(f"--prestage-first-lr: expected >= 0, got {args.prestage_first_lr}")
    if args.prestage_retries < 0:
        raise SystemExit(f"--prestage-retries: expected >= 0, got {args.prestage_retries}")
    if not 0 <= args.vision_patch_keep <= GRID * GRID:
        raise SystemExit(f"--vision-patch-keep: expected 0..{GRID * GRID} (patches an image keeps; 0: all), "
                         f"got {args.vision_patch_keep}")
    if args.vision_patch_groups < 1 or args.vision_patch_groups > args.vision_batch:
        raise SystemExit(f"--vision-patch-groups: expected 1..{args.vision_batch} (--vision-batch), got "
                         f"{args.vision_patch_groups}")
    if args.vision_patch_keep and args.vision_objective != "pooled":
        raise SystemExit(f"--vision-patch-keep: needs --vision-objective pooled, got {args.vision_objective}")
    if not 1 <= args.prestage_length_groups <= args.decoder_prestage_batch:
        raise SystemExit(f"--prestage-length-groups: expected 1..{args.decoder_prestage_batch} "
                         f"(--decoder-prestage-batch), got {args.prestage_length_groups}")
    if not 1 <= args.ranks <= max(1, args.threads):
        raise SystemExit(f"--ranks: expected 1..--threads ({args.threads}) processes, got {args.ranks}")
    if args.ranks > 1 and args.vision_steps > 0 and args.vision_objective != "pooled":
        raise SystemExit(f"--ranks: the vision stage splits its batches with --vision-objective pooled only, got "
                         f"{args.vision_objective}")
    if args.decoder_loss_rows and args.attn_guide_weight > 0 and args.attn_guide_layer >= DECODER_LAYERS - 1:
        raise SystemExit(f"--decoder-loss-rows: --attn-guide-layer must read a layer before the last "
                         f"(< {DECODER_LAYERS - 1}), got {args.attn_guide_layer}")
    binding_kinds = args.prestage_binding_kinds.split(",")
    digit_kinds = args.prestage_digit_kinds.split(",")
    for option, listed in (("--prestage-first-kinds", args.prestage_first_kinds.split(",")),
                           ("--prestage-binding-kinds", binding_kinds), ("--prestage-digit-kinds", digit_kinds)):
        unknown = sorted(set(listed) - set(decoder_prestage.KINDS))
        if unknown:
            raise SystemExit(f"{option}: unknown kinds {unknown} (expected some of {decoder_prestage.KINDS})")
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    torch.set_num_threads(args.threads)
    work = Path(args.work or tempfile.mkdtemp(prefix="vlmopt-train-"))
    work.mkdir(parents=True, exist_ok=True)
    # --ranks: ranks 1.. start now, each with its share of the threads, and start up while this one packs.
    ranks = train_ranks.start(args.ranks, args.threads // args.ranks, work)

    vocab_info = json.loads(run_vlmopt(args.vlmopt, "--json", "datasets", "vocab"))
    samples = args.steps * args.batch
    if args.vision_pack is None:  # all of it: the generator, not this script, knows the split's size
        args.vision_pack = json.loads(run_vlmopt(args.vlmopt, "--json", "datasets", "show", "builtin:train"))["size"]
    vision_samples = args.vision_pack or samples

    def train_pack(n: int) -> Pack:
        """The first n samples of builtin:train, packed into --work once."""
        path = work / f"train-{n}.h5"
        if not path.exists():
            print(f"[train] packing builtin:train ({n} samples) -> {path}", file=sys.stderr)
            run_vlmopt(args.vlmopt, "-q", "datasets", "pack", "builtin:train", str(path), "--limit", str(n))
        return Pack(path, in_memory=args.pack_in_memory)

    train = train_pack(samples)
    vision_train = train_pack(vision_samples) if vision_samples != samples else train
    calib_h5 = work / "calib.h5"
    if not calib_h5.exists():
        run_vlmopt(args.vlmopt, "-q", "datasets", "pack", "builtin:calib", str(calib_h5))
    held = Pack(calib_h5)
    ranks.join()  # the other ranks read the packs: they wait until here

    tok = build_tokenizer(vocab_info["words"])
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    config = make_config(tok.get_vocab_size(), ids["<image>"], ids, args.vision_feature_layer)
    if args.init_from:
        # Continue training a checkpoint (an experiment on the step budget; the auxiliary heads
        # are not saved in a checkpoint, so they start fresh).
        model = LlavaForConditionalGeneration.from_pretrained(args.init_from)
        if model.config.to_dict()["text_config"]["vocab_size"] != tok.get_vocab_size():
            raise SystemExit(f"--init-from {args.init_from}: vocabulary size differs from the generator's")
        config = model.config
    else:
        model = LlavaForConditionalGeneration(config)
    # eager also when the guidance loss needs the attention probabilities
    model.set_attn_implementation("eager" if args.attn_guide_weight > 0 else args.attention)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[train] {n_params / 1e6:.2f} M parameters, vocab {tok.get_vocab_size()}", file=sys.stderr)

    if not 0 <= args.joint_digit_scenes < args.batch:
        raise SystemExit(f"--joint-digit-scenes: expected 0..{args.batch - 1} (less than --batch), got {args.joint_digit_scenes}")
    question_scenes = parse_question_scenes(args.joint_question_scenes)
    if not 0 <= sum(question_scenes.values()) < args.batch - args.joint_digit_scenes:
        raise SystemExit(f"--joint-question-scenes: expected 0..{args.batch - args.joint_digit_scenes - 1} scenes in all "
                         f"(less than --batch minus --joint-digit-scenes), got {sum(question_scenes.values())}")
    # scenes per step from the joint pack
    joint_pack_batch = args.batch - args.joint_digit_scenes - sum(question_scenes.values())
    steps_max = min(args.steps, len(train) // joint_pack_batch)
    shapes, colors = vocab_info["answers"]["shape"], vocab_info["answers"]["color"]
    word_id = tok.get_vocab()
    align, prestage_key = None, None
    if args.decoder_prestage_steps > 0:
        decoder = model.model.language_model
        # Created whether or not the stage is cached: the torch RNG must advance the same either way.
        side = (tuple(word_id[w] for w in ("left", "right", "top", "bottom")) if args.prestage_side_words
                else None)
        positions = decoder_prestage.PositionTable(
            config.text_config.hidden_size, side,
            {t: [word_id[w] for w in decoder_prestage.TAG_WORDS[t]] for t in item_tag_names(args)})
        # The stage's sampler and losses live in decoder_prestage.py: a change there is a new stage.
        sampler_version = hashlib.sha256(Path(decoder_prestage.__file__).read_bytes()).hexdigest()[:8]
        prestage_key = (f"decoder-prestage-{args.decoder_prestage_steps}-{args.decoder_prestage_batch}-"
                        f"{args.decoder_prestage_lr}-{args.seed}-{sampler_version}"
                        + ("-side" if args.prestage_side_words else "") + ("-nextto" if args.prestage_next_to else "")
                        + ("-countlayouts" if args.prestage_count_layouts else "")
                        + ("-genboxes" if args.prestage_generator_boxes else "")
                        + (f"-cool{args.prestage_cooldown}" if args.prestage_cooldown else "")
                        + (f"-countprobe{args.prestage_count_weight}" if args.prestage_count_weight else "")
                        + (f"-remixroute{args.prestage_route_weight}-{args.prestage_route_layer}"
                           if args.prestage_route_weight else "")
                        + (f"-remixcountroute{args.prestage_count_route_weight}-{args.prestage_route_layer}"
                           if args.prestage_count_route_weight else "")
                        + ("-eager" if args.attention == "eager" else "")  # other rounding: another stage
                        + (f"-lossrows{hashlib.sha256(Path(decoder_rows.__file__).read_bytes()).hexdigest()[:8]}"
                           if args.decoder_loss_rows else "")
                        + (f"-lengroups{args.prestage_length_groups}" if args.prestage_length_groups > 1 else ""))
        stage = torch.nn.ModuleDict({"decoder": decoder, "positions": positions})
        sampler = decoder_prestage.SymbolicScenes(shapes, colors, SHAPE_PLURALS, args.prestage_next_to,
                                                  count_layouts=args.prestage_count_layouts,
                                                  generator_boxes=args.prestage_generator_boxes)

        def run_prestage(phases: list[dict]) -> list[dict]:
            """decoder_prestage.pretrain on `stage` once per phase; the log entries of all phases."""
            entries = []
            attn_implementation = decoder.config._attn_implementation
            log = lambda line: print(f"[train] {line}", file=sys.stderr, flush=True)
            common = dict(batch=args.decoder_prestage_batch, lr=args.decoder_prestage_lr,
                          comparator_layer=args.prestage_comparator_layer, count_weight=args.prestage_count_weight,
                          route_layer=args.prestage_route_layer, loss_rows=args.decoder_loss_rows,
                          length_groups=args.prestage_length_groups, log=log)
            for i, phase in enumerate(phases):
                options = {k: v for k, v in phase.items() if k not in ("sampler", "tags", "until")}
                positions.tags_active = phase.get("tags", False)
                # The route losses read attention probabilities: eager attention in their phase only,
                # so that the other phases compute as without them.
                routed = options.get("route_weight", 0) > 0 or options.get("count_route_weight", 0) > 0
                decoder.set_attn_implementation("eager" if routed else attn_implementation)
                train_phase = lambda seed, options=options, phase=phase: decoder_prestage.pretrain(
                    decoder, positions, phase.get("sampler", sampler), word_id, **{**common, **options, "seed": seed})
                entries += [{**e, "phase": i} if len(phases) > 1 else e for e in gated_phase(
                    train_phase, stage, options["seed"], phase.get("until"), args.prestage_retries, log)]
            decoder.set_attn_implementation(attn_implementation)
            positions.tags_active = bool(positions.tag_words)
            return entries

        late_sampler = sampler  # the phases after the digit phase (--prestage-binding-steps)
        binding_key = ""
        phases = [dict(steps=args.decoder_prestage_steps, seed=args.seed + 2,
                       held=min(1024, 16 * args.decoder_prestage_steps), cooldown=args.prestage_cooldown)]
        if relation_phases:
            # Relation alone once the full mix has formed the routing, then the mix again (see
            # --prestage-relation-schedule); a relation step costs ~0.3 s.
            for i, (share, axis_weights, steps) in enumerate(relation_phases):
                phases.append(dict(steps=steps, seed=args.seed + 6 + 10 * i, held=min(512, 16 * steps),
                                   kinds=["relation"], comparator_weight=args.prestage_comparator_weight,
                                   comparator_axis_weights=axis_weights,
                                   sampler=dataclasses.replace(sampler, horizontal_share=share),
                                   until=relation_until, lr=args.prestage_relation_lr or args.decoder_prestage_lr))
            if args.prestage_digit_steps > 0:
                # Digit questions alone before the remix: the two-box form ("the left box") forms there
                # and the remix keeps it (0.38 -> 0.85 at the pre-stage's end, session 22).
                digit_phase = dict(steps=args.prestage_digit_steps, seed=args.seed + 12,
                                   held=min(512, 16 * args.prestage_digit_steps), kinds=digit_kinds)
                if "relation" in digit_kinds:
                    digit_phase.update(comparator_weight=args.prestage_remix_comparator_weight)
                if args.prestage_digit_next_to:
                    digit_phase.update(sampler=dataclasses.replace(sampler, next_to=True))
                if args.prestage_digit_early:
                    phases.insert(1, digit_phase)  # right after the main mix
                else:
                    phases.append(digit_phase)
            if args.prestage_binding_steps > 0:
                # Colour and exist alone on the binding layouts, which the later phases keep drawing:
                # in random scenes the sized pair and the one-attribute lures are rare.
                late_sampler = dataclasses.replace(sampler, binding_layouts=True)
                binding_phase = dict(steps=args.prestage_binding_steps, seed=args.seed + 18,
                                     held=min(512, 16 * args.prestage_binding_steps), kinds=binding_kinds,
                                     sampler=late_sampler, route_weight=args.prestage_binding_route_weight,
                                     train_positions=not args.prestage_binding_freeze_positions)
                if "relation" in binding_kinds:
                    binding_phase.update(comparator_weight=args.prestage_remix_comparator_weight)
                if args.prestage_binding_early:
                    phases.insert(1, binding_phase)  # right after the main mix
                else:
                    phases.append(binding_phase)
                binding_key = (f"-binding{args.prestage_binding_steps}"
                               + (f"-bindroute{args.prestage_binding_route_weight}-{args.prestage_route_layer}"
                                  if args.prestage_binding_route_weight else "")
                               + ("-bindearly" if args.prestage_binding_early else "")
                               + (f"-bindkinds{'+'.join(binding_kinds)}" if binding_kinds != ["color", "exist"] else "")
                               + ("-bindfreezepos" if args.prestage_binding_freeze_positions else ""))
            remix_probe = args.prestage_remix_comparator_weight
            if args.prestage_remix_steps > 0:
                # Each kind drawn once in the list, digit questions --prestage-remix-digit-weight times.
                remix_kinds = decoder_prestage.KINDS + ["digit"] * (args.prestage_remix_digit_weight - 1)
                phases.append(dict(steps=args.prestage_remix_steps, seed=args.seed + 8, kinds=remix_kinds,
                                   held=min(1024, 16 * args.prestage_remix_steps), comparator_weight=remix_probe,
                                   sampler=late_sampler,
                                   route_weight=args.prestage_route_weight,
                                   count_route_weight=args.prestage_count_route_weight))
            prestage_key += (f"-rel{args.prestage_relation_schedule.replace(',', '+')}-remix{args.prestage_remix_steps}"
                             f"-cmp{args.prestage_comparator_weight}-{args.prestage_comparator_layer}"
                             + (f"-remixcmp{remix_probe}" if remix_probe else "")
                             + (f"-remixdigit{args.prestage_remix_digit_weight}"
                                if args.prestage_remix_digit_weight != 1 else "")
                             + (f"-digitphase{args.prestage_digit_steps}" if args.prestage_digit_steps else "")
                             + (f"-digitkinds{'+'.join(digit_kinds)}"
                                if args.prestage_digit_steps and digit_kinds != ["digit"] else "")
                             + ("-digitearly" if args.prestage_digit_steps and args.prestage_digit_early else "")
                             + ("-digitnextto" if args.prestage_digit_steps and args.prestage_digit_next_to else "")
                             + binding_key)
        if item_tag_names(args):
            # The tags come on after every other phase: on from the start, the routing by colour and
            # shape did not form in the full mix (colour 0.26, shape 0.28 at the pre-stage's end,
            # session 25). The kinds they serve alone with them, then the full mix with them; with
            # the digit tags the sampler also draws the "next to" layout (next_to_scene).
            tag_kinds = (["count"] if args.count_tags else []) + (["digit"] if args.digit_tags else [])
            tag_sampler = (dataclasses.replace(late_sampler, next_to=True) if "next_digit" in item_tag_names(args)
                           else late_sampler)
            phases.append(dict(steps=args.count_tag_steps, seed=args.seed + 14, kinds=tag_kinds, tags=True,
                               held=min(512, 16 * args.count_tag_steps), sampler=tag_sampler))
            if args.count_tag_remix_steps > 0:
                phases.append(dict(steps=args.count_tag_remix_steps, seed=args.seed + 16, kinds=decoder_prestage.KINDS,
                                   tags=True, held=min(1024, 16 * args.count_tag_remix_steps), sampler=tag_sampler,
                                   comparator_weight=args.prestage_remix_comparator_weight))
            prestage_key += (("-counttags" if args.count_tags else "") + digit_tags_key(args)
                             + f"{args.count_tag_steps}+{args.count_tag_remix_steps}")
        if args.prestage_next_to_steps > 0:
            # Last: the two-hop "next to" lookup, which no earlier phase forms (0.006-0.06 on symbolic scenes
            # at the pre-stage's end, sessions 30 and 39), with a loss on the attention to the asked box.
            phases.append(dict(steps=args.prestage_next_to_steps, seed=args.seed + 20,
                               kinds=["digit"] * 3 + [k for k in decoder_prestage.KINDS if k != "digit"],
                               tags=bool(item_tag_names(args)), held=min(1024, 16 * args.prestage_next_to_steps),
                               sampler=dataclasses.replace(late_sampler, next_to=True),
                               route_weight=args.prestage_next_to_route_weight, lr=args.prestage_next_to_lr,
                               comparator_weight=args.prestage_remix_comparator_weight))
            prestage_key += (f"-nexttophase{args.prestage_next_to_steps}-{args.prestage_next_to_route_weight}"
                             f"-{args.prestage_next_to_lr}")
        if args.prestage_position_first > 0:
            # Size and position (and count) questions alone first: on their own the decoder learns to
            # read the side (session 12), which in the full mix it never does. The key keeps its
            # session-12 form for the kinds of that recipe.
            phases.insert(0, dict(steps=args.prestage_position_first, seed=args.seed + 4,
                                  held=min(512, 16 * args.prestage_position_first),
                                  kinds=args.prestage_first_kinds.split(","), until=first_until,
                                  lr=args.prestage_first_lr or args.decoder_prestage_lr))
            prestage_key += f"-posfirst{args.prestage_position_first}"
            if args.prestage_first_kinds != "size,position":
                prestage_key += "-" + args.prestage_first_kinds.replace(",", "+")
            if args.prestage_first_lr:
                prestage_key += f"-firstlr{args.prestage_first_lr}"
            if first_until:
                prestage_key += f"-firstuntil{args.prestage_first_until}-{args.prestage_retries}"
        if relation_until:
            prestage_key += f"-reluntil{args.prestage_relation_until}-{args.prestage_retries}"
        if args.prestage_relation_lr:
            prestage_key += f"-rellr{args.prestage_relation_lr}"
        # One process's pre-stage under --ranks too (train_ranks.py): the same cache entry.
        prestage_log = cached_stage(work, prestage_key, stage, "decoder pre-stage",
                                    lambda: run_prestage(phases), ranks, solo=True)
        with torch.no_grad():  # the stage trained a tied head; the checkpoint keeps lm_head separate
            model.lm_head.weight.copy_(decoder.embed_tokens.weight)
        projector = model.model.multi_modal_projector

        def align(vision_features, scenes, items, kept=None):
            # The learned row/column tables are frozen after the pre-stage; the side component
            # follows the word embeddings as the joint stage moves them.
            # kept: (index, weights) of kept_patches when vision_features holds only those patches.
            if args.align_object_centres or args.align_box_centres:
                items = pooled_targets(scenes, shapes, colors, object_centres=args.align_object_centres,
                                       box_centres=args.align_box_centres, tags=item_tag_names(args))
            with torch.no_grad():
                position_table = positions.table(decoder.embed_tokens.weight)
            target = decoder_prestage.aligned_targets(scenes, items, decoder.embed_tokens.weight, position_table,
                                                      word_id, shapes, colors, positions)
            projected = projector(vision_features)
            if kept is None:
                out = {"align": decoder_prestage.alignment_loss(projected, target)}
            else:
                # The same scale-free error, as weighted means over the kept patches (kept_patches).
                index, weights = (torch.from_numpy(a) for a in kept[:2])
                target = target.gather(1, index.clamp(min=0).unsqueeze(-1).expand(-1, -1, target.size(-1)))
                out = {"align": decoder_prestage.alignment_loss(projected, target, weights)}
                items = items_on_kept(items, kept[0])
            if args.readout_weight > 0:
                out["readout"] = decoder_prestage.readout_loss(projected, items, decoder.embed_tokens.weight,
                                                               word_id, shapes, colors, positions)
            return out
    else:
        prestage_log = []
    ranks.split_threads()  # the data-parallel stages from here on (the pre-stage ran on rank 0 with every thread)
    tap = VisionTap(model, args.vision_early_shape_layer)
    heads = torch.nn.ModuleDict({k: torch.nn.Linear(config.vision_config.hidden_size, c) for k, c in AUX_HEADS.items()})
    max_count = len(vocab_info["answers"]["count"]) - 1
    vision_log, pooled_heads = [], None
    if args.vision_objective == "pooled":
        pooled_heads = torch.nn.ModuleDict({k: torch.nn.Linear(config.vision_config.hidden_size, c)
                                            for k, c in POOLED_HEADS.items()})
        # The item tags' heads after the others: their initial weights stay as without.
        pooled_heads.update({t: torch.nn.Linear(config.vision_config.hidden_size, len(decoder_prestage.TAG_WORDS[t]))
                             for t in item_tag_names(args)})
    early_heads = None
    if args.vision_early_shape_layer and pooled_heads is not None:  # after the others: their initial weights stay
        early_heads = torch.nn.ModuleDict({"shape": torch.nn.Linear(config.vision_config.hidden_size,
                                                                    POOLED_HEADS["shape"])})
    if args.vision_steps > 0 and pooled_heads is not None:
        # The first stage depends only on these arguments: cache it in --work.
        key = f"vision-pooled-{args.vision_steps}-{args.vision_batch}-{args.vision_lr}-{args.seed}-{vision_samples}"
        key += "-bf16" if args.precision == "bf16" else ""
        key += "-eager" if args.attention == "eager" else ""
        key += ("-counttags" if args.count_tags else "") + digit_tags_key(args)
        key += f"-countscenes{args.vision_count_scenes}" if args.vision_count_scenes else ""
        key += f"-digitaug{args.digit_augment}" if args.digit_augment else ""
        key += f"-countweight{args.vision_count_weight}" if args.vision_count_weight != 1.0 else ""
        key += f"-featurelayer{args.vision_feature_layer}" if args.vision_feature_layer != -2 else ""
        key += f"-earlyshape{args.vision_early_shape_layer}" if args.vision_early_shape_layer else ""
        key += f"-ema{args.vision_ema}" if args.vision_ema else ""
        key += f"-extraboxes{args.vision_extra_boxes}" if args.vision_extra_boxes else ""
        key += f"-means{args.item_means}" if args.item_means != "gather" else ""
        key += f"-keep{args.vision_patch_keep}-footprint" if args.vision_patch_keep else ""
        key += f"-groups{args.vision_patch_groups}" if args.vision_patch_keep and args.vision_patch_groups > 1 else ""
        key += f"-ranks{args.ranks}" if args.ranks > 1 else ""
        if args.vision_until:
            key += (f"-until{'+'.join(f'{k}{v}' for k, v in sorted(args.vision_until.items()))}"
                    f"-at{args.vision_gate_step}-retries{args.vision_retries}")
        stage = torch.nn.ModuleDict({"tower": model.model.vision_tower, "heads": pooled_heads})
        if early_heads is not None:
            stage["early_heads"] = early_heads
        if args.align_weight > 0:
            key += f"-align-{args.align_weight}-{prestage_key}"
            if args.readout_weight > 0:
                key += f"-readout-{args.readout_weight}"
            key += "-centres" if args.align_object_centres else ""
            key += "-boxcentres" if args.align_box_centres else ""
            stage["projector"] = model.model.multi_modal_projector
        vision_log = cached_stage(work, key, stage, "first stage", lambda: vision_stage_gated(
            lambda attempt, gate: pretrain_vision_pooled(
                model, tap, pooled_heads, vision_train, held, shapes, colors, args,
                align=align if args.align_weight > 0 else None, early_heads=early_heads, attempt=attempt, gate=gate,
                ranks=ranks),
            stage, args.vision_retries if args.vision_until else 0,
            log=lambda line: print(f"[train] {line}", file=sys.stderr, flush=True)), ranks)
    elif args.vision_steps > 0:
        vision_log = pretrain_vision(model, tap, heads, vision_train, held, shapes, colors, args)
    # The first stage leaves its last gradients on the tower and heads; the joint stage's first
    # backward would add to them (and a run that loads the cached stage has none: different weights).
    model.zero_grad(set_to_none=True)
    heads.zero_grad(set_to_none=True)
    if pooled_heads is not None:
        pooled_heads.zero_grad(set_to_none=True)
    aux_params = list((pooled_heads if pooled_heads is not None else heads).parameters())
    if args.joint_tower_lr_scale == 1.0:  # one group: session 31's optimizer as it was (its weights reproduce)
        param_groups = [{"params": list(model.parameters()) + aux_params, "lr_scale": 1.0}]
    else:
        tower_ids = {id(p) for p in model.model.vision_tower.parameters()}
        if args.joint_tower_lr_scale == 0.0:  # frozen: no backward through the tower at all
            for p in model.model.vision_tower.parameters():
                p.requires_grad_(False)
        param_groups = [{"params": [p for p in model.parameters() if id(p) not in tower_ids] + aux_params,
                         "lr_scale": 1.0}]
        if args.joint_tower_lr_scale > 0.0:
            param_groups.append({"params": list(model.model.vision_tower.parameters()),
                                 "lr_scale": args.joint_tower_lr_scale})
    opt = torch.optim.AdamW(param_groups, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = 50
    # Linear warmup, then cosine decay to 0 over the fixed step count.
    sched_lr = lambda step: args.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps_max))
    log, t0, rng = [], time.time(), np.random.default_rng(args.seed)
    order = rng.permutation(len(train))
    # Digit scenes for the joint stage (--joint-digit-scenes): their own stream, so that with 0 the
    # joint stage's draws are the shipped recipe's.
    digit_order = (np.random.default_rng(args.seed + 7).permutation(digit_scene_indices(vision_train))
                   if args.joint_digit_scenes > 0 else np.zeros(0, dtype=np.int64))
    if args.joint_digit_scenes > 0 and not len(digit_order):
        raise SystemExit(f"--joint-digit-scenes {args.joint_digit_scenes}: the vision pack has no digit scenes "
                         "(pass --joint-digit-scenes 0 or a larger --vision-pack)")

    # Scenes by question type (--joint-question-scenes), each type its own stream of the vision pack.
    # For count: the generator's count layouts ask zero to five evenly, as builtin:eval does, while
    # the derived turns of random scenes ask mostly "zero" to "two".
    streams = [(args.joint_digit_scenes, digit_order)] + question_streams(vision_train, question_scenes, args.seed + 9)

    def joint_batch(step: int):
        """(images, questions, answers, scenes) of one joint step: the joint pack's next scenes, then
        --joint-digit-scenes digit scenes and --joint-question-scenes' scenes of the vision pack (each
        stream cycling through its scenes)."""
        idx = order[step * joint_pack_batch:(step + 1) * joint_pack_batch]
        imgs, qs, ans, _ = train.batch(idx)
        scenes = train.scenes(idx)
        for n, stream in streams:
            if n <= 0:
                continue
            didx = stream[np.arange(step * n, (step + 1) * n) % len(stream)]
            d_imgs, d_qs, d_ans, _ = vision_train.batch(didx)
            imgs, qs, ans = np.concatenate([imgs, d_imgs]), qs + d_qs, ans + d_ans
            scenes = scenes + vision_train.scenes(didx)
        return imgs, qs, ans, scenes
    joint_augment_rng = np.random.default_rng(ranks.seed(args.seed + 23))
    # The extra turns of a rank's rows: rank 0 goes on with the stream that drew the order.
    turn_rng = rng if ranks.main else np.random.default_rng(ranks.seed(args.seed + 29))
    trained = [p for g in param_groups for p in g["params"]]
    # --decoder-loss-rows: the answer loss reads the logits of a few positions a row (the held-out
    # checks run outside `only` and see every position).
    loss_rows = decoder_rows.LossRows(model.model.language_model) if args.decoder_loss_rows else None
    model.train()
    step = 0
    for step in range(steps_max):
        for g in opt.param_groups:
            g["lr"] = sched_lr(step) * g["lr_scale"]
        imgs, qs, ans, scenes = joint_batch(step)
        rows = ranks.share(np.arange(len(scenes)))  # this rank's rows of the batch (--ranks)
        if ranks.world > 1:
            imgs, qs, ans, scenes = imgs[rows], [qs[i] for i in rows], [ans[i] for i in rows], [scenes[i] for i in rows]
        if args.digit_augment > 0:
            imgs = augment_digit_boxes(imgs, scenes, joint_augment_rng, args.digit_augment)
        items = pooled_targets(scenes, shapes, colors, tags=item_tag_names(args))  # object/box masks: the pooled and align losses share them
        extra = ([derived_turns(sc, shapes, colors, max_count, turn_rng, args.extra_turns, args.balanced_turns,
                                first_kind="digit" if (joint_pack_batch <= i < joint_pack_batch + args.joint_digit_scenes
                                                      and args.joint_digit_turns_first) else None)
                  for i, sc in zip(rows, scenes)]
                 if args.extra_turns > 0 else None)
        input_ids, attn, lab, turns = encode_batch(tok, qs, ans, ids, extra, return_turns=True)
        guide = args.attn_guide_weight > 0
        with autocast(args), (loss_rows.only(lab) if loss_rows is not None else contextlib.nullcontext()):
            out = model(input_ids=input_ids, attention_mask=attn, pixel_values=to_pixels(imgs), labels=lab,
                        output_attentions=guide)
            answer_loss = out.loss
            loss = answer_loss
            aux_losses, aux_fg_acc = {}, {}
            if guide:
                aux_losses["attn"] = attention_guidance_loss(out.attentions, input_ids, turns, scenes, ids["<image>"],
                                                             args.attn_guide_layer, shapes, colors)
                loss = loss + args.attn_guide_weight * aux_losses["attn"]
            if args.aux_weight > 0 and pooled_heads is not None:
                # Keep the first stage's objective on: the answer loss alone drifts the features.
                pooled, pooled_acc = pooled_losses(tap.value[:, 1:, :], items,
                                                   pooled_heads)
                aux_losses.update(pooled)
                aux_fg_acc.update({k: round(a, 3) for k, (a, _) in pooled_acc.items()})
                loss = loss + args.aux_weight * sum(pooled.values()) / len(pooled)
            elif args.aux_weight > 0:
                feats = tap.value[:, 1:, :]  # drop CLS: [B, 144, hidden]
                targets = patch_targets(scenes, shapes, colors)
                for k, head in heads.items():
                    logits, target = head(feats).flatten(0, 1), targets[k].flatten()
                    aux_losses[k] = (balanced_patch_loss(logits, target) if args.aux_balanced else
                                     torch.nn.functional.cross_entropy(logits, target, ignore_index=IGNORE))
                    # Object patches only: what the answers need (the plain loss is mostly background).
                    if (acc := object_patch_accuracy(logits.detach(), target)) is not None:
                        aux_fg_acc[k] = acc
                patch_losses = [v for k, v in aux_losses.items() if k in AUX_HEADS]
                loss = loss + args.aux_weight * sum(patch_losses) / len(patch_losses)
            if args.align_weight > 0:
                aligned = align(tap.value[:, 1:, :], scenes, items)
                aux_losses.update(aligned)
                loss = loss + sum(aligned_weight(args, k) * v for k, v in aligned.items())
        if not torch.isfinite(loss):
            raise SystemExit(f"non-finite loss at step {step}")
        loss.backward()
        ranks.average_gradients(trained)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0:
            entry = {"step": step, "loss": round(float(answer_loss.detach()), 5), "lr": sched_lr(step),
                     "s": round(time.time() - t0, 1), "aux": {k: round(float(v.detach()), 3) for k, v in aux_losses.items()}, "aux_fg_acc": aux_fg_acc}
            # Step 0 too after a decoder pre-stage: what the stages give before any answer loss.
            if step % args.eval_every == 0 and (step > 0 or args.decoder_prestage_steps > 0):
                entry["heldout_acc"], entry["by_type"] = ranks.main_wide(lambda: quick_eval(model, tok, held, ids, 256, 64))
            log.append(entry)
            print(f"[train] {json.dumps(entry)}", file=sys.stderr)
    train_seconds = time.time() - t0
    acc, by_type = ranks.main_wide(lambda: quick_eval(model, tok, held, ids, len(held), 64))
    ranks.same_weights(model, "joint stage")
    ranks.finish()
    if not ranks.main:
        return 0
    step = steps_max
    print(f"[train] done: {step} steps, {train_seconds:.0f} s, calib first-token acc {acc:.4f} {by_type}", file=sys.stderr)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".builtin-", dir=out.parent))  # same filesystem: the rename is atomic
    tap.restore()
    if loss_rows is not None:
        loss_rows.restore()
    model.set_attn_implementation("sdpa")  # HF's default: the saved config as without --attention
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
        "parameters": n_params, "allocator": ALLOCATOR, "prompt_template": PROMPT_TEMPLATE, "calib_first_token_accuracy": acc,
        "calib_by_type": by_type, "vision_log": vision_log, "decoder_prestage_log": prestage_log, "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "log": log}, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    print(f"[train] wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
