#!/usr/bin/env python3
"""Training-step time of the builtin model's parts under each attention kernel (train_builtin --attention).

Times one optimizer step (forward, backward, AdamW) of the shapes scripts/train_builtin.py trains,
with the builtin model's configuration (train_builtin.make_config) and random weights and inputs:

  * tower      the CLIP vision tower on a 64-image batch (the vision stage's --vision-batch), under --precision
  * prestage   the LLaMA decoder on 64 symbolic scenes of ~24 tokens (the decoder pre-stage), fp32
  * joint      the LLaMA decoder on 32 sequences of 200 tokens, a quarter of them left-padded (the joint
               stage's image tokens plus turns), under --precision

for attention "sdpa" (PyTorch's scaled_dot_product_attention: its CPU flash-attention kernels) and "eager"
(matmul, softmax, matmul). Each part runs `--warmup` untimed steps, then `--steps` timed ones; the
median step is reported. CPU, --threads threads. --precision as train_builtin.py's: auto is bf16 autocast
where the CPU has bfloat16 instructions and fp32 elsewhere.

    scripts/bench/train_attention.py [--threads 2] [--steps 10] [--warmup 3] [--precision auto] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_builtin  # noqa: E402  (make_config: the shipped architecture)
from transformers import CLIPVisionModel, LlamaForCausalLM  # noqa: E402


def step_seconds(model, make_loss, bf16: bool, warmup: int, steps: int) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = make_loss(model)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--precision", choices=train_builtin.PRECISIONS, default=train_builtin.PRECISIONS[0],
                    help="the tower and joint parts' autocast, as train_builtin.py --precision")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    args.precision = train_builtin.resolve_precision(args.precision, train_builtin.cpu_has_native_bf16())
    autocast = args.precision == "bf16"
    torch.set_num_threads(args.threads)
    config = train_builtin.make_config(67, 4, {"<s>": 2, "</s>": 3, "<pad>": 0})
    size = train_builtin.IMAGE_SIZE

    pixels = torch.randn(64, 3, size, size, generator=torch.Generator().manual_seed(0))  # outside the timed steps

    def tower_loss(model):
        out = model(pixel_values=pixels, output_hidden_states=True)
        return out.hidden_states[config.vision_feature_layer].float().pow(2).mean()

    def decoder_loss(batch: int, length: int):
        ids = torch.randint(5, config.text_config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[: batch // 4, : length // 4] = 0
        return lambda model: model(input_ids=ids, attention_mask=mask, labels=ids).loss

    parts = {
        "tower": (lambda: CLIPVisionModel(config.vision_config), tower_loss, autocast),
        "prestage": (lambda: LlamaForCausalLM(config.text_config), decoder_loss(64, 24), False),
        "joint": (lambda: LlamaForCausalLM(config.text_config), decoder_loss(32, 200), autocast),
    }
    results = {}
    for part, (build, make_loss, bf16) in parts.items():
        row = {}
        for attention in ("sdpa", "eager"):
            torch.manual_seed(0)
            model = build()
            model.set_attn_implementation(attention)
            row[attention] = round(step_seconds(model, make_loss, bf16, args.warmup, args.steps), 4)
        row["eager_over_sdpa"] = round(row["eager"] / row["sdpa"], 3)
        results[part] = row
        print(f"{part:9s} sdpa {row['sdpa']:.3f} s/step  eager {row['eager']:.3f} s/step  "
              f"eager/sdpa {row['eager_over_sdpa']:.2f}", flush=True)
    report = {"results": results, "threads": args.threads, "steps": args.steps, "precision": args.precision,
              "torch": torch.__version__,
              "machine": platform.processor() or platform.machine(), "command": " ".join(sys.argv)}
    try:
        report["cpu"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                             if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
