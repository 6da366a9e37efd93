#!/usr/bin/env python3
"""vlmopt's greedy answers on the builtin model agree with transformers' `generate`.

    VLMOPT_BIN=build/apps/vlmopt/vlmopt python tests/interop/builtin_generate.py [--limit 200]

Packs the first --limit samples of builtin:eval with `vlmopt datasets pack`
(same images, questions and ids vlmopt evaluates), runs
`vlmopt eval --model builtin --predictions P`, then answers the same samples with
LlavaForConditionalGeneration.generate (greedy, same max_new_tokens) on the
images preprocessed by the checkpoint's own AutoProcessor. Requires agreement on
>= 99.5 % of the samples (issue 3); prints both accuracies and every disagreement.
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

import h5py  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
MIN_AGREEMENT = 0.995
MAX_NEW_TOKENS = 8


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--model", default=str(REPO_ROOT / "models" / "builtin"))
    args = ap.parse_args()
    vlmopt = os.environ.get("VLMOPT_BIN", str(REPO_ROOT / "build" / "apps" / "vlmopt" / "vlmopt"))
    model_dir = Path(args.model)
    if not (model_dir / "config.json").exists():
        print(f"FAIL: {model_dir}/config.json missing (train it: scripts/train_builtin.py)")
        return 1

    from transformers import AutoProcessor, LlavaForConditionalGeneration

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    training = json.loads((model_dir / "vlmopt_training.json").read_text())
    template = training["prompt_template"]

    with tempfile.TemporaryDirectory(prefix="vlmopt-generate-") as tmp:
        pack, preds = Path(tmp) / "eval.h5", Path(tmp) / "pred.jsonl"
        subprocess.run([vlmopt, "-q", "datasets", "pack", "builtin:eval", str(pack), "--limit", str(args.limit)],
                       check=True)
        res = subprocess.run([vlmopt, "-q", "--json", "eval", "--model", str(model_dir), "--data", str(pack),
                              "--predictions", str(preds), "--max-new-tokens", str(MAX_NEW_TOKENS),
                              "--prompt-template", template], capture_output=True, text=True)
        if res.returncode != 0:
            print(f"FAIL: vlmopt eval exited {res.returncode}: {res.stderr.strip()}")
            return 1
        ours = {p["id"]: p for p in map(json.loads, preds.read_text().splitlines())}
        with h5py.File(pack, "r") as f:
            ids = [v.decode() for v in f["ids"][:]]
            questions = [v.decode() for v in f["questions"][:]]
            answers = [v.decode() for v in f["answers"][:]]
            images = f["images"][:]

    processor = AutoProcessor.from_pretrained(model_dir)
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    tok = processor.tokenizer
    agree = hf_correct = ours_correct = 0
    failures = []
    with torch.no_grad():
        for i, sample_id in enumerate(ids):
            prompt = template.replace("{question}", questions[i])
            inputs = processor(images=Image.fromarray(images[i]), text=prompt, return_tensors="pt")
            out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            hf_answer = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
            mine = ours[sample_id]["prediction"].strip()
            agree += hf_answer == mine
            hf_correct += hf_answer == answers[i]
            ours_correct += mine == answers[i]
            if hf_answer != mine:
                print(f"  differ {sample_id}: {questions[i]!r} transformers={hf_answer!r} vlmopt={mine!r}")
    n = len(ids)
    rate = agree / n
    print(f"builtin generate agreement: {agree}/{n} = {rate:.4f} (need >= {MIN_AGREEMENT}); "
          f"accuracy transformers {hf_correct / n:.4f}, vlmopt {ours_correct / n:.4f}")
    if n < args.limit:
        failures.append(f"only {n} samples packed, asked for {args.limit}")
    if rate < MIN_AGREEMENT:
        failures.append(f"answers agree on {rate:.4f} of samples, need >= {MIN_AGREEMENT}")
    for line in failures:
        print(f"FAIL: {line}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
