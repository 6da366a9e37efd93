#!/usr/bin/env python3
"""Would pre-packed or fused decoder GEMMs make a batch-1 prefill cheaper on this CPU? (issue 7)

Times, at the builtin decoder's shapes (hidden 256, MLP 768, 8 query / 4 KV heads
of 32), the plain `linear` that vlmopt's runtime calls (MKL sgemm, which packs
the weight on every call) against:
  - MKL's packed GEMM with the weight packed once (torch.ops.mkl._mkl_linear,
    what Inductor's freezing uses for FP32 on CPU),
  - oneDNN with the weight reordered once (torch.ops.mkldnn._linear_pointwise),
  - one fused q|k|v GEMM instead of three, one fused gate|up GEMM instead of two
    (what vLLM's QKVParallelLinear / MergedColumnParallelLinear do).
M (rows) = tokens in the pass: 156 / 84 are a batch-1 prefill unpruned / at 50 %
of the visual tokens, 1248 / 672 the same at batch 8. Median of --rounds rounds
of --iters calls each, ms per call.

    scripts/bench/gemm_variants.py [--threads 2] [--rounds 5] [--iters 200] [--out gemm.json]
"""
import argparse
import json
import statistics
import time

import torch

F = torch.nn.functional
HIDDEN, MLP, Q, KV = 256, 768, 256, 128


def per_call_ms(fn, iters: int) -> float:
    for _ in range(max(10, iters // 10)):
        fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e3


def variants(m: int) -> dict:
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, HIDDEN, generator=g)
    h = torch.randn(m, MLP, generator=g)
    w = {name: torch.randn(out, inp, generator=g) * 0.05
         for name, (out, inp) in {"q": (Q, HIDDEN), "k": (KV, HIDDEN), "v": (KV, HIDDEN), "gate": (MLP, HIDDEN),
                                  "up": (MLP, HIDDEN), "down": (HIDDEN, MLP)}.items()}
    mkl = {n: torch.ops.mkl._mkl_reorder_linear_weight(t, m) for n, t in w.items()}
    dnn = {n: torch.ops.mkldnn._reorder_linear_weight(t, m) for n, t in w.items()}
    qkv, gate_up = torch.cat([w["q"], w["k"], w["v"]]), torch.cat([w["gate"], w["up"]])
    inputs = {"q": x, "k": x, "v": x, "gate": x, "up": x, "down": h}
    out = {}
    # One decoder layer's seven projections, each way.
    out["linear (MKL, packs per call)"] = lambda: [F.linear(inputs[n], t) for n, t in w.items()]
    out["MKL packed once"] = lambda: [torch.ops.mkl._mkl_linear(inputs[n], mkl[n], w[n], None, m) for n in w]
    out["oneDNN reordered once"] = lambda: [torch.ops.mkldnn._linear_pointwise(inputs[n], dnn[n], None, "none", [], "")
                                             for n in w]

    def fused():
        F.linear(x, qkv).split([Q, KV, KV], -1)
        gu = F.linear(x, gate_up)
        F.linear(h, w["down"])
        return gu
    out["fused qkv + gate|up"] = fused
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rows", default="156,84,1248,672")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    fns = {m: variants(m) for m in rows}
    times = {m: {name: [] for name in fns[m]} for m in rows}
    for _ in range(args.rounds):  # interleaved rounds: a slow phase of the machine hits every variant
        for m in rows:
            for name, fn in fns[m].items():
                times[m][name].append(per_call_ms(fn, args.iters))
    result = {"threads": args.threads, "rounds": args.rounds, "iters": args.iters, "torch": torch.__version__,
              "unit": "ms per decoder layer's 7 projections", "rows": {}}
    for m in rows:
        med = {name: statistics.median(v) for name, v in times[m].items()}
        base = med["linear (MKL, packs per call)"]
        result["rows"][m] = {name: {"ms": round(t, 4), "vs_linear": round(t / base - 1, 3)} for name, t in med.items()}
        print(f"M={m:5d}  " + "  ".join(f"{name}: {t:.3f} ms ({t / base - 1:+.0%})" for name, t in med.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
