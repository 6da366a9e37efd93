#!/usr/bin/env python3
"""Regenerate the LLaVA parity fixtures with the installed transformers and compare.

    python tests/interop/regen_and_compare.py [--fixtures DIR] [--keep DIR]

Checks, per variant of scripts/make_fixtures.py, that a fresh build matches the
committed one in tests/fixtures: same files, same JSON content, weights
bitwise equal, integer reference tensors (input_ids, generated_ids, ...) and
pixel_values equal, float outputs (logits, hidden states, image features)
within 1e-5 + 1e-5 * |value| (torch.allclose's form). Exits 1 with one line per mismatch, else prints a one-line summary.

Then, if VLMOPT_TESTS_BIN is set, runs
`$VLMOPT_TESTS_BIN --source-file=*test_model_parity.cpp` with
VLMOPT_FIXTURES_DIR_OVERRIDE=<fresh fixtures dir> and exits with its status.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import make_fixtures  # noqa: E402  (sets the offline/CPU environment before transformers loads)
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

# The same wheel takes different SIMD kernels on different CPUs (AVX-512 on the Intel
# hosts, AVX2 on the AMD ones), which reassociates sums: the committed fixtures,
# written on AMD, come back within 1.3e-05 on Intel where |logits| is a few units.
FLOAT_ATOL, FLOAT_RTOL = 1e-5, 1e-5
# Inputs are drawn from seeded generators and must match exactly.
EXACT_REFERENCE = {"pixel_values", "input_ids", "attention_mask", "generated_ids"}
# Metadata that may legitimately differ when the installed versions differ
# from the ones that wrote the committed files (reported, not failed).
VERSION_METADATA = {"transformers_version", "torch_version"}


def read_all(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same bytes (unlike ==, distinguishes -0.0 from 0.0 and matches NaN payloads)."""
    return a.contiguous().view(torch.uint8).flatten().tolist() == b.contiguous().view(torch.uint8).flatten().tolist()


def compare_tensors(where: str, want: dict, got: dict, exact: bool, errors: list[str]) -> float:
    """Appends mismatches to `errors`; returns the largest |difference| among float tensors."""
    worst = 0.0
    for name in sorted(set(want) | set(got)):
        if name not in got:
            errors.append(f"{where}: tensor {name} missing from the regenerated file")
            continue
        if name not in want:
            errors.append(f"{where}: regenerated file has unexpected tensor {name}")
            continue
        a, b = want[name], got[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            errors.append(
                f"{where}: {name} is {b.dtype} {list(b.shape)} (expected {a.dtype} {list(a.shape)})"
            )
            continue
        if exact or name in EXACT_REFERENCE or not a.is_floating_point():
            if not bitwise_equal(a, b):
                diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
                errors.append(f"{where}: {name} differs (expected bitwise equal, max |diff| {diff:.3g})")
            continue
        diff = (a - b).abs().max().item() if a.numel() else 0.0
        worst = max(worst, diff)
        excess = ((a - b).abs() - FLOAT_RTOL * a.abs()).max().item() if a.numel() else 0.0
        if not excess <= FLOAT_ATOL:  # also catches NaN
            errors.append(f"{where}: {name} max |diff| {diff:.3g} (expected <= {FLOAT_ATOL} + {FLOAT_RTOL} * |value|)")
    return worst


def compare_variant(name: str, committed: Path, fresh: Path, errors: list[str], notes: list[str]) -> float:
    if not committed.is_dir():
        errors.append(f"{committed}: committed fixture directory missing")
        return 0.0
    want_files = {p.name for p in committed.iterdir() if p.is_file()}
    got_files = {p.name for p in fresh.iterdir() if p.is_file()}
    for missing in sorted(want_files - got_files):
        errors.append(f"{name}/{missing}: not produced by the regeneration")
    for extra in sorted(got_files - want_files):
        errors.append(f"{name}/{extra}: produced by the regeneration but not committed")

    worst = 0.0
    for file in sorted(want_files & got_files):
        where = f"{name}/{file}"
        if file.endswith(".json"):
            want = json.loads((committed / file).read_text())
            got = json.loads((fresh / file).read_text())
            if isinstance(want, dict) and isinstance(got, dict):
                want_version = want.pop("transformers_version", None)
                got_version = got.pop("transformers_version", None)
                if want_version != got_version:
                    notes.append(f"{where}: transformers_version {got_version!r} (committed {want_version!r})")
            if want != got:
                errors.append(f"{where}: JSON content differs")
        elif file == "reference.safetensors":
            want_t, want_meta = read_all(committed / file)
            got_t, got_meta = read_all(fresh / file)
            worst = max(worst, compare_tensors(where, want_t, got_t, exact=False, errors=errors))
            for key in sorted(set(want_meta) | set(got_meta)):
                if want_meta.get(key) == got_meta.get(key):
                    continue
                message = f"{where}: metadata {key} is {got_meta.get(key)!r} (committed {want_meta.get(key)!r})"
                (notes if key in VERSION_METADATA else errors).append(message)
        elif file.endswith(".safetensors"):
            want_t, _ = read_all(committed / file)
            got_t, _ = read_all(fresh / file)
            compare_tensors(where, want_t, got_t, exact=True, errors=errors)
        elif (committed / file).read_bytes() != (fresh / file).read_bytes():
            errors.append(f"{where}: content differs")
    return worst


def run_cpp_parity(fixtures_dir: Path) -> int:
    binary = os.environ.get("VLMOPT_TESTS_BIN")
    if not binary:
        return 0
    env = dict(os.environ, VLMOPT_FIXTURES_DIR_OVERRIDE=str(fixtures_dir))
    command = [binary, "--source-file=*test_model_parity.cpp"]
    print(f"regen_and_compare: running {' '.join(command)} with VLMOPT_FIXTURES_DIR_OVERRIDE={fixtures_dir}",
          flush=True)
    try:
        return subprocess.run(command, env=env, check=False).returncode
    except OSError as err:
        print(f"regen_and_compare: cannot run VLMOPT_TESTS_BIN={binary}: {err}", file=sys.stderr)
        return 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fixtures", type=Path, default=REPO_ROOT / "tests" / "fixtures",
                        help="committed fixtures root (default tests/fixtures)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="regenerate into this directory and keep it (default: a temporary directory)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="vlmopt_fixtures_") as tmp:
        fresh_root = args.keep if args.keep is not None else Path(tmp)
        status = make_fixtures.main(["--quiet", "--out", str(fresh_root), "--variant", *make_fixtures.VARIANTS])
        if status != 0:
            print("regen_and_compare: FAILED: regeneration itself failed (see above)", file=sys.stderr)
            return status

        errors: list[str] = []
        notes: list[str] = []
        worst = 0.0
        for name in make_fixtures.VARIANTS:
            worst = max(worst, compare_variant(name, args.fixtures / name, fresh_root / name, errors, notes))
        for note in notes:
            print(f"regen_and_compare: note: {note}", file=sys.stderr)
        if errors:
            for error in errors:
                print(f"regen_and_compare: MISMATCH {error}", file=sys.stderr)
            print(f"regen_and_compare: FAILED: {len(errors)} mismatch(es) against {args.fixtures}",
                  file=sys.stderr)
            return 1
        print(
            f"regen_and_compare: OK: {len(make_fixtures.VARIANTS)} variants match {args.fixtures} "
            f"(weights bitwise, generated ids equal, max float |diff| {worst:.3g} <= {FLOAT_ATOL})",
            flush=True,
        )
        return run_cpp_parity(fresh_root)


if __name__ == "__main__":
    sys.exit(main())
