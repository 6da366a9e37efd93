#!/usr/bin/env python3
"""Multi-image prompts: vlmopt on builtin:clips agrees with transformers' LlavaForConditionalGeneration.

    VLMOPT_BIN=build/apps/vlmopt/vlmopt python tests/interop/clips_transformers.py [--limit 16]

A clip sample has 3 frames and is prompted with one <image> placeholder per frame
("USER: <image>\\n<image>\\n<image>\\n{question} ASSISTANT:"). This script
  - dumps the first --limit clips with `vlmopt datasets show builtin:clips --dump-dir`
    (lossless PNGs of every frame, the questions and the meta),
  - runs `vlmopt diagnose-align --data builtin:clips` on the builtin model, which records
    per layer and head the last prompt row's attention mass on the image tokens
    (layers[l].last_heads.attn_mass), the answer rows' per-frame masses
    (dt_sem.frame_mass, docs/align.md) and the greedy answer,
  - feeds the same frames and prompt to LlavaForConditionalGeneration (fp32, eager
    attention, output_attentions) and recomputes those quantities from its attention
    probabilities, and its greedy answer with generate().
The attention masses depend on every image token holding the right frame's
features in the right order (a swapped frame moves the per-frame masses), so they
check vlmopt's multi-image scatter without a logits dump. Requires max |delta| of
the masses <= 1e-4, the same attended frame and the same greedy answer on every clip.
Exits 1 with one line per failure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from PIL import Image  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_NEW_TOKENS = 8
TOLERANCE = 1e-4


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--model", default=str(REPO_ROOT / "models" / "builtin"))
    args = ap.parse_args()
    vlmopt = os.environ.get("VLMOPT_BIN", str(REPO_ROOT / "build" / "apps" / "vlmopt" / "vlmopt"))
    model_dir = Path(args.model)
    if not (model_dir / "config.json").exists():
        print(f"FAIL: {model_dir}/config.json missing (train it: scripts/train_builtin.py)")
        return 1

    from transformers import AutoProcessor, LlavaForConditionalGeneration

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    training = model_dir / "vlmopt_training.json"
    template = (json.loads(training.read_text())["prompt_template"] if training.exists()
                else "USER: <image>\n{question} ASSISTANT:")  # vlmopt's default template
    failures: list[str] = []

    with tempfile.TemporaryDirectory(prefix="vlmopt-clips-") as tmp:
        dump, out = Path(tmp) / "frames", Path(tmp) / "align"
        shown = subprocess.run([vlmopt, "-q", "--json", "datasets", "show", "builtin:clips", "--limit", str(args.limit),
                                "--dump-dir", str(dump)], check=True, capture_output=True, text=True)
        samples = json.loads(shown.stdout)["samples"]
        res = subprocess.run([vlmopt, "-q", "diagnose-align", "--model", str(model_dir), "--data", "builtin:clips",
                              "--limit", str(args.limit), "--knockout-limit", "0", "--heatmaps", "0",
                              "--max-new-tokens", str(MAX_NEW_TOKENS), "--prompt-template", template,
                              "--out", str(out)], capture_output=True, text=True)
        if res.returncode != 0:
            print(f"FAIL: vlmopt diagnose-align exited {res.returncode}: {res.stderr.strip()}")
            return 1
        report = json.loads((out / "align.json").read_text())
        frames = [[Image.open(s["image_file"]).convert("RGB")] + [Image.open(f).convert("RGB") for f in s["frame_files"]]
                  for s in samples]

    processor = AutoProcessor.from_pretrained(model_dir)
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, torch_dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    tok = processor.tokenizer
    image_token_id = model.config.image_token_id
    worst = 0.0
    agree = 0
    with torch.no_grad():
        for i, s in enumerate(samples):
            mine = report["samples"][i]
            images = frames[i]
            prompt = template.replace("{question}", s["question"]).replace(
                "<image>", "\n".join(["<image>"] * len(images)), 1)
            inputs = processor(images=images, text=prompt, return_tensors="pt")
            out = model(**inputs, output_attentions=True)
            image_pos = (inputs["input_ids"][0] == image_token_id).nonzero().flatten()
            per_frame = image_pos.numel() // len(images)
            for layer, att in enumerate(out.attentions):  # [1,H,T,T]
                heads = att[0, :, -1, :].double()[:, image_pos].sum(-1)
                ours = torch.tensor(mine["layers"][layer]["last_heads"]["attn_mass"], dtype=torch.float64)
                worst = max(worst, (heads - ours).abs().max().item())
            gen = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            prompt_len = inputs["input_ids"].shape[1]
            hf_answer = tok.decode(gen[0, prompt_len:], skip_special_tokens=True).strip().lower()
            agree += hf_answer == mine["prediction"]
            if hf_answer != mine["prediction"]:
                failures.append(f"{s['id']}: answer transformers {hf_answer!r}, vlmopt {mine['prediction']!r}")
            # Rows emitting the answer tokens (EOS excluded): the last prompt row, then each answer
            # token's row but the last one's.
            answer = []
            for t in gen[0, prompt_len:].tolist():
                if t == tok.eos_token_id:
                    break
                answer.append(t)
            rows = max(1, len(answer))
            if mine["dt_sem"]["answer_rows"] != rows:
                failures.append(f"{s['id']}: answer rows transformers {rows}, vlmopt {mine['dt_sem']['answer_rows']}")
            attentions = out.attentions
            if rows > 1:
                extra = torch.tensor([answer[:-1]], dtype=inputs["input_ids"].dtype)
                full = dict(inputs)
                full["input_ids"] = torch.cat([inputs["input_ids"], extra], 1)
                full["attention_mask"] = torch.cat([inputs["attention_mask"], torch.ones_like(extra)], 1)
                attentions = model(**full, output_attentions=True).attentions
            frame_mass = torch.zeros(len(images), dtype=torch.float64)
            for att in attentions:
                block = att[0, :, prompt_len - 1:prompt_len - 1 + rows, :].double()  # [H,rows,T]
                for f in range(len(images)):
                    frame_mass[f] += block[:, :, image_pos[f * per_frame:(f + 1) * per_frame]].sum(-1).mean()
            frame_mass /= len(attentions)
            ours_mass = torch.tensor(mine["dt_sem"]["frame_mass"], dtype=torch.float64)
            worst = max(worst, (frame_mass - ours_mass).abs().max().item())
            if int(frame_mass.argmax()) != mine["dt_sem"]["attended_frame"]:
                failures.append(f"{s['id']}: attended frame transformers {int(frame_mass.argmax())}, "
                                f"vlmopt {mine['dt_sem']['attended_frame']}")
            print(f"  {s['id']}: event frame {s['meta']['event_frame']}, frame mass {frame_mass.tolist()}, "
                  f"answer {hf_answer!r} (reference {s['answer']!r})")
    n = len(samples)
    print(f"clips vs transformers: max |attention mass delta| {worst:.3g} (tolerance {TOLERANCE}), "
          f"answers agree {agree}/{n}; vlmopt mean dt_sem {report['summary']['dt_sem']['mean_ms']} ms")
    if n < args.limit:
        failures.append(f"only {n} clips shown, asked for {args.limit}")
    if worst > TOLERANCE:
        failures.append(f"attention masses differ by {worst:.3g} > {TOLERANCE}")
    for line in failures:
        print(f"FAIL: {line}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
