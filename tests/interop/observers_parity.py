#!/usr/bin/env python3
"""Observer parity: vlmopt's C++ observers against live reference implementations.

    python tests/interop/observers_parity.py [--keep DIR] [--seed N]

Writes activations and weights of several distributions (normal, heavy tail with
outliers, Student-t, all-positive, rows / channels of zeros and constants, all
zeros, 3-D [B, T, C], ranges that grow across batches) to activations.safetensors in a temp dir, one tensor per
case with its batches along dim 0. References, written to reference.safetensors:

  ao_*   torch.ao.quantization observers fed the same batches in order:
         MinMaxObserver (qint8 per_tensor_symmetric, quint8 per_tensor_affine),
         PerChannelMinMaxObserver (qint8 per_channel_symmetric; last dim for
         activations, dim 0 for weights), MovingAverageMinMaxObserver (c = 0.01).
         quint8 zero points are stored minus 128 (the same grid as int8's).
  ct_*   compressed-tensors' calculate_qparams (0.19) on the running min / max
         of all batches (llm-compressor's static_minmax), for int8 / int4 / fp8,
         per tensor, per weight row, per weight row and group of 32.
  kl, percentile
         this script's NumPy implementation of TensorRT's KL-entropy calibration
         (reference.md §3) and of the percentile rule, on a histogram binned the
         way calib/observers.hpp documents (power-of-two bin width fixed by the
         first non-zero batch, computed here in closed form over all the data).

Then runs `$VLMOPT_TESTS_BIN --source-file=*test_calib_observers_interop.cpp`
(default build/tests/vlmopt_tests) with VLMOPT_OBSERVER_REFERENCE and
VLMOPT_OBSERVER_OUTPUT; the C++ test asserts bit-equal scales, zero points and
KL / percentile amax. The script compares the C++ output once more, prints one
line per comparison and exits 1 on any mismatch or C++ failure.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # references on CPU, like the C++ test

import numpy as np  # noqa: E402
import torch  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.ao.quantization.observer import (  # noqa: E402
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    PerChannelMinMaxObserver,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

HISTOGRAM_BINS = 2048  # ObserverOptions::histogram_bins default
MAX_GROWTH = 8  # histograms coarsen beyond MAX_GROWTH * HISTOGRAM_BINS bins
KL_START_BIN = 128
KL_LEVELS = 128  # 2^(8-1) for int8
PERCENTILE = 99.99  # ObserverOptions::percentile default
GROUP_SIZE = 32


# ----------------------------------------------------------------------------- data


def make_cases(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(activation cases, weight cases); each tensor is [batches, ...]."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    acts: dict[str, torch.Tensor] = {}
    acts["normal"] = randn(4, 64, 96)
    heavy = randn(4, 256, 64)
    heavy[:, :, 3] *= 20.0  # an outlier channel, as in LLM activations
    spikes = torch.rand(heavy.shape, generator=g) < 2e-4
    heavy[spikes] = (torch.rand(int(spikes.sum()), generator=g) * 150 + 50) * torch.sign(randn(int(spikes.sum())))
    acts["heavy_tail"] = heavy
    chi2 = randn(3, 512, 32, 3).square().sum(-1) / 3
    acts["student_t3"] = randn(3, 512, 32) / chi2.sqrt()
    acts["all_positive"] = randn(3, 128, 48).abs() + 0.1
    rows = randn(3, 64, 32)
    rows[:, ::4, :] = 0.0  # zero rows (padding tokens)
    rows[:, :, 5] = 0.0  # a dead channel
    rows[:, :, 7] = 2.5  # a constant channel
    acts["zero_rows"] = rows
    acts["all_zero"] = torch.zeros(2, 16, 8)
    acts["btc_3d"] = randn(3, 2, 50, 40) * torch.linspace(0.1, 3.0, 40)  # [batches][B, T, C]
    growing = randn(3, 128, 16)
    growing[1] *= 5.0  # a later batch with a larger range: the histogram grows
    growing[2] *= 0.2
    acts["growing_range"] = growing
    coarsened = randn(3, 128, 16)
    coarsened[0] *= 0.05  # the first batch fixes a fine bin width ...
    coarsened[2] *= 8.0  # ... that a 160x larger range outgrows: the histogram coarsens
    acts["coarsened_range"] = coarsened

    weights: dict[str, torch.Tensor] = {}
    weights["w_normal"] = (randn(64, 128) * 0.02).unsqueeze(0)
    w = randn(48, 96) * 0.05
    w[::7, 11] = 1.5  # outlier weights
    w[5] = 0.0  # an all-zero row
    weights["w_outlier"] = w.unsqueeze(0)
    return acts, weights


# ----------------------------------------------------------------------------- references


def torch_ao(observer, batches: torch.Tensor, zp_offset: int = 0, shape=None) -> tuple[torch.Tensor, torch.Tensor]:
    for b in batches:
        observer(b)
    scale, zp = observer.calculate_qparams()
    scale = scale.to(torch.float32)
    zp = (zp.to(torch.int64) - zp_offset).to(torch.int32)
    if shape is not None:
        scale, zp = scale.reshape(shape), zp.reshape(shape)
    return scale, zp


def ct(min_vals: torch.Tensor, max_vals: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    scale, zp = calculate_qparams(min_vals, max_vals, QuantizationArgs(**kwargs))
    return scale.to(torch.float32), zp.to(torch.float32).to(torch.int32)


def width_exponent(absmax: float, bins: int) -> int:
    """Smallest e with absmax < bins * 2**e."""
    e = math.frexp(absmax / bins)[1]
    while absmax < math.ldexp(bins, e - 1):
        e -= 1
    while not absmax < math.ldexp(bins, e):
        e += 1
    return e


def histogram(batches: torch.Tensor) -> tuple[np.ndarray, int, float] | None:
    """|x| counts at the observer's final width, its exponent, and max |x|; None for all-zero data."""
    magnitudes = [b.abs().numpy().astype(np.float32).ravel() for b in batches]
    first = next((m for m in magnitudes if m.max() > 0), None)
    if first is None:
        return None
    absmax = float(max(m.max() for m in magnitudes))
    e = width_exponent(float(first.max()), HISTOGRAM_BINS)
    while math.floor(math.ldexp(absmax, -e)) + 1 > MAX_GROWTH * HISTOGRAM_BINS:
        e += 1
    bins = math.floor(math.ldexp(absmax, -e)) + 1
    a = np.concatenate(magnitudes)
    index = np.floor(a * np.float32(math.ldexp(1.0, -e))).astype(np.int64)  # exact: power-of-two scaling
    return np.bincount(index, minlength=bins), e, absmax


def kl_candidate(counts: np.ndarray) -> int:
    """TensorRT's entropy calibration, as published: the winning candidate bin count i."""
    bins = counts.astype(np.float64)
    bins[0] = bins[1]
    n = len(bins)
    divergences = []
    start = min(KL_START_BIN, n)
    for i in range(start, n + 1):
        level = (np.arange(i) * KL_LEVELS) // i  # = digitize(range(i), linspace(0, i, levels + 1)) - 1
        nonzero = bins[:i] > 0
        level_sum = np.bincount(level[nonzero], weights=bins[:i][nonzero], minlength=KL_LEVELS)
        level_count = np.bincount(level[nonzero], minlength=KL_LEVELS)
        q = np.zeros(i)
        q[nonzero] = level_sum[level[nonzero]] / level_count[level[nonzero]]
        p = bins[:i].copy()
        p[-1] += bins[i:].sum()
        p = p / p.sum()
        q_sum = q.sum()
        q = q / q_sum if q_sum > 0 else q
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(p > 0, np.where(q > 0, p * np.log(p / q), np.inf), 0.0)
        divergences.append(terms.sum())
    divergences = np.array(divergences)
    last_min = len(divergences) - 1 - int(np.argmin(divergences[::-1]))
    return start + last_min


def percentile_bin(counts: np.ndarray) -> int:
    cumulative = np.cumsum(counts).astype(np.float64)
    target = PERCENTILE / 100.0 * float(counts.sum())
    return int(np.searchsorted(cumulative, target, side="left"))


def references(acts: dict, weights: dict) -> dict[str, torch.Tensor]:
    ref: dict[str, torch.Tensor] = {}

    def put(prefix: str, scale_zp: tuple[torch.Tensor, torch.Tensor]) -> None:
        ref[f"{prefix}/scale"], ref[f"{prefix}/zero_point"] = scale_zp

    for name, batches in {**acts, **weights}.items():
        is_weight = name in weights
        mn = torch.stack([b.min() for b in batches]).min()
        mx = torch.stack([b.max() for b in batches]).max()
        put(f"{name}/ao_minmax_tensor_sym",
            torch_ao(MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric), batches))
        put(f"{name}/ao_minmax_tensor_affine",
            torch_ao(MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_affine), batches, zp_offset=128))
        put(f"{name}/ct_tensor_sym", ct(mn, mx, num_bits=8, symmetric=True, strategy="tensor"))
        put(f"{name}/ct_tensor_affine", ct(mn, mx, num_bits=8, symmetric=False, strategy="tensor"))
        put(f"{name}/ct_tensor_int4_sym", ct(mn, mx, num_bits=4, symmetric=True, strategy="tensor"))
        put(f"{name}/ct_tensor_fp8", ct(mn, mx, num_bits=8, type="float", symmetric=True, strategy="tensor"))
        if is_weight:
            w = batches[0]
            put(f"{name}/ao_minmax_wchannel_sym",
                torch_ao(PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric),
                         batches, shape=(w.shape[0], 1)))
            row_min, row_max = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
            put(f"{name}/ct_wchannel_sym", ct(row_min, row_max, num_bits=8, symmetric=True, strategy="channel"))
            put(f"{name}/ct_wchannel_affine", ct(row_min, row_max, num_bits=8, symmetric=False, strategy="channel"))
            grouped = w.reshape(w.shape[0], -1, GROUP_SIZE)
            for symmetric, tag in ((True, "sym"), (False, "affine")):
                put(f"{name}/ct_wgroup_int4_{tag}",
                    ct(grouped.amin(-1), grouped.amax(-1), num_bits=4, symmetric=symmetric, strategy="group",
                       group_size=GROUP_SIZE))
            continue
        put(f"{name}/ao_minmax_channel_sym",
            torch_ao(PerChannelMinMaxObserver(ch_axis=-1, dtype=torch.qint8, qscheme=torch.per_channel_symmetric),
                     batches))
        put(f"{name}/ao_moving_tensor_sym",
            torch_ao(MovingAverageMinMaxObserver(averaging_constant=0.01, dtype=torch.qint8,
                                                 qscheme=torch.per_tensor_symmetric), batches))
        put(f"{name}/ao_moving_tensor_affine",
            torch_ao(MovingAverageMinMaxObserver(averaging_constant=0.01, dtype=torch.quint8,
                                                 qscheme=torch.per_tensor_affine), batches, zp_offset=128))
        hist = histogram(batches)
        if hist is None:
            ref[f"{name}/kl/amax"] = torch.zeros(1)
            ref[f"{name}/percentile/amax"] = torch.zeros(1)
            continue
        counts, e, absmax = hist
        width = math.ldexp(1.0, e)
        ref[f"{name}/kl/hist"] = torch.from_numpy(counts.astype(np.int64))
        ref[f"{name}/kl/exponent"] = torch.tensor([e], dtype=torch.int64)
        ref[f"{name}/kl/amax"] = torch.tensor([min(kl_candidate(counts) * width, absmax)], dtype=torch.float32)
        ref[f"{name}/percentile/amax"] = torch.tensor([min((percentile_bin(counts) + 1) * width, absmax)],
                                                      dtype=torch.float32)
    return ref


# ----------------------------------------------------------------------------- comparison


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and a.contiguous().view(torch.uint8).flatten().tolist() == b.contiguous().view(torch.uint8).flatten().tolist())


def read_all(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def compare(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> int:
    """Prints one line per comparison (case/comparison); returns the number of mismatches."""
    groups = sorted({k.rsplit("/", 1)[0] for k in ref})
    failures = 0
    for group in groups:
        keys = sorted(k for k in ref if k.rsplit("/", 1)[0] == group)
        problems = []
        for key in keys:
            if key not in got:
                problems.append(f"{key.rsplit('/', 1)[1]} missing from the C++ output")
            elif not bitwise_equal(ref[key], got[key]):
                a, b = ref[key], got[key]
                if a.shape == b.shape:
                    diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
                    problems.append(f"{key.rsplit('/', 1)[1]} differs (max |diff| {diff:.3g})")
                else:
                    problems.append(f"{key.rsplit('/', 1)[1]} shape {list(b.shape)} != {list(a.shape)}")
        fields = ", ".join(k.rsplit("/", 1)[1] for k in keys)
        if problems:
            failures += 1
            print(f"MISMATCH {group}: " + "; ".join(problems))
        else:
            detail = ""
            if group.endswith("/kl") or group.endswith("/percentile"):
                detail = f" (amax {ref[group + '/amax'].item():.6g})"
            print(f"ok       {group}: {fields} bit-equal{detail}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", type=Path, help="write the files here and keep them")
    parser.add_argument("--seed", type=int, default=20241130)
    args = parser.parse_args()

    tests_bin = os.environ.get("VLMOPT_TESTS_BIN") or str(REPO_ROOT / "build" / "tests" / "vlmopt_tests")
    if not Path(tests_bin).is_file():
        print(f"observers_parity: {tests_bin}: test binary not found (set VLMOPT_TESTS_BIN)", file=sys.stderr)
        return 1

    with tempfile.TemporaryDirectory(prefix="vlmopt_observers_") as tmp:
        out_dir = args.keep or Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        acts, weights = make_cases(args.seed)
        activations_path = out_dir / "activations.safetensors"
        reference_path = out_dir / "reference.safetensors"
        output_path = out_dir / "cpp_output.safetensors"
        save_file({k: v.contiguous() for k, v in {**acts, **weights}.items()}, str(activations_path))
        ref = references(acts, weights)
        save_file({k: v.contiguous() for k, v in ref.items()}, str(reference_path),
                  metadata={"activations": str(activations_path)})

        env = dict(os.environ, VLMOPT_OBSERVER_REFERENCE=str(reference_path), VLMOPT_OBSERVER_OUTPUT=str(output_path))
        run = subprocess.run([tests_bin, "--source-file=*test_calib_observers_interop.cpp", "--force-colors=0"],
                             env=env, capture_output=True, text=True)
        if not output_path.is_file():
            sys.stdout.write(run.stdout)
            sys.stderr.write(run.stderr)
            print(f"observers_parity: the C++ test wrote no output (exit {run.returncode})", file=sys.stderr)
            return 1
        failures = compare(ref, read_all(output_path))
        groups = len({k.rsplit("/", 1)[0] for k in ref})
        if run.returncode != 0:
            sys.stdout.write(run.stdout)
            sys.stderr.write(run.stderr)
        print(f"observers_parity: {groups - failures}/{groups} comparisons bit-equal; C++ test exit {run.returncode}")
        return 0 if failures == 0 and run.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
