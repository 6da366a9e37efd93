#!/usr/bin/env python3
"""vlmopt's greedy answers on the builtin model agree with transformers' `generate`.

    VLMOPT_BIN=build/apps/vlmopt/vlmopt python tests/interop/builtin_generate.py [--limit 200]
        [--bundle B | --compensated-bundle]

Packs the first --limit samples of builtin:eval with `vlmopt datasets pack`
(same images, questions and ids vlmopt evaluates), runs
`vlmopt eval --model builtin --predictions P`, then answers the same samples with
LlavaForConditionalGeneration.generate (greedy, same max_new_tokens) on the
images preprocessed by the checkpoint's own AutoProcessor. Requires agreement on
>= 99.5 % of the samples (issue 3), a near-tie (transformers' top-2 logits within TIE_MARGIN)
counting as agreement, at most MAX_TIE_SHARE of them; prints both accuracies and every
disagreement with transformers' margin.

With --bundle B the same comparison runs on a vlmopt bundle: transformers loads B
(compressed-tensors applies its quantization_config), vlmopt runs
`eval --bundle B --no-mp-cache` (what compressed-tensors computes: no FP16
outlier channels). --compensated-bundle first makes one: `vlmopt calibrate`
W8A8 with the vision tower quantized too, then `vlmopt compensate`, whose
adapter is folded into the projector (issue 6: the folded bundle loads in
transformers and answers as vlmopt's runtime does).
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
# A disagreement where transformers' own top-2 logits are closer than this is a tie: two correct
# float32 / int8 implementations may break it either way (seen: 0.0002 on a W8A8 bundle, AMD host).
# Ties count as agreement, at most MAX_TIE_SHARE of the samples, so that ties cannot hide a bug.
TIE_MARGIN = 1e-3
MAX_TIE_SHARE = 0.05
MAX_NEW_TOKENS = 8


def make_compensated_bundle(vlmopt: str, model_dir: Path, bundle: Path) -> str | None:
    """calibrate (W8A8, vision tower quantized) + compensate into `bundle`; an error line or None.

    The scheme of docs/BENCHMARKS.md's compensation figures (percentile-90 inputs,
    no outlier channels): it loses accuracy, so the adapter learns a real correction."""
    steps = [
        [vlmopt, "-q", "calibrate", "--model", str(model_dir), "--data", "builtin:calib", "--samples", "32",
         "--observer", "percentile", "--percentile", "90", "--outlier-threshold", "0", "--ignore", "lm_head", "--ignore", r"re:model\.multi_modal_projector\.", "--out", str(bundle)],
        # --keep-worse: fold the trained adapter even if 20 steps do not lower the loss,
        # so the bundle always carries a non-identity fold to check.
        [vlmopt, "-q", "--json", "compensate", "--model", str(model_dir), "--bundle", str(bundle),
         "--data", "builtin:calib", "--samples", "32", "--steps", "20", "--keep-worse"],
    ]
    for cmd in steps:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            return f"{' '.join(cmd[:3])} exited {r.returncode}: {r.stderr.strip()[-500:]}"
    report = json.loads(r.stdout)
    print(f"compensate: loss {report.get('loss_before')} -> {report.get('loss_after')}, gate {report.get('gate')}")
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--model", default=str(REPO_ROOT / "models" / "builtin"))
    target = ap.add_mutually_exclusive_group()
    target.add_argument("--bundle", type=Path, help="compare on this vlmopt bundle of --model instead")
    target.add_argument("--compensated-bundle", action="store_true",
                        help="make a vision-quantized, compensated bundle of --model and compare on it")
    ap.add_argument("--min-agreement", type=float, default=MIN_AGREEMENT)
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
        bundle = args.bundle
        if args.compensated_bundle:
            bundle = Path(tmp) / "bundle"
            made = make_compensated_bundle(vlmopt, model_dir, bundle)
            if made:
                print(f"FAIL: {made}")
                return 1
        target_args = ["--bundle", str(bundle), "--no-mp-cache"] if bundle else ["--model", str(model_dir)]
        res = subprocess.run([vlmopt, "-q", "--json", "eval", *target_args, "--data", str(pack),
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
        hf_dir = bundle or model_dir
        processor = AutoProcessor.from_pretrained(hf_dir)
        model = LlavaForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
        if bundle:
            quantized = [n for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None]
            vision = [n for n in quantized if ".vision_tower." in n]
            print(f"transformers loaded {bundle.name}: {len(quantized)} quantized Linears, {len(vision)} in the vision tower")
            if args.compensated_bundle and not vision:
                print("FAIL: compressed-tensors applied no scheme to the vision tower")
                return 1
    tok = processor.tokenizer
    agree = ties = hf_correct = ours_correct = 0
    failures = []
    with torch.no_grad():
        for i, sample_id in enumerate(ids):
            prompt = template.replace("{question}", questions[i])
            inputs = processor(images=Image.fromarray(images[i]), text=prompt, return_tensors="pt")
            gen = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                 output_scores=True, return_dict_in_generate=True)
            out = gen.sequences
            # transformers' smallest top-1 minus top-2 logit gap over the generated steps
            margin = min(float(top[0, 0] - top[0, 1]) for top in (s.topk(2, dim=-1).values for s in gen.scores))
            hf_answer = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
            mine = ours[sample_id]["prediction"].strip()
            agree += hf_answer == mine
            ties += hf_answer != mine and margin < TIE_MARGIN
            hf_correct += hf_answer == answers[i]
            ours_correct += mine == answers[i]
            if hf_answer != mine:
                print(f"  differ {sample_id}: {questions[i]!r} transformers={hf_answer!r} vlmopt={mine!r} "
                      f"(transformers' top-2 logit margin {margin:.4f})")
    n = len(ids)
    rate = (agree + ties) / n
    print(f"builtin generate agreement: {agree}/{n} + {ties} ties = {rate:.4f} (need >= {args.min_agreement}); "
          f"accuracy transformers {hf_correct / n:.4f}, vlmopt {ours_correct / n:.4f}")
    if n < args.limit:
        failures.append(f"only {n} samples packed, asked for {args.limit}")
    if ties > MAX_TIE_SHARE * n:
        failures.append(f"{ties} ties (top-2 logit margin < {TIE_MARGIN}) in {n} samples, at most {MAX_TIE_SHARE:.0%}")
    if rate < args.min_agreement:
        failures.append(f"answers agree on {rate:.4f} of samples, need >= {args.min_agreement}")
    for line in failures:
        print(f"FAIL: {line}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
